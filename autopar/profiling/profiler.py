"""Measure the machine autopar runs on and describe it as a ``Cluster``.

    cluster = autopar.Cluster.profile(4, out="cluster.json")
    # or: python -m autopar.profiling.profiler 4 --out cluster.json  (or: autopar profile 4 --out cluster.json)

``profile_cluster(n)`` spawns n local gloo ranks with ``autopar.launch`` and measures with every rank busy
at once, as in training (4 ranks on 2 cores each get about half a core, and the figures say so):

* matmul: square ``torch.mm`` of side s (2·s³ FLOPs per call) per dtype, timed against the reference mm
  (``probes.SpeedReference``: every compute figure of a profile at the same machine speed); ``matmul_curve[dtype]`` is
  ``[[2·s³, 2·s³ / t], ...]`` and ``peak_flops[dtype]`` its maximum, with ``matmul_efficiency`` = 1 (the
  figures are achieved rates, not datasheet peaks). A dtype's ladder stops before a call slower than
  ``max_matmul_call_s`` on some rank (float16 mm runs ~50× slower than float32 on CPUs without native
  fp16 kernels), and the dtype is left out when its smallest size already is; ``Cluster.matmul_flops``
  clamps larger calls to the last point.
* memory bandwidth: ``torch.add(a, b, out=c)`` on float32 tensors larger than the caches;
  bandwidth = 3·|a| bytes / t (read a, read b, write c: inputs + outputs, as ``cost_models.compute`` counts).
* collectives, for every group size g > 1 dividing n (the axis sizes of the cluster's 2-D meshes): the
  ranks split into n/g groups of consecutive ranks that all run the collective at once. m, the message
  size, is per device exactly as ``cost_models.communication`` defines it: all_reduce the full tensor,
  all_gather the gathered output (input m/g), reduce_scatter the input (output m/g), all_to_all the
  local tensor (in = out = m). send is a ping-pong between ranks (2i, 2i+1), t = round trip / 2, stored
  as "send/2".

* training conditions (``autopar.profiling.profiler_training``): collectives with both axes of each 2-D mesh
  alternating (fits keyed "<kind>/<n>@<R>x<C>"), the host overhead per op call (``op_overhead``), the
  factor training-shaped linears run at against the square-mm curve (the curve is scaled by it), and, with
  2 or more ranks, the pipeline runtime's host time per (chunk, microbatch) (``microbatch_overhead``,
  ``autopar.profiling.profiler_pipeline``).
* collectives as a step meets them (``autopar.profiling.profiler_in_step``, CPU ranks): each collective kind, and
  ZeRO's reduce-scatter + all-gather pair, timed right after a burst of compute on every rank; fits keyed
  "<kind>/<g>@step", which the cost model prefers to the isolated ones; and the share of an all-reduce or
  all-gather that compute running beside it hides (``comm_overlap``).
* the level as a training step meets it (``autopar.profiling.profiler_neighbour``, 2+ CPU ranks): every compute
  figure above is its ratio to the reference mm times the reference's level times ρ, the reference's speed
  beside a neighbour's training step over beside the reference.

Timing: after warm-up calls, each rank times ``windows`` windows of back-to-back calls lasting about
``window_s`` each (the calls per window agreed by all ranks) and keeps the median of window / calls; a
point is the median of that over ranks. Fit, per "<collective>/<g>":

    t(m) = α + m·β,   minimizing Σ_i ((α + m_i·β − t_i) / t_i)²,   α ≥ 0,  β ≥ 1e-15 s/byte

(relative residuals, so the 4 KiB points weigh as much as the 16 MiB ones). Link.latency/bandwidth restate
the all_reduce fit of the largest group n in ring terms: latency = α, bandwidth = 2(n−1)/n / β, so the
analytic ring formula reproduces that fit exactly. On one machine intra_node and inter_node are the same
measured link (gloo over loopback).
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import socket
import statistics
import sys

import torch
import torch.distributed as dist
from tqdm import tqdm

from autopar.errors import ClusterError
from autopar.hardware.cluster import Cluster, Link
from autopar.launch import launch
from autopar.profiling.probes import (
    COLLECTIVES,
    SpeedReference,
    calls_per_window,
    collective_call,
    fit_alpha_beta,
    seconds_per_call,
    slowest_rank,
    warm_up,
)
from autopar.profiling.profiler_device import KINDS as DEVICE_KINDS
from autopar.profiling.profiler_device import ProbeDevice
from autopar.profiling.profiler_in_step import measure_in_step, measure_overlap, with_in_step_fits
from autopar.profiling.profiler_neighbour import measure_neighbour, neighbour_factor, neighbour_note
from autopar.profiling.profiler_training import apply_training_measurements, measure_rank, training_seconds

KiB, MiB = 2**10, 2**20
MATMUL_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileSettings:
    """How much to measure; ``QUICK`` (tests, a few seconds) is coarser and noisier than ``FULL``.

    message_bytes: per-device message sizes m of the collectives.  matmul_sizes: sides s of square mm.
    warmup: untimed calls before each point.  windows × window_s: each point is timed as ``windows``
      windows of back-to-back calls lasting about ``window_s`` each (at least one call).
    probe_window_s: the window of the training-condition compute probes (a step of a block, a linear's
      three GEMMs): long enough for many scheduler slices, so two ranks sharing cores see the same mix.
    max_matmul_call_s: a dtype's size ladder stops before a call would take longer (predicted as s³).
    stream_bytes: bytes of each operand of the bandwidth probe (well above the last-level cache).
    timeout_s: per-collective timeout of the profiling process group.
    compiled_probe: also time the probe training step under torch.compile (``Cluster.compiled_time_scale``;
      compiling it takes a minute on a few busy cores, so quick profiles leave it out).
    max_spread, max_windows: a compute probe whose ratios to the reference spread wider than max_spread
      (interquartile range / median, on some rank) gets ``windows`` more windows, up to max_windows in all
      (``probes.SpeedReference.measure``).
    """

    message_bytes: tuple[int, ...]
    matmul_sizes: tuple[int, ...]
    max_matmul_call_s: float
    stream_bytes: int
    warmup: int
    windows: int
    window_s: float
    probe_window_s: float = 0.1
    timeout_s: float = 120.0
    compiled_probe: bool = True
    max_spread: float = 0.10
    max_windows: int = 20


FULL = ProfileSettings(message_bytes=tuple(4 * KiB * 4**k for k in range(7)), matmul_sizes=(64, 128, 256, 512, 1024),
                       max_matmul_call_s=0.25, stream_bytes=64 * MiB, warmup=2, windows=5, window_s=0.03)
QUICK = ProfileSettings(message_bytes=(4 * KiB, 64 * KiB, 1 * MiB), matmul_sizes=(64, 128, 256),
                        max_matmul_call_s=0.05, stream_bytes=8 * MiB, warmup=1, windows=3, window_s=0.005,
                        probe_window_s=0.01, compiled_probe=False, max_windows=3)
# GPUs: larger matmuls (peak needs s ≥ 4096), messages up to 256 MiB, streams past a 50 MB L2 cache.
GPU_FULL = dataclasses.replace(FULL, message_bytes=tuple(4 * KiB * 4**k for k in range(9)),
                               matmul_sizes=(256, 512, 1024, 2048, 4096, 8192), stream_bytes=512 * MiB)
GPU_QUICK = dataclasses.replace(QUICK, matmul_sizes=(256, 1024, 4096), stream_bytes=256 * MiB)


def profile_cluster(nprocs: int | None = None, *, mesh_shape=None, quick: bool = False, progress: bool = True,
                    out=None, device: str = "auto") -> Cluster:
    """Measure this machine as ``nprocs`` ranks (default: WORLD_SIZE under torchrun, else the core count).

    mesh_shape: the returned cluster's default 2-D mesh (default (1, nprocs)); out: also write the JSON
    there; device: "cpu" (gloo ranks), "cuda" (one GPU per rank, NCCL, CUDA-event timing) or "auto"
    (cuda when there are nprocs GPUs). Must run outside any process group: it starts its own ranks.
    """
    if dist.is_available() and dist.is_initialized():
        raise ClusterError("profile_cluster starts its own gloo ranks, but a process group is already "
                           "initialized here; call it before init_process_group / outside autopar.launch")
    if nprocs is None and device != "cpu" and torch.cuda.is_available() and "RANK" not in os.environ:
        nprocs = torch.cuda.device_count()  # one rank per GPU
    nprocs = _resolve_nprocs(nprocs)
    base = Cluster.local(nprocs, mesh_shape=mesh_shape)  # validates mesh_shape before any rank starts
    probe = ProbeDevice.choose(device, nprocs)
    settings = {("cpu", False): FULL, ("cpu", True): QUICK, ("cuda", False): GPU_FULL,
                ("cuda", True): GPU_QUICK}[(probe.kind, quick)]
    per_rank = launch(_profile_rank, nprocs, settings, progress, probe, backend=probe.backend,
                      timeout=settings.timeout_s)[0]
    cluster = assemble_cluster(base, per_rank, quick=quick, probe=probe)
    if out is not None and int(os.environ.get("RANK", "0")) == 0:
        cluster.to_json(out)
    return cluster


def _resolve_nprocs(nprocs: int | None) -> int:
    world = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None
    if world is not None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if nprocs is not None and nprocs != world:
            raise ClusterError(f"profile_cluster(nprocs={nprocs}) under torchrun, which started {world} ranks; "
                               f"leave nprocs out or pass {world}")
        if local != world:
            raise ClusterError(f"profile_cluster measures one machine, but torchrun started {world} ranks with "
                               f"{local} per node; profile one node (torchrun --nnodes 1) and write the "
                               f"inter_node link of the JSON by hand")
        return world
    nprocs = (os.cpu_count() or 1) if nprocs is None else nprocs
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ClusterError(f"profile_cluster: nprocs must be a positive integer, got {nprocs!r}")
    return nprocs


def group_sizes(world: int) -> list[int]:
    """The mesh-axis sizes of a world of n ranks: every divisor g > 1 of n."""
    return [g for g in range(2, world + 1) if world % g == 0]


# ---- on every rank -------------------------------------------------------------------------------
def _profile_rank(rank: int, settings: ProfileSettings, progress: bool, probe: ProbeDevice) -> list[dict]:
    """This rank's measurements, then everyone's (all ranks return the same list, in rank order)."""
    probe = probe.bind(rank)
    world = dist.get_world_size()
    steps = len(MATMUL_DTYPES) * len(settings.matmul_sizes) + 1
    steps += (len(COLLECTIVES) * len(group_sizes(world)) + (world >= 2)) * len(settings.message_bytes)
    bar = tqdm(total=steps, desc=f"profiling {world} ranks", unit="step", file=sys.stderr,
               disable=not (progress and rank == 0))
    reference = SpeedReference(probe)
    mine = {"matmul": _measure_matmuls(settings, bar, probe, reference),
            "stream": _measure_stream(settings, bar, probe),
            "collectives": _measure_collectives(world, settings, bar, probe), "threads": torch.get_num_threads()}
    bar.set_postfix_str("in-mesh collectives, op overhead, training matmuls, pipeline host time")
    mine["training"] = measure_rank(settings, probe, reference)
    bar.set_postfix_str("collectives after a compute burst")
    mine["in_step"] = measure_in_step(settings, probe, group_sizes(world))
    mine["overlap"] = measure_overlap(settings, probe)
    bar.set_postfix_str("the reference beside a neighbour's training step")
    mine["neighbour"] = measure_neighbour(settings, probe, reference)
    bar.close()
    level = reference.level()  # compute figures so far in reference units: now seconds at the profile's speed
    beside = [None] * world
    dist.all_gather_object(beside, mine["neighbour"])
    mine = figures_at(mine, level * neighbour_factor(beside))  # the speed a step meets (profiler_neighbour)
    mine["reference"] = (reference.side, str(reference.dtype).replace("torch.", ""), level,
                         min(reference.windows), max(reference.windows))
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone


def _measure_point(call, settings: ProfileSettings, probe: ProbeDevice) -> float | None:
    """Seconds per ``call`` (None where this rank idles, call=None); all ranks call this together."""
    slowest = slowest_rank(warm_up(call, settings.warmup, probe) if call else 0.0, probe)
    if call is None:
        return None
    return seconds_per_call(call, calls_per_window(slowest, settings), settings.windows, probe)


def _measure_matmuls(settings: ProfileSettings, bar, probe: ProbeDevice,
                     reference: SpeedReference) -> dict[str, list[tuple[float, float]]]:
    """{dtype: [(2·s³ FLOPs, seconds per call in reference units on this rank), ...]}, dtypes with no
    usable size left out."""
    if probe.kind == "cuda":  # an idle GPU clocks down: bring it to its working clock before the ladder
        a = torch.randn(4096, 4096, device=probe.torch, dtype=torch.bfloat16)
        probe.window_seconds(lambda: torch.mm(a, a), 200)
    curve = {name: _matmul_ladder(getattr(torch, name), settings, bar, probe, reference) for name in MATMUL_DTYPES}
    return {name: points for name, points in curve.items() if points}


def _matmul_ladder(dtype: torch.dtype, settings: ProfileSettings, bar, probe: ProbeDevice,
                   reference: SpeedReference) -> list:
    """Square mm up ``matmul_sizes``, stopping on every rank at once before a call slower than
    ``max_matmul_call_s``: predicted from the previous size as t·(s'/s)³, else measured by the warm-up."""
    points, previous = [], None  # previous: (side, slowest rank's warm-up seconds)
    for i, size in enumerate(settings.matmul_sizes):
        bar.set_postfix_str(f"matmul {str(dtype).replace('torch.', '')} {size}³")
        a, b, c = (torch.randn(size, size, device=probe.torch).to(dtype) for _ in range(3))
        dist.barrier()
        predicted = previous[1] * (size / previous[0]) ** 3 if previous else 0.0
        warm = math.inf
        if predicted <= settings.max_matmul_call_s:
            try:
                warm = warm_up(lambda: torch.mm(a, b, out=c), settings.warmup, probe)
                # the fastest of three single calls: one call the scheduler held back on a busy machine
                # would stop the ladder at a size whose calls are in fact quick
                warm = min(warm, *(probe.window_seconds(lambda: torch.mm(a, b, out=c), 1) for _ in range(2)))
            except RuntimeError:  # this build has no kernel for the dtype: leave it out
                pass
        slowest = slowest_rank(warm, probe)
        if slowest > settings.max_matmul_call_s:
            bar.update(len(settings.matmul_sizes) - i)
            break
        points.append((2.0 * size**3, reference.ratio(lambda: torch.mm(a, b, out=c), settings, slowest_s=slowest)))
        previous = (size, slowest)
        bar.update()
    return points


def _measure_stream(settings: ProfileSettings, bar, probe: ProbeDevice) -> float:
    """This rank's memory bandwidth in bytes/s: 3·|a| / t of ``add(a, b, out=c)``."""
    bar.set_postfix_str("memory bandwidth")
    a, b, c = (torch.full((settings.stream_bytes // 4,), 1.0, device=probe.torch) for _ in range(3))
    dist.barrier()
    t = _measure_point(lambda: torch.add(a, b, out=c), settings, probe)
    bar.update()
    return 3 * settings.stream_bytes / t


def _measure_collectives(world: int, settings: ProfileSettings, bar, probe: ProbeDevice) -> dict[str, list]:
    """{"<collective>/<g>": [(m bytes, seconds per call on this rank, or None when idle), ...]}."""
    timeout = datetime.timedelta(seconds=settings.timeout_s)
    points: dict[str, list] = {}
    for g in group_sizes(world):
        my_group = None
        for first in range(0, world, g):  # new_group is collective over the world: every rank makes every group
            members = list(range(first, first + g))
            group = dist.new_group(members, timeout=timeout)
            my_group = group if dist.get_rank() in members else my_group
        for kind in COLLECTIVES:
            for nbytes in settings.message_bytes:
                bar.set_postfix_str(f"{kind}/{g} {nbytes // KiB} KiB")
                call, m = collective_call(kind, nbytes, g, my_group, probe.torch)
                dist.barrier()
                points.setdefault(f"{kind}/{g}", []).append((m, _measure_point(call, settings, probe)))
                bar.update()
    if world >= 2:
        for nbytes in settings.message_bytes:
            bar.set_postfix_str(f"send/2 {nbytes // KiB} KiB")
            call = _ping_pong_call(nbytes, world, probe.torch)
            dist.barrier()
            round_trip = _measure_point(call, settings, probe)
            points.setdefault("send/2", []).append((nbytes // 4 * 4, round_trip / 2 if call else None))
            bar.update()
    return points


def _ping_pong_call(nbytes: int, world: int, device: torch.device):
    """A round trip of one message between ranks 2i and 2i+1; None on an odd world's last rank."""
    rank = dist.get_rank()
    peer = rank ^ 1
    if peer >= world:
        return None
    buf = torch.zeros(nbytes // 4, device=device)
    if rank % 2 == 0:
        return lambda: (dist.send(buf, peer), dist.recv(buf, peer))
    return lambda: (dist.recv(buf, peer), dist.send(buf, peer))


def figures_at(mine: dict, level: float) -> dict:
    """``mine`` with its compute figures (the matmul ladder, the training probes) turned from reference units
    into seconds at ``level``, the seconds of one reference call."""
    matmul = {name: [(flops, ratio * level) for flops, ratio in points] for name, points in mine["matmul"].items()}
    return dict(mine, matmul=matmul, training=training_seconds(mine["training"], level))


# ---- in the caller: medians, fits, the Cluster ---------------------------------------------------
def _median_over_ranks(per_rank: list[list[tuple]]) -> list[tuple[float, float]]:
    """Pointwise median over ranks of [(x, seconds), ...] lists with the same x's (None = idle rank)."""
    out = []
    for column in zip(*per_rank):
        times = [t for _, t in column if t is not None]
        out.append((column[0][0], statistics.median(times)))
    return out


def assemble_cluster(base: Cluster, per_rank: list[dict], *, quick: bool = False,
                     probe: ProbeDevice = ProbeDevice("cpu")) -> Cluster:
    """The profiled cluster: ``base`` (``Cluster.local(n, mesh_shape)``) with every measured field replaced."""
    n = base.num_devices
    curve = {}
    for dtype_name in per_rank[0]["matmul"]:
        points = _median_over_ranks([r["matmul"][dtype_name] for r in per_rank])
        curve[dtype_name] = [[flops, flops / t] for flops, t in points]
    fits = {key: fit_alpha_beta(*zip(*_median_over_ranks([r["collectives"][key] for r in per_rank])))
            for key in per_rank[0]["collectives"]}
    representative = fits.get(f"all_reduce/{n}")
    link = Link(latency=representative.alpha, bandwidth=2 * (n - 1) / n / representative.beta, fits=fits) \
        if representative else base.intra_node  # one rank: nothing to measure, keep the defaults
    isolated = dataclasses.replace(
        base, name=f"{base.name}-profiled", matmul_curve=curve,
        peak_flops={d: max(rate for _, rate in pts) for d, pts in curve.items()}, matmul_efficiency=1.0,
        memory_bandwidth=statistics.median(r["stream"] for r in per_rank),
        intra_node=link, inter_node=link, **probe.cluster_fields())
    if "training" not in per_rank[0]:
        return dataclasses.replace(isolated, source=_source_line(n, per_rank[0]["threads"], quick, probe))
    cluster, note = apply_training_measurements(isolated, [r["training"] for r in per_rank], probe)
    cluster, in_step = with_in_step_fits(cluster, per_rank)
    return dataclasses.replace(cluster, source=_source_line(n, per_rank[0]["threads"], quick, probe) + "; " + note
                               + _reference_note(per_rank) + neighbour_note([r.get("neighbour") for r in per_rank])
                               + (f"; {in_step}" if in_step else ""))


def _reference_note(per_rank: list[dict]) -> str:
    """The speed every compute figure was scaled to (``probes.SpeedReference``), for the source line."""
    if "reference" not in per_rank[0]:
        return ""
    side, dtype, *_ = per_rank[0]["reference"]
    level = statistics.median(r["reference"][2] for r in per_rank)
    rate = lambda seconds: 2.0 * side**3 / seconds / 1e9  # noqa: E731
    moved = ""
    if len(per_rank[0]["reference"]) == 5:  # its fastest and slowest window over the profile, over all ranks
        fastest, slowest = min(r["reference"][3] for r in per_rank), max(r["reference"][4] for r in per_rank)
        moved = f"; its windows ran at {rate(slowest):.1f}-{rate(fastest):.1f} over the profile"
    return (f"; compute probes timed against {dtype} mm {side}³, their figures at its median speed "
            f"({rate(level):.1f} GFLOP/s per rank){moved}")


def _source_line(n: int, threads: int, quick: bool, probe: ProbeDevice) -> str:
    when = datetime.datetime.now().isoformat(timespec="seconds")
    link = "NVLink/PCIe through NCCL" if probe.kind == "cuda" else "gloo over loopback"
    return (f"profiled on {socket.gethostname()} {when} by autopar.profiling.profiler{' (quick)' if quick else ''}: "
            f"{probe.describe(n, threads)}, all ranks busy at once; torch {torch.__version__}. One machine: "
            f"intra_node and inter_node are the same measured link ({link}); latency/bandwidth restate the "
            f"all_reduce/{n} fit in ring terms")


def _main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m autopar.profiling.profiler", description=__doc__.splitlines()[0])
    parser.add_argument("nprocs", type=int, nargs="?", default=None, help="local ranks (default: core count)")
    parser.add_argument("--out", default="cluster.json", help="where to write the cluster JSON")
    parser.add_argument("--mesh", type=int, nargs=2, default=None, metavar=("ROWS", "COLS"))
    parser.add_argument("--quick", action="store_true", help="a coarse profile in a few seconds")
    parser.add_argument("--device", choices=DEVICE_KINDS, default="auto")
    args = parser.parse_args(argv)
    profile_cluster(args.nprocs, mesh_shape=args.mesh, quick=args.quick, out=args.out, device=args.device)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    _main()
