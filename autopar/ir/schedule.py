"""The pipeline schedule as pure data: the order each stage runs its microbatches (``stage_order``, which the
runtime executes) and the list schedule that replays it in time (``simulate_schedule``, which the planner's
prediction and the Chrome trace use).

Interleaved 1F1B (Megatron-LM's virtual pipeline stages): the model is cut into pp·v *virtual stages*
(chunks); virtual stage s runs on device s mod pp, so each of the pp devices holds v chunks, placed round
robin. ``device_order`` gives a device's ops as Megatron runs them, with m microbatches (m a multiple of
pp) and the device's k-th forward (of m·v) being

    chunk c = (k mod pp·v) div pp,  microbatch = (k div pp·v)·pp + k mod pp

(microbatches go in groups of pp through chunk 0, then the same group through chunk 1, ...; backward k
takes chunk v−1−c, the chunks in reverse). Device d warms up with

    w_d = (pp − d − 1)·2 + (v − 1)·pp  forwards  (all m·v when m = pp),

then alternates one forward and one backward, then drains the backwards. Why w_d: before device 0's
first backward can run, microbatch 0 must pass all pp·v chunks forward, which takes device 0 through
its v chunks of the first group of pp microbatches, (v−1)·pp forwards, plus the 2(pp−1) ticks the
forward and the backward of the last chunk need to cross the other devices. The pipeline's idle time
(the bubble) is then (pp−1)·(f+b)/v, a fraction (pp−1)/(v·m) of the ideal time instead of 1F1B's
(pp−1)/m, at v times the cross-device sends. Warm-up keeps up to w_d + 1 chunk activations of
microbatches in flight on device d (``inflight``), against pp − d stage activations in 1F1B.

``simulate_schedule`` returns one ``ScheduledOp`` per (virtual stage, microbatch, forward|backward).
Invariants:
  * on each device, ops never overlap and run in the order ``stage_order`` / ``device_order`` gives;
  * forward i on stage s+1 starts after forward i ends on stage s (plus ``transfer`` seconds);
  * backward i on stage s starts after backward i ends on stage s+1 (plus ``transfer`` seconds);
  * every op starts as early as those two rules allow (a list schedule, as the runtime executes it).
"""
from __future__ import annotations

from typing import NamedTuple

FORWARD, BACKWARD = "F", "B"
INTERLEAVED = "interleaved"


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


def device_order(device: int, num_devices: int, virtual: int, microbatches: int) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B order of ``device``: [(kind, virtual stage, microbatch), ...] (module docstring)."""
    pp, v, m = num_devices, virtual, microbatches
    if m % pp:
        raise ValueError(f"interleaved 1F1B needs the microbatches ({m}) to be a multiple of the devices ({pp})")
    total = m * v
    warmup = total if m == pp else min((pp - device - 1) * 2 + (v - 1) * pp, total)

    def op(kind: str, k: int) -> tuple[str, int, int]:
        chunk = (k % (pp * v)) // pp
        chunk = chunk if kind == FORWARD else v - 1 - chunk
        return kind, chunk * pp + device, (k // (pp * v)) * pp + k % pp

    order = [op(FORWARD, k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [op(FORWARD, warmup + i), op(BACKWARD, i)]
    return order + [op(BACKWARD, i) for i in range(total - warmup, total)]


def device_orders(schedule: str, num_stages: int, microbatches: int, virtual: int = 1) -> list[list[tuple]]:
    """Every device's ops [(kind, stage, microbatch), ...]: stage s on device s for gpipe / 1f1b, virtual
    stage s on device s mod (num_stages / virtual) for interleaved 1F1B."""
    if virtual > 1:
        pp = num_stages // virtual
        return [device_order(d, pp, virtual, microbatches) for d in range(pp)]
    return [[(kind, s, i) for kind, i in stage_order(schedule, s, num_stages, microbatches)]
            for s in range(num_stages)]


def inflight(schedule: str, num_stages: int, microbatches: int, virtual: int = 1) -> list[int]:
    """Per (virtual) stage, the most microbatches whose forward ran and backward has not, in its device's
    order: what the stage's activation memory must hold."""
    most = [0] * num_stages
    for order in device_orders(schedule, num_stages, microbatches, virtual):
        live = [0] * num_stages
        for kind, s, _ in order:
            live[s] += 1 if kind == FORWARD else -1
            most[s] = max(most[s], live[s])
    return most


def simulate_schedule(forward: list[float], backward: list[float], microbatches: int,
                      schedule: str = "1f1b", transfer: float = 0.0, virtual: int = 1) -> list[ScheduledOp]:
    """List-schedule every device's ops (see the module docstring); sorted by (start, stage).
    ``forward``/``backward``: seconds per microbatch of each (virtual) stage."""
    num_stages = len(forward)
    assert len(backward) == num_stages and num_stages >= 1 and microbatches >= 1
    orders = device_orders(schedule, num_stages, microbatches, virtual)
    end: dict[tuple[str, int, int], float] = {}
    free = [0.0] * len(orders)
    cursor = [0] * len(orders)
    done: list[ScheduledOp] = []
    while len(done) < 2 * num_stages * microbatches:
        progressed = False
        for d, order in enumerate(orders):
            while cursor[d] < len(order):
                kind, s, i = order[cursor[d]]
                ready = _ready_time(end, s, kind, i, num_stages, transfer)
                if ready is None:
                    break
                start = max(free[d], ready)
                free[d] = start + (forward[s] if kind == FORWARD else backward[s])
                end[(kind, s, i)] = free[d]
                done.append(ScheduledOp(s, i, kind, start, free[d]))
                cursor[d] += 1
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
