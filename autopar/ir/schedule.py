"""The pipeline schedule as pure data: the order each stage runs its microbatches (``stage_order``, which the
runtime executes) and the list schedule that replays it in time (``simulate_schedule``, which the planner's
prediction and the Chrome trace use).

``simulate_schedule`` returns one ``ScheduledOp`` per (stage, microbatch, forward|backward). Invariants:
  * on each stage, ops never overlap and run in the order ``stage_order`` gives;
  * forward i on stage s+1 starts after forward i ends on stage s (plus ``transfer`` seconds);
  * backward i on stage s starts after backward i ends on stage s+1 (plus ``transfer`` seconds);
  * every op starts as early as those two rules allow (a list schedule, as the runtime executes it).
"""
from __future__ import annotations

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
