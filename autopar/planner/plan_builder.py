"""Assemble a Plan from solved stages: specs as text, inserted collectives, ranks, predicted times.

Rank placement: whole-node stages take whole nodes in order; stages inside a node are packed first-fit,
largest first, at offsets aligned to their width (submesh widths are powers of two, or the node width,
so the tiling the DP guarantees always packs). A stage's ranks run row-major over its physical submesh,
and that order, reshaped to the logical mesh, is the stage's mesh.

Predicted step time: the schedule (``autopar.ir.schedule.simulate_schedule``) replayed with each stage's
forward and backward time per microbatch (backward ≈ 2 × forward) and the cross-stage transfer time,
plus the slowest stage's gradient synchronization, plus the slowest stage's optimizer step over its
local parameter shards (``cost_models.compute.optimizer_step_time``). The intra-op ILP prices the same
step per parameter (``passes.intra_op_zero.price_optimizer_step``); the stage DP leaves it out.

The pipeline runtime's host time per (model chunk, microbatch), c = ``Cluster.microbatch_overhead``, is
part of each stage's forward and backward (``charge_microbatch_overhead``): forward_s += c, backward_s += c,
so a plan of S stages (S = pp·v chunks when interleaved) and B microbatches pays c · 2·S·B of host time,
spread over the devices as the schedule replays it (a pp-device 1F1B pipeline's makespan grows by about
2c·(B + pp − 1)). Plans of one stage and one microbatch run without the pipeline runtime and are not
charged. On GPUs the charge is added as on CPU ranks: exact for a host-bound stage, an upper bound for one
whose queued kernels hide the host's work.
"""
from __future__ import annotations

import json
import math

import numpy as np

from autopar.cost_models.communication import axis_links, redistribute_cost, redistribute_messages
from autopar.cost_models.compute import optimizer_step_time, stepped_numel
from autopar.cost_models.experts import dispatch_messages
from autopar.cost_models.memory import held_state_bytes, single_step_release
from autopar.cost_models.offload import host_optimizer_seconds
from autopar.cost_models.zero3 import zero3_units
from autopar.hardware.cluster import Cluster
from autopar.ir.ops import OpView
from autopar.ir.precision import resolve as resolve_precision
from autopar.ir.schedule import simulate_schedule
from autopar.ir.shard_boxes import backward_pieces, forward_pieces, max_node_bytes, max_rank_bytes, send_spec, wire_spec
from autopar.passes.intra_op import CostEnv, IntraOpSolution
from autopar.placement import local_shape, parse_spec, spec_str
from autopar.plan import Collective, NodeSharding, Plan, Stage
from autopar.planner.sync_charges import (  # noqa: F401  (exposed_sync, charge_zero3: re-exported)
    charge_zero3,
    charge_zero3_in_step,
    charge_zero_pair,
    exposed_sync,
    requires_grad_kept,
    stage_sync_buckets,
)
from autopar.redistribute import grad_partial_axes


def make_stage(graph, solution: IntraOpSolution, env: CostEnv, *, index: int, ranks: list[int],
               submesh: tuple[int, int], subset: set[str] | None = None, layers=None) -> Stage:
    """A Stage from an intra-op solution: specs as text, the collectives inserted, predicted costs."""
    names = [n.name for n in graph.gm.graph.nodes if n.name in solution.strategies]
    shardings = {}
    for name in names:
        s = solution.strategies[name]
        shardings[name] = NodeSharding(spec_str(s.out_spec), tuple(spec_str(x) for x in s.in_specs),
                                       tuple((int(a), str(t)) for a, t in s.kernels))
    stage = Stage(index=index, ranks=list(ranks), mesh_shape=tuple(env.mesh_shape), submesh=tuple(submesh),
                  nodes=names, shardings=shardings, layers=layers)
    stage.inputs = {name: spec_str(spec) for name, spec in solution.inputs.items()}
    stage.outputs = sorted(solution.sends)
    stage.zero = {n: lvl for n, lvl in (*env.training.zero, *solution.zero.items()) if n in shardings and lvl}
    stage.collectives = _collectives(graph, solution, env, set(names))
    per_mb = (solution.step_time - solution.sync_time - solution.zero3_gather) / env.microbatches  # charge_zero3
    stage.predicted = {"latency": per_mb, "forward": per_mb / 3, "backward": 2 * per_mb / 3,
                       "compute": solution.compute_time, "comm": solution.comm_time,
                       "grad_sync": solution.sync_time - solution.zero_gather,  # exposed_sync adds the gathers
                       "memory": solution.memory - solution.zero3_unit,  # charge_zero3 adds the exact units
                       "peak_memory": solution.memory - solution.zero3_unit,
                       "optimizer": _optimizer_seconds(graph, solution, env, stage.zero)}
    if env.microbatches == 1 and not env.recomputed and max(solution.weights, default=1) == 1:
        released = _released_in_one_step(graph, solution, env, stage)
        stage.predicted["memory"] -= released
        stage.predicted["peak_memory"] -= released
    return stage


def _released_in_one_step(graph, solution: IntraOpSolution, env: CostEnv, stage: Stage) -> float:
    """``cost_models.memory.single_step_release`` of a stage that runs one microbatch per step: its groups'
    saved activations at their leaders' positions, and the gradients of the parameters no sync bucket keeps
    (gradients of bucketed parameters at levels 0-1 live in flat buffers that persist between steps)."""
    position = {n.name: i for i, n in enumerate(graph.gm.graph.nodes)}
    acts = [(position[g.leader], float(g.mem_act[i])) for g, i in zip(solution.groups, solution.choice)
            if g.leader in position]
    bucketed = {n for b in stage_sync_buckets(graph, stage, env.training.bucket_bytes) for n in b["names"]}
    grads = []
    for p in graph.placeholders:
        if p.kind != "parameter" or p.name in bucketed or p.name not in stage.shardings:
            continue
        readers = [position[u.name] for u in graph.gm.graph.find_nodes(op="placeholder", target=p.name)[0].users]
        if not readers:
            continue
        numel = math.prod(local_shape(p.shape, parse_spec(stage.shardings[p.name].out), stage.mesh_shape))
        grads.append((max(readers), numel * p.dtype.itemsize))
    return single_step_release(acts, grads)


def _optimizer_seconds(graph, solution: IntraOpSolution, env: CostEnv, zero: dict[str, int]) -> float:
    """One optimizer step over the local shards of the parameters this stage holds (1/n of those whose
    optimizer state ZeRO shards n ways)."""
    numel, tensors, itemsize = 0.0, 0, 4
    for p in graph.placeholders:
        if p.kind == "parameter" and p.name in solution.strategies:
            numel += stepped_numel(p.shape, solution.strategies[p.name].out_spec, env.mesh_shape,
                                   zero.get(p.name, 0))  # ZeRO steps 1/n of it
            tensors, itemsize = tensors + 1, p.dtype.itemsize
    if env.training.host_optimizer:  # ZeRO-Offload: the step runs on the host (cost_models.offload)
        return host_optimizer_seconds(numel, itemsize, env.training.optimizer, env.cluster, tensors)
    return optimizer_step_time(numel, tensors, itemsize, env.training.optimizer, env.cluster)


def _collectives(graph, solution: IntraOpSolution, env: CostEnv, names: set[str]) -> list[Collective]:
    trainable = {p.name for p in graph.placeholders if p.kind == "parameter"}
    needs = requires_grad_kept(graph, trainable)
    specs = {**solution.inputs, **{n: s.out_spec for n, s in solution.strategies.items()}}
    out = []
    for node in graph.gm.graph.nodes:
        if node.name not in names or node.op == "placeholder":
            continue
        view = OpView(node)
        strat = solution.strategies[node.name]
        for idx, arg in enumerate(view.tensor_args):
            if arg.name not in specs:
                continue
            src, dst = specs[arg.name], strat.in_specs[idx]
            val = view.in_vals[idx]
            grad = arg.name in needs and node.name in needs
            axes = grad_partial_axes(dst, strat.out_spec) if grad and node.op != "output" else ()
            for kind, axis, nbytes, phase in redistribute_messages(tuple(val.shape), val.element_size(), src, dst,
                                                                  env.mesh_shape, axes, grad):
                seconds = env.links[axis].time(kind, nbytes)
                if arg.name in trainable and kind == "all_reduce" and phase == "backward":
                    phase = "step"  # a parameter's gradient sync: the runtime defers and buckets it per step
                out.append(Collective(arg.name, node.name, kind, axis, float(nbytes), phase, float(seconds)))
        for kind, axis, nbytes, phase, seconds in dispatch_messages(view, strat, env.mesh_shape, env.links,
                                                                    env.training.expert_routing):
            out.append(Collective(view.tensor_args[0].name, node.name, kind, axis, nbytes, phase, seconds))
    return out


def predict_state(graph, stage, bucket_bytes: float, optimizer: str, node_layers=None,
                  compute_dtype=None) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state one rank of ``stage`` holds (``held_state_bytes``),
    its number of gradient-sync buckets, the shares of their elements at ZeRO levels 1-2 and 3, and, with
    level-3 units, their count, gather scale and the most bytes of them held at once (``zero3_transient``:
    ``cost_models.zero3.zero3_units``; ``node_layers`` {op: layer} places the stage's recomputed regions;
    ``compute_dtype``: the precision policy's, which units are gathered in)."""
    buckets = stage_sync_buckets(graph, stage, bucket_bytes)
    in_bucket = {n for b in buckets for n in b["names"]}
    loose = [math.prod(local_shape(p.shape, parse_spec(stage.shardings[p.name].out), stage.mesh_shape))
             for p in graph.placeholders if p.kind == "parameter" and p.name in stage.shardings
             and p.name not in in_bucket and _is_read(graph, p.name)]
    held = held_state_bytes(buckets, loose, optimizer)
    total = max(1, sum(b["numel"] for b in buckets))
    return {"state_params": held["params"], "state_grads": held["grads"], "state_optimizer": held["optimizer"],
            "sync_buckets": float(len(buckets)),
            "zero_gather_share": sum(b["numel"] for b in buckets if b["level"] in (1, 2)) / total,
            "zero3_share": sum(b["numel"] for b in buckets if b["level"] == 3) / total, "zero3_transient": 0.0,
            **zero3_units(graph, stage, buckets, compute_dtype, node_layers or {})}


def _is_read(graph, name: str) -> bool:
    return bool(graph.gm.graph.find_nodes(op="placeholder", target=name)[0].users)


def place_stages(cluster: Cluster, submeshes: list[tuple[int, int]]) -> list[list[int]]:
    """Global ranks of each stage's submesh (see module docstring); ValueError if they do not tile."""
    M = cluster.devices_per_node
    free = [[True] * M for _ in range(cluster.nodes)]
    placed: dict[int, list[int]] = {}
    order = sorted(range(len(submeshes)), key=lambda s: (-submeshes[s][0], -submeshes[s][1], s))
    for s in order:
        nodes, width = submeshes[s]
        placed[s] = _take(free, nodes, width, M)
    return [placed[s] for s in range(len(submeshes))]


def place_chunks(cluster: Cluster, submeshes: list[tuple[int, int]], virtual: int = 1) -> list[list[int]]:
    """``place_stages`` for the first pp = len / ``virtual`` stages; stage j then runs on the ranks of
    stage j mod pp (interleaved 1F1B's round robin of model chunks)."""
    pp = len(submeshes) // virtual
    placed = place_stages(cluster, submeshes[:pp])
    return [placed[j % pp] for j in range(len(submeshes))]


def _take(free: list[list[bool]], nodes: int, width: int, M: int) -> list[int]:
    if nodes > 1 or width == M:
        chosen = [n for n in range(len(free)) if all(free[n])][:nodes]
        if len(chosen) < nodes:
            raise ValueError(f"submeshes do not tile the cluster: no {nodes} free whole nodes")
        for n in chosen:
            free[n] = [False] * M
        return [n * M + j for n in chosen for j in range(M)]
    for n, slots in enumerate(free):
        for start in range(0, M - width + 1, width):
            if all(slots[start:start + width]):
                slots[start:start + width] = [False] * width
                return [n * M + start + j for j in range(width)]
    raise ValueError(f"submeshes do not tile the cluster: no room for a 1×{width} submesh")


def predict(stages: list[Stage], microbatches: int, schedule: str, transfers: list[dict],
            virtual: int = 1) -> dict[str, float]:
    """Step time by replaying the schedule (see module docstring), with its parts. Interleaved plans
    (``virtual`` chunks per device) replay per device; a device's busy time and peak memory sum its
    chunks' (each chunk's peak with its own most microbatches in flight: an upper bound)."""
    forward = [s.predicted["forward"] for s in stages]
    backward = [s.predicted["backward"] for s in stages]
    hop = max((t["seconds"] for t in transfers), default=0.0) / 2
    ops = simulate_schedule(forward, backward, microbatches, schedule if len(stages) > 1 else "gpipe", hop, virtual)
    makespan = max(op.end for op in ops)
    pp = len(stages) // virtual
    device_f = [sum(forward[j::pp]) for j in range(pp)]
    device_b = [sum(backward[j::pp]) for j in range(pp)]
    sync = max(s.predicted["grad_sync"] for s in stages)
    exposed = max(exposed_sync(s.predicted["grad_sync"], s.predicted["backward"], s.predicted.get("sync_buckets", 1),
                               s.predicted.get("zero_gather_share", 0.0), s.predicted.get("zero3_share", 0.0),
                               s.predicted.get("zero_pair_excess", 0.0) + s.predicted.get("zero3_scatter_excess", 0.0),
                               s.predicted.get("comm_overlap", 1.0))
                  for s in stages)
    optimizer = max(s.predicted.get("optimizer", 0.0) for s in stages)
    busiest = max(microbatches * (f + b) for f, b in zip(device_f, device_b))
    compute = sum(s.predicted["compute"] for s in stages)
    comm = sum(s.predicted["comm"] for s in stages)
    return {"step_time": makespan + exposed + optimizer, "compute": compute, "comm": comm, "grad_sync": sync,
            "grad_sync_exposed": exposed,
            "optimizer": optimizer, "transfer": hop,  # hop: what trace.simulate_plan replays the schedule with
            "bubble": max(0.0, makespan - busiest),
            "peak_memory": max(sum(s.predicted["peak_memory"] for s in stages[j::pp]) for j in range(pp))}


def charge_microbatch_overhead(stages: list[Stage], cluster: Cluster, microbatches: int) -> None:
    """Add c = ``cluster.microbatch_overhead`` to every stage's predicted forward and backward (and 2c to its
    latency) when the plan runs the pipeline runtime (more than one stage or microbatch; module docstring).
    Idempotent: a stage charged before (``predicted["microbatch_overhead"]``) is re-charged, not charged twice."""
    c = cluster.microbatch_overhead if (len(stages) > 1 or microbatches > 1) else 0.0
    for stage in stages:
        p = stage.predicted
        delta = c - p.get("microbatch_overhead", 0.0)
        if c or "microbatch_overhead" in p:  # uncharged plans keep their keys (presets: c = 0)
            p["microbatch_overhead"] = c
        if delta:
            p["forward"], p["backward"] = p["forward"] + delta, p["backward"] + delta
            p["latency"] = p.get("latency", 0.0) + 2 * delta


def _unshard_tied(graph, stages: list[Stage]) -> None:
    """A parameter several stages read (tied embeddings) stays at ZeRO level 0: ``gradsync.sync_shared`` sums
    its whole gradient over the holding stages after the step's sync, which a reduce-scattered (ZeRO ≥ 1)
    gradient no longer is."""
    params = [p.name for p in graph.placeholders if p.kind == "parameter"]
    tied = {n for n in params if sum(n in s.shardings for s in stages) > 1}
    for stage in stages:
        stage.zero = {n: level for n, level in stage.zero.items() if n not in tied}


def transfers_between(graph, stages: list[Stage], microbatch_graph, cluster: Cluster) -> list[dict]:
    """Every value a stage sends to a later one, shard to shard (``autopar.ir.shard_boxes``): its whole size
    per microbatch (``nbytes``), the most bytes one rank sends or receives (``rank_bytes``, forward and
    gradient back), and the estimated seconds, per direction (the gradient only for a floating value):

        α_intra + max_rank_bytes / β_intra(2)        every piece inside a node
        α_inter + max_node_bytes / β_inter           some piece crosses nodes (the node's NIC is shared)

    A piece a rank hands to itself (a later model chunk on the same devices) costs nothing. Receivers that
    replicate the value get slices (``wire``, see ``shard_boxes.wire_spec``) and all-gather them inside
    their stage: ``gather_seconds``, forward and backward, is part of ``seconds``."""
    owner = {name: s for s in stages for name in s.nodes if name not in s.inputs}
    vals = {n.name: n.meta.get("val") for n in microbatch_graph.gm.graph.nodes}
    out = []
    for s in stages:
        for name in s.inputs:
            val, src = vals[name], owner[name]
            itemsize = val.element_size()
            shape, floating = tuple(val.shape), val.dtype.is_floating_point
            src_spec = send_spec(shape, parse_spec(src.shardings[name].out), src.mesh_shape, floating)
            dst_spec = parse_spec(s.inputs[name])
            wire = wire_spec(shape, dst_spec, s.mesh_shape) if floating else dst_spec
            meshes = (np.asarray(src.ranks).reshape(src.mesh_shape), np.asarray(s.ranks).reshape(s.mesh_shape))
            args = (shape, src_spec, meshes[0], wire, meshes[1])
            fwd = forward_pieces(*args)
            bwd = backward_pieces(*args) if floating else []
            widen = sum(redistribute_cost(shape, itemsize, wire, dst_spec, tuple(s.mesh_shape),
                                          axis_links(cluster, tuple(s.mesh_shape), s.submesh[1]), (), floating))
            out.append({"value": name, "src": src.index, "dst": s.index, "nbytes": float(val.numel() * itemsize),
                        "rank_bytes": max_rank_bytes(fwd, itemsize) + max_rank_bytes(bwd, itemsize),
                        "wire": spec_str(wire), "gather_seconds": float(widen),
                        "seconds": widen + sum(_send_seconds(cluster, p, itemsize) for p in (fwd, bwd) if p)})
    return out


def _send_seconds(cluster: Cluster, pieces, itemsize: int) -> float:
    """One direction of a transfer (see ``transfers_between``)."""
    M = cluster.devices_per_node
    if any(p.sender // M != p.receiver // M for p in pieces):
        link = cluster.inter_node
        return float(link.latency + max_node_bytes(pieces, itemsize, M) / link.bandwidth)
    link = cluster.intra_node
    return float(link.latency + max_rank_bytes(pieces, itemsize) / link.bandwidth_for(2))


def assemble_plan(graph, cluster: Cluster, stages: list[Stage], options, model_name: str, blocks, *,
                  microbatches: int = 1, schedule: str = "none", layers=None, transfers=None,
                  sharded_graph=None, planner: dict | None = None, virtual_stages: int = 1) -> Plan:
    """``graph``: the model at the full batch (its input signature is what users pass); ``sharded_graph``:
    the graph at one microbatch that the stages' shardings name (default ``graph``). The fingerprint and
    op names come from the latter, since ``compile`` validates the plan against the model captured at one
    microbatch, and a re-captured model (e.g. one that branches on batch size) can differ in structure.
    ``predicted`` is the schedule replay of the stages (``predict``); ``planner`` records how it was found."""
    sharded = sharded_graph if sharded_graph is not None else graph
    _unshard_tied(sharded, stages)
    for stage in stages:
        stage.predicted.update(predict_state(sharded, stage, options.bucket_bytes, options.optimizer,
                                             dict(layers.of_node) if layers is not None else None,
                                             resolve_precision(options.precision).compute_dtype))
        if cluster.comm_overlap < 1.0:  # only where measured: other plans keep their keys
            stage.predicted["comm_overlap"] = cluster.comm_overlap
        charge_zero3_in_step(sharded, stage, cluster, options.bucket_bytes)
        charge_zero3(stage)
        charge_zero_pair(sharded, stage, cluster, options.bucket_bytes)
    charge_microbatch_overhead(stages, cluster, microbatches)
    return Plan(precision=resolve_precision(options.precision).name, bucket_bytes=int(options.bucket_bytes),
                model=model_name, graph_fingerprint=sharded.fingerprint(), input_signature=graph.input_signature,
                cluster=json.loads(cluster.to_json()), stages=stages, microbatches=microbatches, schedule=schedule,
                optimizer=options.optimizer, recompute=getattr(options, "recompute", "auto"),
                repeated_blocks=blocks.instances,
                node_ops={n.name: str(n.target) for n in sharded.gm.graph.nodes if n.op == "call_function"},
                node_layers=dict(layers.of_node) if layers is not None else {}, transfers=transfers or [],
                predicted=predict(stages, microbatches, schedule, transfers or [], virtual_stages),
                planner=dict(planner or {}), virtual_stages=virtual_stages)
