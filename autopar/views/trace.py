"""The pipeline schedule of a Plan as a timeline, and its Chrome-trace JSON export.

``simulate_plan`` replays a Plan's schedule with ``autopar.ir.schedule.simulate_schedule`` (where the
schedule's invariants are stated) from each stage's predicted forward/backward times.

``schedule_to_chrome_trace`` turns a Plan into the Trace Event Format that chrome://tracing and
Perfetto (ui.perfetto.dev, "Open trace file") read: one process per stage, ph="X" events in µs.
"""
from __future__ import annotations

import json

from autopar.ir.schedule import ScheduledOp, simulate_schedule


def bubble_fraction(ops: list[ScheduledOp], num_stages: int) -> float:
    """Idle share of the stages' time until the last op ends: 1 − busy / (stages × makespan)."""
    makespan = max(op.end for op in ops)
    busy = sum(op.end - op.start for op in ops)
    return 1.0 - busy / (num_stages * makespan) if makespan > 0 else 0.0


# ---- from a Plan --------------------------------------------------------------------------------

def stage_times(stage) -> tuple[float, float]:
    """(forward, backward) seconds per microbatch; without them, ``latency`` split 1:2 (backward ≈ 2× forward)."""
    p = stage.predicted or {}
    if "forward" in p and "backward" in p:
        return float(p["forward"]), float(p["backward"])
    latency = float(p.get("latency", 0.0))
    return latency / 3.0, 2.0 * latency / 3.0


def plan_transfer_seconds(plan) -> float:
    """Seconds one cross-stage send takes, if the plan records it (``predicted["transfer"]``), else 0."""
    return float((plan.predicted or {}).get("transfer", 0.0) or 0.0)


def simulate_plan(plan) -> list[ScheduledOp]:
    """The schedule of ``plan`` (stages, microbatches, schedule name) as ``simulate_schedule`` replays it."""
    times = [stage_times(s) for s in plan.stages]
    return simulate_schedule([f for f, _ in times], [b for _, b in times], max(1, int(plan.microbatches or 1)),
                             str(plan.schedule or "1f1b").lower(), plan_transfer_seconds(plan),
                             int(getattr(plan, "virtual_stages", 1) or 1))


def grad_sync_events(plan, ops: list[ScheduledOp]) -> list[ScheduledOp]:
    """Per stage, its gradient-sync buckets as the runtime overlaps them with the last backward
    (``plan_builder.exposed_sync``): K equal buckets of the reduce part, bucket k ready at k/K of that
    backward, sent one after another; then, with ZeRO, the all-gather of the updated shards ("param gather").
    Plans without bucket counts get one "grad sync" op after the last backward."""
    out = []
    for s, stage in enumerate(plan.stages):
        p = stage.predicted or {}
        seconds = float(p.get("grad_sync", 0.0) or 0.0)
        if seconds <= 0:
            continue
        last = max((op for op in ops if op.stage == s), key=lambda op: op.end)
        k = max(int(p.get("sync_buckets", 1) or 1), 1)
        gather = float(p.get("zero_gather_share", 0.0)) * seconds / 2
        scatter3 = float(p.get("zero3_share", 0.0)) * seconds / 2  # ZeRO-3: reduce-scatter only, gathers in F/B
        each, free = (seconds - gather - scatter3) / k, last.start if k > 1 else last.end
        gather += float(p.get("zero_pair_excess", 0.0))  # the measured pair's cost beyond the all-reduce
        for i in range(k):
            ready = last.start + (i + 1) / k * (last.end - last.start) if k > 1 else last.end
            start = max(ready, free)
            free = start + each
            out.append(ScheduledOp(s, -1, "grad sync", start, free))
        if gather > 0:
            out.append(ScheduledOp(s, -1, "param gather", free, free + gather))
    return out


def op_label(op: ScheduledOp) -> str:
    """"F3" / "B3" for microbatch 3; the kind itself for per-step ops (microbatch −1)."""
    return f"{op.kind}{op.microbatch}" if op.microbatch >= 0 else op.kind


def schedule_to_chrome_trace(plan) -> dict:
    """Chrome Trace Event Format: {"traceEvents": [...]}; pid = stage index, tid 0 = its compute row.

    Each op is a complete event (ph="X", ts and dur in µs); metadata events name every process
    "stage s (ranks a–b)" so Perfetto lists the stages in order. Gradient-sync buckets go on tid 1, under
    the backward they overlap.
    """
    compute_ops = simulate_plan(plan)
    ops = compute_ops + grad_sync_events(plan, compute_ops)
    events: list[dict] = []
    for stage in plan.stages:
        ranks = stage.ranks
        rank_text = f"ranks {min(ranks)}–{max(ranks)}" if ranks else "no ranks"
        events.append({"ph": "M", "name": "process_name", "pid": stage.index, "tid": 0,
                       "args": {"name": f"stage {stage.index} ({rank_text})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": stage.index, "tid": 0,
                       "args": {"sort_index": stage.index}})
        events.append({"ph": "M", "name": "thread_name", "pid": stage.index, "tid": 0,
                       "args": {"name": "compute"}})
        events.append({"ph": "M", "name": "thread_name", "pid": stage.index, "tid": 1,
                       "args": {"name": "gradient sync"}})
    for op in ops:
        cat = {"F": "forward", "B": "backward"}.get(op.kind, op.kind)
        events.append({"ph": "X", "name": op_label(op), "cat": cat, "pid": plan.stages[op.stage].index,
                       "tid": 0 if op.microbatch >= 0 else 1, "ts": op.start * 1e6, "dur": (op.end - op.start) * 1e6,
                       "args": {"stage": op.stage, "microbatch": op.microbatch}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"model": plan.model, "schedule": plan.schedule, "microbatches": plan.microbatches,
                          "bubble_fraction": bubble_fraction(compute_ops, len(plan.stages))}}


def write_chrome_trace(plan, path) -> None:
    """Write ``schedule_to_chrome_trace(plan)`` as JSON to ``path`` (open it in Perfetto or chrome://tracing)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(schedule_to_chrome_trace(plan), f, indent=1)
        f.write("\n")
