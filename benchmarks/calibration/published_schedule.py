"""Price a published row's gradient sync and recompute the way that run performed them.

The planner prices what autopar's runtime does; published runs' systems did otherwise in two ways, and each
row says which (``published.Run``). Everything else is the plan's own prediction, ZeRO-3 included: autopar's
runtime prefetches its all-gathers as FSDP2 does (unit k+1's all-gather in flight while unit k computes, in
bf16 under a bf16 policy) and the plan charges only what compute does not hide
(``cost_models.zero3.exposed_gather``, over autopar's units: its sync buckets, where FSDP2's are blocks).

* Gradient sync (``grad_sync``): autopar buckets it and overlaps the last microbatch's backward
  (``plan_builder.exposed_sync``), as torch DDP, Alpa and FSDP do ("overlapped": the plan's own price).
  Megatron-LM's local DDP (``--DDP-impl local``: the Alpa artifact's benchmark_gpt_one_case.py always uses
  it; SC'21's run_table_1.sh from 39B on) all-reduces the whole buffer after the last backward
  ("after_backward"): all of it exposed, i.e. one sync bucket per stage.

* Recompute "op_sac" (torchtitan's selective activation checkpointing, option "op"): in every block the
  outputs of the 1st, 3rd, 5th, ... ``mm`` and of attention are saved, everything else is recomputed in
  backward. The planner prices "full" (every op of the block rerun; ``passes.recompute``); the run reruns
  the share ρ of the block's forward FLOPs outside the saved ops (``op_sac_share``), so the recompute it
  charged is scaled by ρ, as the planner's own "selective" mode scales by its attention core's FLOP share.
  Memory-bound ops carry no FLOPs, so their rerun is priced at ρ of their time, not all of it: an
  under-estimate of the run's recompute.

* Fused scale-mask-softmax (``fused_softmax``): Megatron-LM's ``FusedScaleMaskSoftmax`` (its
  ``scaled_upper_triang_masked_softmax`` kernel, on by default as ``--masked-softmax-fusion``) applies the causal
  mask inside the softmax kernel, forward and backward; Alpa's XLA fuses the mask's select into the softmax's
  reduction the same way. The GPT written op by op (``examples.gpt``, materialized attention) runs a separate
  ``masked_fill`` over the score matrix first, which autopar's eager runtime really pays and the plan prices
  (read and write of b·h·s² elements, three times with backward). For these runs that pass is taken out:
  each stage's ``masked_fill`` nodes on 4-D score tensors are priced with ``cost_models.compute.compute_time``
  under the plan's own shardings, per microbatch, and removed from forward (1/3) and backward (2/3, plus the
  forward's share again where the stage recomputes).

* Attention kernel (``attention_kernel``): where the run's fused attention was another kernel than the one
  torch's SDPA picks on the cluster (flash), each stage's SDPA nodes are re-priced at that kernel's rate
  (``cost_models.compute.ATTENTION_RATE``): the plan's seconds for them (``compute_time`` under the plan's
  shardings) times flash's rate over the run kernel's, split between forward and backward by their FLOPs.
  llm-foundry's MPT runs used its Triton FlashAttention with the ALiBi bias (``attn_impl: triton``, the
  default of its ``submit_benchmarks.py``), a FlashAttention-1-level kernel: "efficient".

The adjusted step is ``plan_builder.predict`` over the adjusted stages: the same schedule replay as the
plan's own prediction. Pipeline transfers need no adjustment: the planner prices shard-to-shard sends
itself (``autopar.ir.shard_boxes``: each piece crosses the slow link once, the receivers gather over their
own links), which is Megatron-LM's scatter/gather optimization (Narayanan et al. 2021, §4.1).
"""
from __future__ import annotations

import copy
import re

from autopar.cost_models.compute import ATTENTION_RATE, attention_kernel, attention_rate, compute_time, node_flops
from autopar.hardware.cluster import Cluster
from autopar.placement import parse_spec, shard_fraction
from autopar.planner.plan_builder import predict
from passes.strategies.base import Strategy

GRAD_SYNCS = ("overlapped", "after_backward")
MATMULS = ("aten.linear.default", "aten.mm.default", "aten.addmm.default")
ATTENTION = "scaled_dot_product"
BLOCK_PATH = re.compile(r"(^|\.)layers\.(\d+)(\.|$)")


def op_sac_share(graph) -> float:
    """ρ: the share of the blocks' forward FLOPs that torchtitan's op-level selective checkpointing reruns
    (module docstring). Blocks are the ops under a module path ``[...].layers.<i>``; their matmuls are counted
    in graph order, and the even-numbered ones (2nd, 4th, ...) are rerun, attention never."""
    total = rerun = 0.0
    counts: dict[str, int] = {}
    for node in graph.gm.graph.nodes:
        block = _block_of(node)
        if block is None:
            continue
        flops = node_flops(node)[0]
        total += flops
        target = str(node.target)
        if target in MATMULS:
            counts[block] = counts.get(block, 0) + 1
            rerun += flops if counts[block] % 2 == 0 else 0.0
        elif ATTENTION not in target:
            rerun += flops
    return rerun / total if total else 0.0


def _block_of(node) -> str | None:
    if node.op != "call_function":
        return None
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    match = BLOCK_PATH.search(path)
    return match.group(2) if match else None


def published_prediction(plan, run, graph=None) -> dict:
    """``plan.predicted`` with the run's gradient sync and recompute (module docstring). ``graph``: the
    captured graph, needed for ``run.recompute == "op_sac"``."""
    if run.grad_sync not in GRAD_SYNCS:
        raise ValueError(f"grad_sync {run.grad_sync!r}: expected one of {GRAD_SYNCS}")
    fused, kernel = getattr(run, "fused_softmax", False), getattr(run, "attention_kernel", "")
    if run.grad_sync == "overlapped" and run.recompute != "op_sac" and not fused and not kernel:
        return dict(plan.predicted)
    cluster = Cluster.from_dict(plan.cluster) if fused or kernel else None
    stages = copy.deepcopy(plan.stages)
    share = op_sac_share(graph) if run.recompute == "op_sac" else 1.0
    for s in stages:
        p = s.predicted
        if run.grad_sync == "after_backward":
            p["sync_buckets"] = 1.0  # one buffer after backward: exposed_sync exposes all of it
        saved = (1.0 - share) * p.get("recompute", 0.0)
        _shift(p, "backward", -saved)
        if fused:
            mask = score_mask_seconds(s, graph, cluster) / plan.microbatches
            _shift(p, "forward", -mask / 3)
            _shift(p, "backward", -mask * (2 / 3 + (1 / 3 if s.recompute else 0.0)))
        if kernel:
            fwd, bwd = attention_extra_seconds(s, graph, cluster, kernel)
            _shift(p, "forward", fwd / plan.microbatches)
            _shift(p, "backward", (bwd + (fwd if s.recompute else 0.0)) / plan.microbatches)
    return predict(stages, plan.microbatches, plan.schedule, plan.transfers, plan.virtual_stages)


def _planned_seconds(stage, node, cluster) -> float:
    """Forward + backward seconds of ``node`` at the graph's batch under the stage's sharding of it."""
    sharding = stage.shardings[node.name]
    ins = [a.meta.get("val") for a in node.all_input_nodes]
    out = parse_spec(sharding.out)  # the op's work splits as its output does (elementwise ops, attention)
    strategy = Strategy(tuple(parse_spec(x) for x in sharding.ins), out, shard_fraction(out, stage.mesh_shape))
    return compute_time(node, strategy, ins, [node.meta.get("val")], stage.mesh_shape, cluster, True)


def _stage_nodes(stage, graph):
    names = set(stage.nodes)
    return [n for n in graph.gm.graph.nodes if n.name in names and n.op == "call_function"]


def score_mask_seconds(stage, graph, cluster) -> float:
    """Seconds (forward + backward, at the graph's batch) of ``stage``'s ``masked_fill`` nodes over 4-D score
    tensors, under the stage's own shardings (module docstring, "Fused scale-mask-softmax")."""
    return sum(_planned_seconds(stage, n, cluster) for n in _stage_nodes(stage, graph)
               if "masked_fill" in str(n.target) and getattr(n.meta.get("val"), "ndim", 0) == 4)


def attention_extra_seconds(stage, graph, cluster, kernel: str) -> tuple[float, float]:
    """(forward, backward) seconds at the graph's batch that ``stage``'s flash-priced attention nodes take more
    when run by ``kernel`` (module docstring, "Attention kernel")."""
    fwd = bwd = 0.0
    for node in _stage_nodes(stage, graph):
        if attention_kernel(node, cluster) != "flash":
            continue
        extra = _planned_seconds(stage, node, cluster) * (attention_rate("flash", cluster) / ATTENTION_RATE[kernel] - 1)
        f, b = node_flops(node)
        fwd, bwd = fwd + extra * f / (f + b), bwd + extra * b / (f + b)
    return fwd, bwd


def _shift(predicted: dict, phase: str, seconds: float) -> None:
    predicted[phase] += seconds
    predicted["latency"] += seconds
