"""Three measurements ``autopar.profiler`` does not make yet, as a prototype for it: in-mesh collective
fits, the per-op host overhead, and how fast training's matmuls run against the square-mm curve.

    cluster = add_profile_extras(autopar.Cluster.from_json("cluster.json"))

1. Collectives in the mesh. The profiler times each collective with every group of one size busy at
   once, one axis at a time. On 4 gloo ranks sharing 2 cores that misses how a 2-D mesh behaves:
   training alternates the two axes' collectives (gradient all-reduces on the batch axis between the
   tensor-parallel ones), so each one waits for ranks that were just busy in the other axis's group.
   Measured 2026-11-22 on the development VM: all_reduce/2 of 4 KiB took 2.0 ms on one axis alone but
   3.6 ms per call with the two axes of a 2×2 mesh alternating, and the fidelity benchmark's 2×2 plans
   spent 2-3x the communication time the single-axis fits predicted. Method, per mesh (R, C) of the
   world with R, C >= 2, per collective and message size (the profiler's sizes and per-device m): every
   rank loops [collective on its axis-0 group; the same on its axis-1 group] in timed windows (the
   profiler's method, 5 windows of 0.1 s), all ranks at once; the pair's time is split between the axes
   in proportion to their single-axis fits (half each when R = C), and each axis gets ``fit_alpha_beta``
   of its points under the key "<kind>/<n>@<R>x<C>", which ``cost_models.communication`` prefers there.

2. op_overhead (``Cluster.op_overhead``): host seconds per eager op call. Every rank runs forward +
   backward of a tiny GPT (every tensor a few hundred bytes, so kernels cost ~nothing) in timed windows,
   all ranks at once; op_overhead = median over ranks of t / (2 · call_function nodes of its graph),
   the charge ``cost_models.compute`` makes (one call forward, one backward, per node).

3. Training matmuls. The profiler's curve times square ``mm`` calls back to back on the same, cache-hot
   operands. Training's linears are rectangular, two of their three GEMMs read a transposed operand, and
   other ops evict their operands in between: measured 2026-11-22 on the development VM (4 ranks at
   once), the GPT example's linears ran at 0.71× the curve's rate (``benchmarks/op_costs.py``). Method:
   forward + backward (``torch.autograd.grad`` of ``F.linear``, three GEMMs) for each shape of
   ``TRAINING_SHAPES``, timed like the rest, all ranks at once; per shape, factor = curve-predicted GEMM
   time / (measured − 2 · op_overhead); the float32 curve's rates are multiplied by the median factor.
"""
from __future__ import annotations

import dataclasses
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.cluster import Cluster
from autopar.profiler import COLLECTIVES, FULL, _calls_per_window, _collective_call, _seconds_per_call, \
    _slowest_rank, _warm_up, fit_alpha_beta
from autopar.profiler_device import ProbeDevice
from examples.gpt import GPTConfig, make_gpt

CPU = ProbeDevice("cpu")  # these extras are measured on the local gloo ranks

TINY = GPTConfig(vocab_size=16, seq_len=4, n_layer=2, n_head=2, n_embd=8)
# The profiler's sizes, with longer and more windows than its 4 × 15 ms: an interleaved pair of small
# collectives takes a few ms here, and short windows made the in-mesh α vary 2x between runs.
SETTINGS = dataclasses.replace(FULL, windows=5, window_s=0.1)
# (tokens, in features, out features) of the linears timed for item 3: a spread of transformer-like shapes.
TRAINING_SHAPES = ((256, 256, 1024), (256, 1024, 256), (1024, 256, 768), (1024, 512, 512), (2048, 256, 256))


def meshes_of(world: int) -> list[tuple[int, int]]:
    """Every 2-D mesh (R, C) of ``world`` ranks with both sides >= 2."""
    return [(r, world // r) for r in range(2, world // 2 + 1) if world % r == 0]


def _axis_groups(mesh: tuple[int, int]) -> tuple:
    """This rank's (axis-0 group, axis-1 group) of a row-major mesh; every rank creates every group."""
    rows, cols = mesh
    me, mine = dist.get_rank(), [None, None]
    for axis, groups in enumerate(([[r * cols + c for r in range(rows)] for c in range(cols)],
                                   [[r * cols + c for c in range(cols)] for r in range(rows)])):
        for members in groups:
            group = dist.new_group(members)
            mine[axis] = group if me in members else mine[axis]
    return tuple(mine)


def _timed_per_call(call) -> float:
    """Seconds per ``call`` by the profiler's method: warm-up, then windows with every rank at once."""
    dist.barrier()
    slowest = _slowest_rank(_warm_up(call, SETTINGS.warmup, CPU), CPU)
    return _seconds_per_call(call, _calls_per_window(slowest, SETTINGS), SETTINGS.windows, CPU)


def _measure_rank(rank: int, meshes: list[tuple[int, int]]) -> dict:
    """{(mesh, kind): [(m0, m1, seconds per pair), ...], "tiny_step": seconds} on this rank."""
    out = {}
    for mesh in meshes:
        groups = _axis_groups(mesh)
        for kind in COLLECTIVES:
            for nbytes in SETTINGS.message_bytes:
                (call0, m0), (call1, m1) = (_collective_call(kind, nbytes, mesh[a], groups[a], CPU.torch)
                                              for a in (0, 1))
                t = _timed_per_call(lambda: (call0(), call1()))
                out.setdefault((mesh, kind), []).append((m0, m1, t))
    model, batch = make_gpt(TINY, batch_size=1)
    out["tiny_step"] = _timed_per_call(lambda: model(*batch).backward())
    out["linears"] = [_timed_per_call(_linear_step(*shape)) for shape in TRAINING_SHAPES]
    return out


def _linear_step(tokens: int, d_in: int, d_out: int):
    """Forward + backward of one linear layer (three GEMMs), as a zero-argument call."""
    x = torch.randn(tokens, d_in, requires_grad=True)
    w = torch.randn(d_out, d_in, requires_grad=True)
    g = torch.randn(tokens, d_out)
    return lambda: torch.autograd.grad(F.linear(x, w), (x, w), g)


def training_matmul_factor(cluster: Cluster, seconds: list[float], overhead: float) -> float:
    """Median over ``TRAINING_SHAPES`` of curve-predicted GEMM seconds / measured kernel seconds."""
    factors = []
    for (tokens, d_in, d_out), measured in zip(TRAINING_SHAPES, seconds):
        flops = 2.0 * tokens * d_in * d_out
        predicted = 3 * flops / cluster.matmul_flops("float32", flops)
        factors.append(predicted / max(measured - 2 * overhead, 1e-9))
    return statistics.median(factors)


def add_profile_extras(cluster: Cluster) -> Cluster:
    """``cluster`` with in-mesh fits on its intra-node link and a measured op_overhead (module docstring)."""
    from autopar.passes.capture import capture

    meshes = meshes_of(cluster.num_devices)
    per_rank = autopar.launch(_measure_rank, cluster.num_devices, meshes, timeout=SETTINGS.timeout_s)
    fits = dict(cluster.intra_node.fits)
    for key, points in per_rank[0].items():
        if key in ("tiny_step", "linears"):
            continue
        mesh, kind = key
        times = [statistics.median(r[key][i][2] for r in per_rank) for i in range(len(points))]
        alone = [cluster.intra_node.fits.get(f"{kind}/{mesh[a]}") for a in (0, 1)]
        for axis in (0, 1):
            parts = [_share(alone, axis, m0, m1) * t for (m0, m1, _), t in zip(points, times)]
            fits[f"{kind}/{mesh[axis]}@{mesh[0]}x{mesh[1]}"] = fit_alpha_beta([p[axis] for p in points], parts)
    nodes = sum(n.op == "call_function" for n in capture(*make_gpt(TINY, batch_size=1)).gm.graph.nodes)
    overhead = statistics.median(r["tiny_step"] for r in per_rank) / (2 * nodes)
    link = dataclasses.replace(cluster.intra_node, fits=fits)
    linears = [statistics.median(r["linears"][i] for r in per_rank) for i in range(len(TRAINING_SHAPES))]
    factor = training_matmul_factor(cluster, linears, overhead)
    curve, peak = dict(cluster.matmul_curve), dict(cluster.peak_flops)
    if "float32" in curve:
        curve["float32"] = [[flops, rate * factor] for flops, rate in curve["float32"]]
        peak["float32"] = max(rate for _, rate in curve["float32"])
    return dataclasses.replace(cluster, intra_node=link, inter_node=link if cluster.nodes == 1 else cluster.inter_node,
                               op_overhead=overhead, matmul_curve=curve, peak_flops=peak,
                               source=cluster.source + "; in-mesh fits, op_overhead and the float32 curve scaled by "
                                                       f"{factor:.2f} for training matmuls by benchmarks/profile_extras.py")


def _share(alone, axis: int, m0: float, m1: float) -> float:
    """Axis ``axis``'s part of a pair's time: its single-axis fit over both (half when either is unknown)."""
    if alone[0] is None or alone[1] is None:
        return 0.5
    t0, t1 = alone[0].time(m0), alone[1].time(m1)
    return (t0 if axis == 0 else t1) / (t0 + t1)
