r"""The stage-slicing DP of Alpa §5.2, as a pure function of a cost table (no graph, no cluster).

Given L layers, submesh options m of n_m devices (their sizes tile the D devices), B microbatches and a
table t[k, i, m, f] = latency of a stage running layers k..i on option m while f microbatches are in
flight (∞ where it does not fit in memory), find stages (k_s, i_s, m_s) covering 0..L-1 in order and
using exactly D devices that minimize

    T = Σ_s (t_s + h_{k_s}) + (B − 1) · max_s t_s,

where h_k (``hops``, default 0) is the one-time latency of the cross-stage transfer into a stage starting
at layer k: sends are asynchronous and overlap compute, so a cut adds its transfer once to the pipeline's
fill and drain, not to every microbatch's cycle (the caller bounds a stage's cycle by its transfer time
inside t). ``plan_builder.predict`` replays the schedule with the same assumption.

For a fixed cap t_max on every stage's latency, with σ stages still to place (so f = min(σ, B) under
1F1B, f = B under GPipe):

    F(σ, k, d) = min_{i ≥ k, m : n_m ≤ d, t[k,i,m,f] ≤ t_max}  t[k,i,m,f] + h_k + F(σ − 1, i + 1, d − n_m)
    F(0, L, 0) = 0,      T*(t_max) = min_σ F(σ, 0, D) + (B − 1) · t_max.

Activation recompute is a dimension of the table, not of the recurrence: each entry t[k, i, m, f] is
already the fastest recompute choice of that stage that fits memory (``passes.recompute``),

    t[k, i, m, f] = min_{R ⊆ k..i, mem(k, i, m, f, R) ≤ M}  max(lat(k, i, m) + Σ_{l ∈ R} fwd_l + 2c, transfer_k),

with R running over L + 1 nested prefixes only (the "auto" layers ordered by bytes saved per second of
extra forward), so recompute widens the table's pricing, never the DP's search. c is the pipeline
runtime's host time per (stage, microbatch) and direction (``Cluster.microbatch_overhead``): each of the
B microbatches' forward and backward on a stage pays it once, so every entry carries 2c and T grows by
2c·(σ + B − 1) for σ stages (where no transfer bounds a cycle): more microbatches and more stages cost host
time. The table's builder (``inter_op.StageCosts``) adds it to every entry at every B; the one plan that
runs without the pipeline runtime, one stage at B = 1, is over-charged here by 2c and priced exactly by
the driver's single-stage solve (``exact_checks.or_single_stage``).

t_max runs over the distinct table values in ascending order and stops once B · t_low ≥ the best T found,
t_low the smallest cap not tried yet: every plan still to be found has its slowest stage at t_low or
above, so T ≥ B · t_low. ``bucket`` > 0 skips caps within that relative distance of the last one tried
(Alpa's ε), never the largest; 0 makes the search exact. A plan found under cap t_max is reported at its own
slowest stage, T = F + (B − 1) · max_s t_s ≤ F + (B − 1) · t_max: the cost of the plan itself, so a cap
that bucketing placed above the plan's slowest stage does not inflate it (by up to ε · (B − 1) · t_max,
enough to rank one microbatch count above another that ties with it). ``brute_force`` enumerates every
partition for tests.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import NamedTuple

import numpy as np

INF = float("inf")


class DPStage(NamedTuple):
    """One stage the DP placed: layers first..last (inclusive) on a submesh of the ``size_index``-th
    distinct size (``option_for`` maps it back to the cheapest option of that size)."""

    first: int
    last: int
    size_index: int


@dataclasses.dataclass(frozen=True)
class DPResult:
    """stages: in pipeline order; cost: T; t_max: max_s t_s (the plan's slowest stage)."""

    stages: tuple[DPStage, ...]
    cost: float
    t_max: float


def inflight(sigma: int, microbatches: int, schedule: str) -> int:
    """Microbatches a stage with σ stages from it to the end (itself included) keeps alive."""
    return microbatches if schedule == "gpipe" else min(sigma, microbatches)


def stage_dp(table: np.ndarray, sizes: list[int], devices: int, microbatches: int, *, schedule: str = "1f1b",
             max_stages: int | None = None, stages: int | None = None, bucket: float = 0.0,
             hops: np.ndarray | None = None, bound: float = INF) -> DPResult | None:
    """Best stages for ``table`` [L, L, M, F] (see module docstring); None when nothing fits.

    stages: force exactly this many stages; max_stages: at most this many (default L).
    bound: a cost the caller already has (another B's plan). The search stops once (B − 1) · t_low > bound
    (t_low: the smallest cap not tried yet): a plan found from there on has its slowest stage at t_low or
    above and costs F + (B − 1) · t_low > bound, so nothing skipped could cost as little as ``bound`` (ties
    are kept). The result may then
    cost more than bound (or be None) where the unbounded search would have found a plan; either way it
    does not beat or tie ``bound``.
    """
    L = table.shape[0]
    S = min(stages or max_stages or L, L)
    hops = np.zeros(L) if hops is None else np.asarray(hops, dtype=float)
    by_size = _cheapest_per_size(table, sizes)
    best: DPResult | None = None
    last, low = -INF, None  # low: the smallest cap not tried yet (a skipped one, or this one)
    caps = np.unique(by_size[np.isfinite(by_size)])
    for n, t_max in enumerate(caps):
        low = t_max if low is None else low
        if (best is not None and microbatches * low >= best.cost) or (microbatches - 1) * low > bound:
            break
        if bucket and t_max <= last * (1 + bucket) and n < len(caps) - 1:
            continue
        last, low = t_max, None
        found = _solve_capped(by_size, sizes, devices, microbatches, schedule, S, stages, t_max, hops)
        if found is not None and (best is None or found.cost < best.cost):
            best = found
    return best


def _cheapest_per_size(table: np.ndarray, sizes: list[int]) -> np.ndarray:
    """[L, L, n, F]: for each device count, its cheapest option (only the cheapest can meet a cap first)."""
    distinct = sorted(set(sizes))
    out = np.full(table.shape[:2] + (len(distinct),) + table.shape[3:], INF)
    for m, size in enumerate(sizes):
        j = distinct.index(size)
        out[:, :, j] = np.minimum(out[:, :, j], table[:, :, m])
    return out


def _solve_capped(by_size, sizes, D, B, schedule, S, exact_stages, t_max, hops) -> DPResult | None:
    distinct = sorted(set(sizes))
    L = by_size.shape[0]
    capped = np.where(by_size <= t_max, by_size, INF)
    F = np.full((S + 1, L + 1, D + 1), INF)
    F[0, L, 0] = 0.0
    arg = np.full((2, S + 1, L + 1, D + 1), -1)  # (last layer i, size index j) of F's argmin
    for sigma in range(1, S + 1):
        f = min(inflight(sigma, B, schedule), by_size.shape[3]) - 1
        for i in range(L):
            prev = F[sigma - 1, i + 1]
            if not np.isfinite(prev).any():
                continue
            for j, n in enumerate(distinct):
                if n > D:
                    continue
                lat = capped[: i + 1, i, j, f] + hops[: i + 1]      # stages k..i for every k ≤ i
                cand = lat[:, None] + prev[None, : D + 1 - n]        # [k, d - n]
                cur = F[sigma, : i + 1, n:]
                better = cand < cur
                if better.any():
                    F[sigma, : i + 1, n:] = np.where(better, cand, cur)
                    arg[0, sigma, : i + 1, n:][better] = i
                    arg[1, sigma, : i + 1, n:][better] = j
    candidates = [exact_stages] if exact_stages else range(1, S + 1)
    sigma = min(candidates, key=lambda s: F[s, 0, D] if s <= S else INF)
    if sigma > S or not np.isfinite(F[sigma, 0, D]):
        return None
    stages = _unwind(arg, sigma, D, distinct, sizes, by_size)
    slowest = max(by_size[st.first, st.last, st.size_index, min(inflight(sigma - s, B, schedule), by_size.shape[3]) - 1]
                  for s, st in enumerate(stages))
    return DPResult(stages, F[sigma, 0, D] + (B - 1) * slowest, slowest)


def _unwind(arg, sigma, D, distinct, sizes, by_size) -> tuple[DPStage, ...]:
    """Rebuild the stages from the DP's argmin table."""
    out, k, d = [], 0, D
    while sigma > 0:
        i, j = (int(x) for x in arg[:, sigma, k, d])
        out.append(DPStage(k, i, j))
        k, d, sigma = i + 1, d - distinct[j], sigma - 1
    return tuple(out)


def option_for(table: np.ndarray, sizes: list[int], k: int, i: int, size_index: int, f: int) -> int:
    """The cheapest submesh option of the given size for stage (k, i) with f in flight."""
    size = sorted(set(sizes))[size_index]
    options = [m for m, n in enumerate(sizes) if n == size]
    return min(options, key=lambda m: table[k, i, m, f - 1])


def brute_force(table: np.ndarray, sizes: list[int], devices: int, microbatches: int, *,
                schedule: str = "1f1b", hops: np.ndarray | None = None) -> float:
    """T of the best plan by enumerating every layer partition and submesh assignment (small cases only)."""
    L = table.shape[0]
    hops = np.zeros(L) if hops is None else hops
    best = INF
    for n_stages in range(1, L + 1):
        for cuts in itertools.combinations(range(1, L), n_stages - 1):
            bounds = [0, *cuts, L]
            ranges = [(bounds[s], bounds[s + 1] - 1) for s in range(n_stages)]
            for options in itertools.product(range(len(sizes)), repeat=n_stages):
                if sum(sizes[m] for m in options) != devices:
                    continue
                lats = [table[k, i, m, min(inflight(n_stages - s, microbatches, schedule), table.shape[3]) - 1]
                        for s, ((k, i), m) in enumerate(zip(ranges, options))]
                if all(math.isfinite(t) for t in lats):
                    fill = sum(hops[k] for k, _ in ranges)
                    best = min(best, sum(lats) + fill + (microbatches - 1) * max(lats))
    return best
