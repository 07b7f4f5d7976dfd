"""How well predictions agree with measurements: the statistics and the one measurement the fidelity and
calibration benchmarks (and the tests that check the cost model) share.

* ``relative_error(p, m) = (p - m) / m``: positive when the model over-predicts.
* ``spearman(a, b)``: Spearman's rho, the Pearson correlation of the ranks (ties share their average rank).
* ``log_ratio_summary(ratios)``: median and worst |ln r| of predicted/published ratios; |ln r| <= ln 1.1
  means within 0.91-1.10, symmetric in over- and under-prediction.
* ``peak_allocated_bytes(fn)``: the peak of the running sum of CPU allocations minus frees while ``fn`` runs.
* ``round_normalized(times)``: each plan's step time with the machine's speed per round taken out. Plans are
  timed in rounds (one step of every plan per round), t[p][r]; with m_p = median_r t[p][r],

      g_r = median_p (t[p][r] / m_p) / median_r' median_p (t[p][r'] / m_p),   time_p = median_r (t[p][r] / g_r)

  g_r is how slow round r ran for every plan alike (1 = the launch's median speed): other jobs' load over
  seconds moves every plan of a round together, so dividing it out leaves each plan's own noise only.
* ``sign_balance(errors)``: (over-predicted, under-predicted) counts; one of them 0 is a single-sign bias.
"""
from __future__ import annotations

import math
import statistics

import numpy as np
import torch


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured: positive when the model over-predicts."""
    return (predicted - measured) / measured


def ranks(x) -> np.ndarray:
    """Ranks 1..n of ``x``, ties sharing their average rank (as scipy.stats.rankdata)."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="mergesort")
    r = np.empty(len(x))
    r[order] = np.arange(1, len(x) + 1)
    for value in np.unique(x):
        tied = x == value
        r[tied] = r[tied].mean()
    return r


def spearman(a, b) -> float:
    """Spearman's rho: the Pearson correlation of the ranks (nan when either side is constant)."""
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def log_ratio_summary(ratios) -> tuple[float, float]:
    """(median |ln r|, worst |ln r|) over positive ratios r; exp of either is the factor off."""
    logs = [abs(math.log(r)) for r in ratios]
    if not logs:
        raise ValueError("log_ratio_summary needs at least one ratio")
    return statistics.median(logs), max(logs)


def peak_allocated_bytes(fn) -> int:
    """Largest running sum of CPU allocations minus frees that torch.profiler records while ``fn`` runs.

    torch.profiler (profile_memory=True) is the public way to see every allocation; its per-event byte
    counts are read from the kineto results because the aggregated table rounds them.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cpu = torch._C._autograd.DeviceType.CPU
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu]
    running = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        running += e.nbytes()
        peak = max(peak, running)
    return peak


def round_normalized(times: dict[str, list[float]]) -> dict[str, float]:
    """Per plan, the median over rounds of its step time over the round's speed g_r (module docstring).
    ``times``: plan -> seconds per round, every plan the same number of rounds (>= 1)."""
    rounds = {len(t) for t in times.values()}
    if len(rounds) != 1 or 0 in rounds:
        raise ValueError(f"round_normalized needs every plan timed in the same rounds, got {sorted(rounds)} rounds")
    typical = {p: statistics.median(t) for p, t in times.items()}
    speed = [statistics.median(t[r] / typical[p] for p, t in times.items()) for r in range(rounds.pop())]
    middle = statistics.median(speed)
    speed = [g / middle for g in speed]
    return {p: statistics.median(x / g for x, g in zip(t, speed)) for p, t in times.items()}


def sign_balance(errors) -> tuple[int, int]:
    """(count of errors > 0, count < 0): predictions too slow, too fast."""
    errors = list(errors)
    return sum(e > 0 for e in errors), sum(e < 0 for e in errors)
