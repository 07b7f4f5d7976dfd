"""The pipeline schedule of a Plan as a timeline: a pure simulation, and its Chrome-trace JSON export.

``simulate_schedule`` replays a GPipe or 1F1B schedule from per-stage forward/backward times and
returns one ``ScheduledOp`` per (stage, microbatch, forward|backward). Invariants of its result:
  * on each stage, ops never overlap and run in the schedule's order;
  * forward i on stage s+1 starts after forward i ends on stage s (plus ``transfer`` seconds);
  * backward i on stage s starts after backward i ends on stage s+1 (plus ``transfer`` seconds);
  * every op starts as early as those two rules allow (a list schedule, as the runtime executes it).

``schedule_to_chrome_trace`` turns a Plan into the Trace Event Format that chrome://tracing and
Perfetto (ui.perfetto.dev, "Open trace file") read: one process per stage, ph="X" events in µs.
"""
from __future__ import annotations

import json
from typing import NamedTuple

FORWARD, BACKWARD = "F", "B"


class ScheduledOp(NamedTuple):
    """One microbatch's forward ("F") or backward ("B") on one stage, in seconds from the step start."""

    stage: int
    microbatch: int
    kind: str
    start: float
    end: float


def stage_order(schedule: str, stage: int, num_stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The order in which ``stage`` runs its ops: [(kind, microbatch), ...], each op exactly once.

    gpipe: all forwards, then all backwards. 1f1b (also used for "none"): warm-up of S−s−1 forwards,
    then alternate one forward and one backward, then the cool-down backwards.
    """
    if schedule == "gpipe":
        return [(FORWARD, i) for i in range(microbatches)] + [(BACKWARD, i) for i in range(microbatches)]
    warmup = min(num_stages - stage - 1, microbatches)
    order = [(FORWARD, i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        order += [(FORWARD, warmup + i), (BACKWARD, i)]
    order += [(BACKWARD, i) for i in range(microbatches - warmup, microbatches)]
    return order


def simulate_schedule(forward: list[float], backward: list[float], microbatches: int,
                      schedule: str = "1f1b", transfer: float = 0.0) -> list[ScheduledOp]:
    """List-schedule every stage's ops (see the module docstring); sorted by (start, stage)."""
    num_stages = len(forward)
    assert len(backward) == num_stages and num_stages >= 1 and microbatches >= 1
    orders = [stage_order(schedule, s, num_stages, microbatches) for s in range(num_stages)]
    end: dict[tuple[str, int, int], float] = {}
    free = [0.0] * num_stages
    cursor = [0] * num_stages
    done: list[ScheduledOp] = []
    while len(done) < 2 * num_stages * microbatches:
        progressed = False
        for s in range(num_stages):
            while cursor[s] < len(orders[s]):
                kind, i = orders[s][cursor[s]]
                ready = _ready_time(end, s, kind, i, num_stages, transfer)
                if ready is None:
                    break
                start = max(free[s], ready)
                free[s] = start + (forward[s] if kind == FORWARD else backward[s])
                end[(kind, s, i)] = free[s]
                done.append(ScheduledOp(s, i, kind, start, free[s]))
                cursor[s] += 1
                progressed = True
        assert progressed, f"schedule {schedule!r} deadlocked: {cursor} of {[len(o) for o in orders]}"
    return sorted(done, key=lambda op: (op.start, op.stage))


def _ready_time(end: dict, stage: int, kind: str, i: int, num_stages: int, transfer: float) -> float | None:
    """When op (kind, i) on ``stage`` has its input, or None while its producer has not run yet."""
    if kind == FORWARD:
        if stage == 0:
            return 0.0
        dep = end.get((FORWARD, stage - 1, i))
    elif stage == num_stages - 1:
        dep = end.get((FORWARD, stage, i))  # the loss: backward follows this stage's own forward
        return dep
    else:
        dep = end.get((BACKWARD, stage + 1, i))
    return None if dep is None else dep + transfer


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
                             str(plan.schedule or "1f1b").lower(), plan_transfer_seconds(plan))


def grad_sync_events(plan, ops: list[ScheduledOp]) -> list[ScheduledOp]:
    """One "grad sync" op per stage that predicts ``grad_sync`` seconds, right after its last backward."""
    out = []
    for s, stage in enumerate(plan.stages):
        seconds = float((stage.predicted or {}).get("grad_sync", 0.0) or 0.0)
        if seconds > 0:
            last = max(op.end for op in ops if op.stage == s)
            out.append(ScheduledOp(s, -1, "grad sync", last, last + seconds))
    return out


def op_label(op: ScheduledOp) -> str:
    """"F3" / "B3" for microbatch 3; the kind itself for per-step ops (microbatch −1)."""
    return f"{op.kind}{op.microbatch}" if op.microbatch >= 0 else op.kind


def schedule_to_chrome_trace(plan) -> dict:
    """Chrome Trace Event Format: {"traceEvents": [...]}; pid = stage index, tid 0 = its compute row.

    Each op is a complete event (ph="X", ts and dur in µs); metadata events name every process
    "stage s (ranks a–b)" so Perfetto lists the stages in order.
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
    for op in ops:
        cat = {"F": "forward", "B": "backward"}.get(op.kind, op.kind)
        events.append({"ph": "X", "name": op_label(op), "cat": cat, "pid": plan.stages[op.stage].index,
                       "tid": 0, "ts": op.start * 1e6, "dur": (op.end - op.start) * 1e6,
                       "args": {"stage": op.stage, "microbatch": op.microbatch}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"model": plan.model, "schedule": plan.schedule, "microbatches": plan.microbatches,
                          "bubble_fraction": bubble_fraction(compute_ops, len(plan.stages))}}


def write_chrome_trace(plan, path) -> None:
    """Write ``schedule_to_chrome_trace(plan)`` as JSON to ``path`` (open it in Perfetto or chrome://tracing)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(schedule_to_chrome_trace(plan), f, indent=1)
        f.write("\n")
