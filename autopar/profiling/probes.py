"""The profiler's timing primitives, shared by its isolated probes (``profiler``) and its training-condition
ones (``profiler_training``), and the α-β fit both make of collective timings.

Timing: after warm-up calls, each rank times ``windows`` windows of back-to-back calls, the calls per window
agreed by all ranks from the slowest rank's warm-up (about ``window_s`` each, at most MAX_CALLS_PER_WINDOW),
and keeps the median of window / calls.

Compute probes are timed against the machine's speed (``SpeedReference``): each window of the probe sits
between two windows of a reference mm (fp32 256³ on CPUs, bf16 4096³ on GPUs), and the probe's figure is

    seconds = median over windows of (probe seconds per call / mean of the two references around it) · level

with level = the median of every reference window this rank timed over the whole profile. On a shared
machine the speed drifts over the minute a profile takes; ratios to a reference timed a moment apart
cancel it, so every compute figure of one profile describes the machine at the same speed (the level).
Each measurement also reports its spread (``Timing``: interquartile range / median of the ratios, of the
probe's own seconds and of the references beside it; a ratio that holds while both sides move is the
machine moving, a ratio that moves with the probe while the reference holds is the probe), and a probe
whose ratios spread wider than ``max_spread`` gets more windows, up to ``max_windows``.

Fit, per "<collective>/<g>":

    t(m) = α + m·β,   minimizing Σ_i ((α + m_i·β − t_i) / t_i)²,   α ≥ 0,  β ≥ MIN_BETA
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from autopar.hardware.cluster import CollectiveFit
from autopar.profiling.profiler_device import ProbeDevice
from autopar.runtime.flat_collectives import all_gather_flat, reduce_scatter_flat

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
MIN_BETA = 1e-15  # s/byte (1 PB/s): the floor of a fit whose times do not grow with m
MAX_CALLS_PER_WINDOW = 10_000


def warm_up(call, times: int, probe: ProbeDevice) -> float:
    """Run ``call`` ``times`` times (at least once); the seconds of the last run."""
    for _ in range(max(1, times) - 1):
        call()
    return probe.window_seconds(call, 1)


def slowest_rank(seconds: float, probe: ProbeDevice) -> float:
    """The maximum of ``seconds`` over the world (every rank must call this together)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=probe.torch)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def seconds_per_call(call, calls_per_window: int, windows: int, probe: ProbeDevice) -> float:
    """Median over ``windows`` windows of (window seconds / calls in it).

    Windows rather than single calls: one small matmul is shorter than a scheduler time slice, so ranks
    sharing a core would take turns instead of running at once; a window spans many slices and its mean
    includes the stalls that training also sees.
    """
    per_call = [probe.window_seconds(call, calls_per_window) / calls_per_window for _ in range(windows)]
    return statistics.median(per_call)


def calls_per_window(slowest_call_s: float, settings, window_s: float | None = None) -> int:
    window_s = settings.window_s if window_s is None else window_s
    return max(1, min(MAX_CALLS_PER_WINDOW, math.ceil(window_s / max(slowest_call_s, 1e-9))))


@dataclasses.dataclass(frozen=True)
class Timing:
    """One probe timed against the reference: its median ratio and how much each side moved meanwhile.

    ratio: median over windows of (probe seconds per call / mean of the references around it).
    ratio_spread, probe_spread, reference_spread: interquartile range / median of the ratios, of the probe's
    own seconds per call, and of the reference windows timed beside it (``relative_spread``; the largest
    over ranks). A steady ratio beside moving raw seconds is the machine moving, which the ratio cancels;
    a moving ratio beside a steady reference is the probe itself. windows: how many were timed.
    """

    ratio: float
    seconds: float  # median of the probe's own seconds per call (the clock's, or CPU seconds)
    ratio_spread: float
    probe_spread: float
    reference_spread: float
    windows: int


def relative_spread(values) -> float:
    """Interquartile range / median of ``values`` (0 for fewer than two values)."""
    values = list(values)
    if len(values) < 2:
        return 0.0
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / q2 if q2 > 0 else math.inf


class SpeedReference:
    """The reference mm of the module docstring, and the windows of it this rank timed.

    ``measure(call, ...)`` times ``call`` between reference windows (all ranks together) and returns its
    seconds per call in reference units with the spreads (``Timing``); once the profile is done, ratio ·
    ``level()`` (the median reference call over everything this rank timed) is the call's seconds at the
    profile's speed. ``ratio(...)`` is ``measure(...).ratio``.

    Wide spread gets more windows: after ``settings.windows`` windows, while the ratios' spread on some rank
    exceeds ``settings.max_spread``, every rank times ``settings.windows`` more, up to ``settings.max_windows``
    in all (the ranks agree each time, so they stay busy together).

    ``cpu=True`` times both sides in this process's CPU seconds (``time.process_time``) instead of the clock:
    for host work whose waits on other ranks must not count (``profiler_pipeline``); its ratio · level is
    then that CPU work in wall seconds at the profile's reference speed, the units of ``op_overhead``.
    """

    def __init__(self, probe: ProbeDevice):
        side, dtype = (4096, torch.bfloat16) if probe.kind == "cuda" else (256, torch.float32)
        a, b, self._out = (torch.randn(side, side, device=probe.torch, dtype=dtype) for _ in range(3))
        self.side, self.dtype, self.probe, self.windows = side, dtype, probe, []
        self.call = lambda: torch.mm(a, b, out=self._out)

    def ratio(self, call, settings, window_s: float | None = None, slowest_s: float | None = None) -> float:
        """``measure(...).ratio``."""
        return self.measure(call, settings, window_s, slowest_s).ratio

    def measure(self, call, settings, window_s: float | None = None, slowest_s: float | None = None,
                cpu: bool = False) -> Timing:
        """``call`` timed in windows between reference windows (class docstring). slowest_s: the slowest
        rank's seconds per call when the caller has warmed ``call`` up already."""
        if slowest_s is None:
            dist.barrier()
            slowest_s = slowest_rank(warm_up(call, settings.warmup, self.probe), self.probe)
        calls = calls_per_window(slowest_s, settings, window_s)
        # the reference's windows as long as the call's: a window shorter than the scheduler's slices runs
        # at the on-core speed, a longer one at the share of the core this rank gets (under other jobs' load
        # the two differ many times over)
        reference_calls = calls_per_window(self._slowest_reference(settings), settings, calls * slowest_s)
        timer = self._cpu_seconds if cpu else self.probe.window_seconds
        before = self._window(reference_calls, cpu)
        ratios, seconds, references = [], [], [before]
        batch, most = max(1, settings.windows), max(settings.windows, getattr(settings, "max_windows", 0))
        while True:
            for _ in range(batch):
                seconds.append(timer(call, calls) / calls)
                after = self._window(reference_calls, cpu)
                ratios.append(seconds[-1] / ((before + after) / 2))
                references.append(after)
                before = after
            spread = slowest_rank(relative_spread(ratios), self.probe)
            if spread <= getattr(settings, "max_spread", math.inf) or len(ratios) + batch > most:
                break
        return Timing(statistics.median(ratios), statistics.median(seconds), spread,
                      slowest_rank(relative_spread(seconds), self.probe),
                      slowest_rank(relative_spread(references), self.probe), len(ratios))

    def _slowest_reference(self, settings) -> float:
        if not self.windows:
            dist.barrier()
            return slowest_rank(warm_up(self.call, settings.warmup, self.probe), self.probe)
        return slowest_rank(statistics.median(self.windows), self.probe)

    def _window(self, calls: int, cpu: bool = False) -> float:
        if cpu:  # the level is the clock's: CPU-second windows stay out of it
            return self._cpu_seconds(self.call, calls) / calls
        seconds = self.probe.window_seconds(self.call, calls) / calls
        self.windows.append(seconds)
        return seconds

    def _cpu_seconds(self, call, calls: int) -> float:
        begin = time.process_time()
        for _ in range(calls):
            call()
        return time.process_time() - begin

    def level(self) -> float:
        """Seconds of one reference call at this rank's median speed over the profile."""
        return statistics.median(self.windows)


def collective_call(kind: str, nbytes: int, g: int, group, device: torch.device, async_op: bool = False) -> tuple:
    """(zero-argument call running one ``kind`` on ``group``, its per-device bytes m) for m ≈ nbytes; with
    ``async_op`` the call returns the collective's work handle without waiting."""
    elems = max(g, nbytes // 4 // g * g)  # float32, divisible by g
    full, part, source = (torch.zeros(n, device=device) for n in (elems, elems // g, elems))  # sums stay finite
    kw = {"group": group, "async_op": async_op}
    calls = {"all_reduce": lambda: dist.all_reduce(full, **kw),
             "all_gather": lambda: all_gather_flat(full, part, **kw),
             "reduce_scatter": lambda: reduce_scatter_flat(part, full, **kw),
             "all_to_all": lambda: dist.all_to_all_single(full, source, **kw)}
    return calls[kind], elems * 4




def fit_alpha_beta(nbytes, seconds) -> CollectiveFit:
    """The α-β line of the module docstring: relative least squares with α ≥ 0 and β ≥ MIN_BETA.

    The problem is a convex quadratic in (α, β); its minimum is the free solution when that is feasible,
    else on one of the two bounds, each a one-variable least squares in closed form.
    """
    m, t = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
    if len(m) < 2 or np.any(t <= 0) or np.any(m <= 0):
        raise ValueError(f"fit_alpha_beta needs >= 2 points with positive sizes and times, got {list(zip(m, t))}")
    u, v = 1.0 / t, m / t  # residual_i = α·u_i + β·v_i − 1

    def loss(a, b):
        return float(np.sum((a * u + b * v - 1.0) ** 2))

    (alpha, beta), *_ = np.linalg.lstsq(np.stack([u, v], axis=1), np.ones_like(t), rcond=None)
    if alpha >= 0 and beta >= MIN_BETA:
        return CollectiveFit(alpha=float(alpha), beta=float(beta))
    on_alpha_bound = (0.0, max(MIN_BETA, float(np.sum(v) / np.sum(v * v))))
    alpha_free = max(0.0, float(np.sum(u * (1.0 - MIN_BETA * v)) / np.sum(u * u)))
    on_beta_bound = (alpha_free, MIN_BETA)
    alpha, beta = min(on_alpha_bound, on_beta_bound, key=lambda ab: loss(*ab))
    return CollectiveFit(alpha=alpha, beta=beta)
