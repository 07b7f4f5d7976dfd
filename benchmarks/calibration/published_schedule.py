"""Price a Megatron-LM row's pipeline transfers and data-parallel sync the way that run performed them.

The planner prices what autopar's runtime does: a stage's output is gathered whole over the sending stage's
mesh before it is sent (``passes.intra_op_prices._send_preparation``), and the gradient sync overlaps the last
microbatch's backward (``plan_builder.exposed_sync``). Megatron-LM's SC'21 runs did neither in that way:

* Transfers (Narayanan et al. 2021, §4.1, "scatter/gather communication optimization"): every data-parallel
  replica sends only its own microbatch, and the tensor-parallel ranks, which all hold the same activation,
  each send a 1/t slice of it over their own InfiniBand card; the receiving ranks all-gather the slices over
  NVLink. So the sender's forward and backward per microbatch lose the planner's gather and its backward,
  and the schedule replays with t_send as the hop; per microbatch and direction, with L the bytes one
  replica holds, r the sender's replicated ways and β_gpu one rank's bandwidth:

      t_send = α + (L / r) / β_gpu + all_gather over the r replicated ways (L bytes)

  (across nodes α, β_gpu are the inter-node link's, its per-node bandwidth shared by the sender's ranks on a
  node; between stages on the same nodes, the intra-node link's for a pair).

* Gradient sync: torch DDP ("overlapped") all-reduces its buckets while backward runs, as the planner
  prices; Megatron's local DDP ("after_backward") all-reduces the whole gradient buffer after the last
  backward, so all of it is exposed. Which one a row ran is in ``published.Run.grad_sync``.

The adjusted step is ``plan_builder.predict`` over the adjusted stages: the same schedule replay as the plan's
own prediction. Once the planner prices shard-to-shard transfers itself, the transfer half is redundant.
"""
from __future__ import annotations

import copy
import math

from autopar.cost_models.communication import axis_links, redistribute_cost
from autopar.placement import R, parse_spec
from autopar.plan_builder import predict


def gathered_send_seconds(graph, stage, value: str, microbatches: int, cluster) -> tuple[float, float]:
    """(forward, backward) seconds per microbatch the planner charged the sender of ``value`` for gathering it
    whole before the send and for the backward of that gather: what ``_send_preparation`` prices."""
    val = _value(graph, value)
    shape = (val.shape[0] // microbatches, *val.shape[1:])
    spec = parse_spec(stage.shardings[value].out)
    links = axis_links(cluster, stage.mesh_shape, _width(stage, cluster))
    return redistribute_cost(shape, val.element_size(), spec, (R,) * len(spec), stage.mesh_shape, links, (), True)


def scatter_gather_seconds(sender, receiver, value: str, nbytes: float, cluster) -> float:
    """t_send of the module docstring for one microbatch of ``value`` (global bytes ``nbytes``), one direction,
    from stage ``sender`` to stage ``receiver``. Across nodes, the sender's ranks on one node share its NICs
    (β_gpu = inter-node bandwidth per node / those ranks); inside a node each rank pair has its own link."""
    spec = parse_spec(sender.shardings[value].out)
    sharded = math.prod(n for n, p in zip(sender.mesh_shape, spec) if p.is_shard())
    replicated = math.prod(sender.mesh_shape) // sharded
    local = nbytes / sharded
    per_node = cluster.devices_per_node
    nodes = {r // per_node for r in sender.ranks}
    if nodes == {r // per_node for r in receiver.ranks}:
        link, per_gpu = cluster.intra_node, cluster.intra_node.bandwidth_for(2)
    else:
        link, per_gpu = cluster.inter_node, cluster.inter_node.bandwidth / (len(sender.ranks) / len(nodes))
    seconds = link.latency + local / replicated / per_gpu
    if replicated > 1:
        axis = max(range(len(spec)), key=lambda a: sender.mesh_shape[a] if not spec[a].is_shard() else 0)
        seconds += axis_links(cluster, sender.mesh_shape, _width(sender, cluster))[axis].time("all_gather", local)
    return seconds


def published_prediction(plan, graph, cluster, grad_sync: str = "overlapped") -> dict:
    """``plan.predicted`` recomputed with scatter/gather transfers and the run's gradient sync, "overlapped"
    with backward (torch DDP) or "after_backward" (Megatron's local DDP); module docstring."""
    stages = copy.deepcopy(plan.stages)
    transfers = copy.deepcopy(plan.transfers)
    for t in transfers:
        sender = stages[t["src"]]
        fwd, bwd = gathered_send_seconds(graph, sender, t["value"], plan.microbatches, cluster)
        p = sender.predicted
        p.update(latency=p["latency"] - fwd - bwd, forward=p["forward"] - fwd, backward=p["backward"] - bwd)
        t["seconds"] = 2 * scatter_gather_seconds(sender, stages[t["dst"]], t["value"], t["nbytes"], cluster)
    if grad_sync == "after_backward":
        for s in stages:
            s.predicted["sync_buckets"] = 1.0  # one buffer after backward: exposed_sync exposes all of it
    return predict(stages, plan.microbatches, plan.schedule, transfers)


def _value(graph, name: str):
    for node in graph.gm.graph.nodes:
        if node.name == name:
            return node.meta["val"]
    raise KeyError(f"value {name!r} is not a node of the captured graph")


def _width(stage, cluster) -> int:
    return stage.submesh[1] if stage.submesh[0] == 1 else cluster.devices_per_node
