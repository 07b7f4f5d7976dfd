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

The adjusted step is ``plan_builder.predict`` over the adjusted stages: the same schedule replay as the
plan's own prediction. Pipeline transfers need no adjustment: the planner prices shard-to-shard sends
itself (``autopar.ir.shard_boxes``: each piece crosses the slow link once, the receivers gather over their
own links), which is Megatron-LM's scatter/gather optimization (Narayanan et al. 2021, §4.1).
"""
from __future__ import annotations

import copy
import re

from autopar.cost_models.compute import node_flops
from autopar.planner.plan_builder import predict

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
    if run.grad_sync == "overlapped" and run.recompute != "op_sac":
        return dict(plan.predicted)
    stages = copy.deepcopy(plan.stages)
    share = op_sac_share(graph) if run.recompute == "op_sac" else 1.0
    for s in stages:
        p = s.predicted
        if run.grad_sync == "after_backward":
            p["sync_buckets"] = 1.0  # one buffer after backward: exposed_sync exposes all of it
        saved = (1.0 - share) * p.get("recompute", 0.0)
        _shift(p, "backward", -saved)
    return predict(stages, plan.microbatches, plan.schedule, plan.transfers, plan.virtual_stages)


def _shift(predicted: dict, phase: str, seconds: float) -> None:
    predicted[phase] += seconds
    predicted["latency"] += seconds
