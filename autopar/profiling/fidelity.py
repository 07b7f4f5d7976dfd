"""How well predictions agree with measurements: the statistics and the one measurement the fidelity and
calibration benchmarks (and the tests that check the cost model) share.

* ``relative_error(p, m) = (p - m) / m``: positive when the model over-predicts.
* ``spearman(a, b)``: Spearman's rho, the Pearson correlation of the ranks (ties share their average rank).
* ``log_ratio_summary(ratios)``: median and worst |ln r| of predicted/published ratios; |ln r| <= ln 1.1
  means within 0.91-1.10, symmetric in over- and under-prediction.
* ``peak_allocated_bytes(fn)``: the peak of the running sum of CPU allocations minus frees while ``fn`` runs.
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
