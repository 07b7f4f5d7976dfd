"""Collectives as a training step meets them, on CPU ranks: each timed right after a burst of compute.

Invariant: an in-step fit prices what one collective adds to a step whose compute it follows,

    t_step(kind, m) = median over windows w of [ max_ranks T_w(burst; kind(m)) − max_ranks T_w(burst) ] / k

T_w(burst; kind(m)): a window of k iterations of [the probe step's forward + backward (``probe_step``'s
``TinyBlock`` at ``probe_shape``) repeated to about BURST_S, then one ``kind`` collective of m bytes], every
rank at once;
T_w(burst): the same window without the collective, timed just before it (the two alternate, so a drifting
machine moves both). Both are the slowest rank's: a step ends when its slowest rank's collective does. The
difference then holds what the isolated probe (back-to-back calls on warm buffers) leaves out: the wait for a
rank still computing, buffers the compute evicted, gloo's threads starting on cores the other rank's compute
holds. Fitted per "<kind>/<g>" with ``probes.fit_alpha_beta`` and stored under "<kind>/<g>@step", which
``cost_models.communication`` prefers to the isolated fit (a 2-D mesh's own fit still comes first).

On 2 gloo ranks of a 2-core VM (idle, 2026-11-27) dp's 13 MB gradient all-reduce took 2.45× its isolated
price inside a training step and 1.76× even on the rank that waits least; ZeRO-2's reduce-scatter +
all-gather 4.02× (``benchmarks/results/collective_share_idle_2026-11-27_0230.txt``).

Overlap (``Cluster.comm_overlap``): the runtime issues the gradient sync's all-reduces and ZeRO-3's prefetched
all-gathers asynchronously beside compute. For each of those two kinds at the largest in-step size, windows of
[start it; burst; wait] alternate with the two above, three times as many windows as a point (both a and b
are differences of noisy windows); with a = what it adds after the burst and b = what it adds started before
it, summed over the two kinds, compute hid the share ω = 1 − Σb/Σa, clipped to [0, 1]. On 2 gloo ranks of the
2-core VM, ω ≈ 0.2-0.3: gloo's threads copy and reduce on the cores the ranks compute on, so "hidden" sync
mostly is not.

Kinds: all_reduce, all_gather, reduce_scatter (the step's own collectives), and "zero_pair": the
reduce-scatter of a flat gradient buffer of m bytes into the rank's shard and the all-gather of the shards back
(``runtime.gradsync`` at ZeRO 1-2), m as ``all_reduce``'s (the full buffer). CPU ranks only: on GPUs the
collectives run on their own stream beside the compute, and GPU-cluster prices must not move.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import statistics
import time

import torch
import torch.distributed as dist

from autopar.profiling.probe_step import TinyBlock, probe_shape
from autopar.profiling.probes import collective_call, fit_alpha_beta, slowest_rank, warm_up
from autopar.runtime.flat_collectives import all_gather_flat, reduce_scatter_flat

IN_STEP_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "zero_pair")
OVERLAP_KINDS = ("all_reduce", "all_gather")  # issued beside compute: the gradient sync, ZeRO-3's prefetch
IN_STEP_SUFFIX = "@step"
BURST_S = 0.04  # seconds of compute before each timed collective
MAX_SIZES = 4  # the largest message sizes of the profile's ladder (a step's collectives: 0.25-16 MiB on CPUs)


def in_step_sizes(message_bytes) -> tuple[int, ...]:
    return tuple(message_bytes)[-MAX_SIZES:]


def zero_pair_call(nbytes: int, g: int, group, device: torch.device) -> tuple:
    """(call running one ZeRO-2 reduce-scatter + all-gather over ``group``, its m) as ``runtime.gradsync``."""
    elems = max(g, nbytes // 4 // g * g)
    flat, shard = torch.zeros(elems, device=device), torch.zeros(elems // g, device=device)

    def call():
        reduce_scatter_flat(shard, flat, group=group)
        all_gather_flat(flat, shard.clone(), group=group)
    return call, elems * 4


def _collective(kind: str, nbytes: int, g: int, group, device) -> tuple:
    if kind == "zero_pair":
        return zero_pair_call(nbytes, g, group, device)
    return collective_call(kind, nbytes, g, group, device)


def _burst(settings, probe):
    """The compute a step's collective follows: forward + backward of the profiler's probe block, repeated to
    about BURST_S on the slowest rank (at most the profile's probe window): a few layers' backward, long
    enough to evict a collective's buffers."""
    shape = probe_shape("cpu")
    block = TinyBlock(shape.width).to(probe.torch)
    x = torch.randn(shape.tokens, shape.width, device=probe.torch)
    step = lambda: block(x).backward()  # noqa: E731
    dist.barrier()
    burst_s = min(BURST_S, settings.probe_window_s)  # quick profiles: a shorter burst
    repeats = max(1, math.ceil(burst_s / max(slowest_rank(warm_up(step, settings.warmup, probe), probe), 1e-9)))

    def burst():
        for _ in range(repeats):
            step()
    return burst


def _window(calls, iterations: int) -> float:
    begin = time.perf_counter()
    for _ in range(iterations):
        for call in calls:
            call()
    return time.perf_counter() - begin


def _added(burst, variants, settings, probe, windows: int | None = None) -> list[float]:
    """Seconds each of ``variants`` (call sequences) adds over the burst alone, per iteration: the median over
    ``windows`` (default the settings') of the slowest rank's window less its burst-alone window (they
    alternate), the same on every rank."""
    dist.barrier()
    slowest = slowest_rank(warm_up(lambda: _window(variants[0], 1), settings.warmup, probe), probe)
    iterations = max(2, math.ceil(settings.probe_window_s / max(slowest, 1e-9)))
    rows = [[] for _ in range(len(variants) + 1)]
    for _ in range(windows or settings.windows):
        for row, calls in zip(rows, [(burst,)] + list(variants)):
            dist.barrier()
            row.append(_window(calls, iterations))
    times = torch.tensor(rows, dtype=torch.float64, device=probe.torch)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return [statistics.median(float(p - a) / iterations for a, p in zip(times[0], row)) for row in times[1:]]


def _point(burst, collective, settings, probe) -> float:
    """Seconds one collective adds after a burst (module docstring), the same on every rank."""
    return _added(burst, [(burst, collective)], settings, probe)[0]


def measure_overlap(settings, probe) -> dict[str, tuple[float, float]]:
    """{kind: (seconds it adds after a burst, seconds it adds started before the burst and waited after)} for
    ``OVERLAP_KINDS`` on the world group at the largest in-step size; {} on GPUs or with one rank."""
    world = dist.get_world_size()
    if probe.kind == "cuda" or world < 2:
        return {}
    burst, nbytes, out = _burst(settings, probe), max(in_step_sizes(settings.message_bytes)), {}
    windows = min(settings.max_windows, 3 * settings.windows)
    for kind in OVERLAP_KINDS:
        call, _ = collective_call(kind, nbytes, world, None, probe.torch)
        start, _ = collective_call(kind, nbytes, world, None, probe.torch, async_op=True)
        out[kind] = tuple(_added(burst, [(burst, call), (_beside(start, burst),)], settings, probe, windows))
    return out


def _beside(start, burst):
    """One call: start the collective, run the burst, wait for the collective."""
    def call():
        work = start()
        burst()
        work.wait()
    return call


def comm_overlap(points: dict[str, tuple[float, float]]) -> float | None:
    """ω of the module docstring from ``measure_overlap``'s points (None when no kind added measurable time)."""
    usable = [(after, beside) for after, beside in points.values() if after > 0]
    if not usable:
        return None
    return min(1.0, max(0.0, 1.0 - sum(b for _, b in usable) / sum(a for a, _ in usable)))


def measure_in_step(settings, probe, group_sizes) -> dict[str, list[tuple[int, float]]]:
    """{"<kind>/<g>": [(m bytes, in-step seconds), ...]} for every g of ``group_sizes``, all ranks at once
    (each in its group of g consecutive ranks); {} on GPUs or with one rank."""
    world = dist.get_world_size()
    if probe.kind == "cuda" or world < 2:
        return {}
    burst, points = _burst(settings, probe), {}
    timeout = datetime.timedelta(seconds=settings.timeout_s)  # a rank that died makes the others fail, not hang
    for g in group_sizes:
        mine = None
        for first in range(0, world, g):  # new_group is collective over the world
            group = dist.new_group(list(range(first, first + g)), timeout=timeout)
            mine = group if first <= dist.get_rank() < first + g else mine
        for kind in IN_STEP_KINDS:
            for nbytes in in_step_sizes(settings.message_bytes):
                call, m = _collective(kind, nbytes, g, mine, probe.torch)
                points.setdefault(f"{kind}/{g}", []).append((m, _point(burst, call, settings, probe)))
    return points


def in_step_fits(points: dict[str, list[tuple[int, float]]]) -> tuple[dict, str]:
    """({"<kind>/<g>@step": CollectiveFit}, a note for the cluster's source). A point whose collective added
    nothing measurable (the difference of two noisy windows ≤ 0) is left out of its fit; a kind with fewer
    than two points left gets none (the isolated fit then prices it)."""
    fits, notes = {}, []
    for key, pts in points.items():
        usable = [(m, t) for m, t in pts if t > 0]
        if len(usable) < 2:
            notes.append(f"{key} not fitted ({len(usable)} positive points)")
            continue
        fits[key + IN_STEP_SUFFIX] = fit_alpha_beta(*zip(*usable))
        largest = max(usable)
        notes.append(f"{key} {largest[1] * 1e3:.1f} ms at {largest[0] / 2**20:.1f} MiB")
    if not points:
        return {}, ""
    return fits, "collectives after a compute burst (fits '@step'): " + ", ".join(notes)


def with_in_step_fits(cluster, per_rank: list[dict]):
    """``cluster`` with the in-step fits added to its links (one machine: intra_node is inter_node) and the
    measured ``comm_overlap``, and a note for its source line ("" when nothing was measured)."""
    fits, note = in_step_fits(per_rank[0].get("in_step") or {})
    points = per_rank[0].get("overlap") or {}
    overlap = comm_overlap(points)
    if overlap is not None:
        cluster = dataclasses.replace(cluster, comm_overlap=overlap)
        shown = ", ".join(f"{k} {b * 1e3:.1f} of {a * 1e3:.1f} ms" for k, (a, b) in points.items())
        note = "; ".join(filter(None, [note, f"compute hides {overlap:.2f} of a collective beside it (added "
                                             f"beside / after a burst: {shown})"]))
    if not fits:
        return cluster, note
    link = dataclasses.replace(cluster.intra_node, fits={**cluster.intra_node.fits, **fits})
    inter = link if cluster.nodes == 1 else cluster.inter_node
    return dataclasses.replace(cluster, intra_node=link, inter_node=inter), note
