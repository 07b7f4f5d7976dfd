"""What ``autopar.profiling.profiler`` measures in training conditions, on top of its isolated probes:

    per rank: measure_rank(settings, probe, reference) -> raw figures     (inside the profiler's launch)
              training_seconds(raw, reference.level()) -> seconds
    caller:   apply_training_measurements(cluster, per_rank, probe) -> Cluster

Collectives are timed in seconds; every compute probe (items 2-4, 6-9) against the reference mm
(``probes.SpeedReference``), so all of them describe the machine at the profile's one reference speed.

1. Collectives inside a mesh. The isolated probe times each collective with every group of one size busy at
   once, one axis at a time. Training alternates a 2-D mesh's two axes (gradient all-reduces on the batch
   axis between the tensor-parallel ones), and on oversubscribed ranks each collective then waits for ranks
   just busy in the other axis's group (4 gloo ranks on 2 cores: all_reduce/2 of 4 KiB took 2.0 ms alone and
   3.6 ms with the two axes of a 2×2 mesh alternating). Method, per mesh (R, C) of the world with R, C >= 2,
   per collective and message size: every rank loops [collective on its axis-0 group; the same on its axis-1
   group] in timed windows, all ranks at once; the pair's time is split between the axes in proportion to
   their single-axis fits (half each when either is unknown), and each axis gets ``fit_alpha_beta`` of its
   points under "<kind>/<n>@<R>x<C>", which ``cost_models.communication`` prefers on that mesh.
2. op_overhead: host seconds per eager op call. Every rank runs forward + backward of a tiny block (tensors of
   a few hundred bytes, so kernels cost ~nothing) in timed windows; op_overhead = median over ranks of
   t / (2 · call_function nodes of its captured graph), the charge ``cost_models.compute`` makes. On GPUs the
   same window, timed with CUDA events, spans the host's launches (the device idles between its tiny
   kernels), so it measures the host's rate too; the cost model there takes max(kernel, host) per op.
3. Training-shaped matmuls. The curve times square ``mm`` on cache-hot operands; training's linears are
   rectangular, two of their three GEMMs read a transposed operand, and other ops evict the operands between
   calls (the GPT example's linears ran at 0.71× the curve on the development VM). Method: forward + backward
   of ``F.linear`` (three GEMMs) for each of ``TRAINING_SHAPES``; factor = median over shapes of curve-predicted
   GEMM seconds / (measured - 2 · op_overhead) (on GPUs the measured time itself: the launches overlap the
   kernels); the curve of the dtype measured (float32 on CPUs, the half-precision ones on GPUs) is multiplied
   by it, and its peak with it. GPUs time ``GPU_TRAINING_SHAPES``, transformer linears of a GPU's size: the
   CPU shapes scaled up stayed near launch-bound on an H200 and read 0.45 of the square curve.
4. End-to-end compute factor (``autopar.profiling.probe_step``: its formula and why q compares the reference
   with the square-mm curve): forward + backward of ``TinyBlock`` at ``probe_shape``, all ranks at once, priced
   by the cost model on the cluster of items 1-3; compute_time_scale is the factor s that makes the price
   match. ``cost_models.compute`` multiplies every roofline time by it (not the overhead). GPUs measure it and
   record it in the source line but keep 1.0 (``GPU_PROBE``).
5. microbatch_overhead: the pipeline runtime's host time per (chunk, microbatch) and direction, from a real
   pipeline of tiny layers timed at two microbatch counts (``autopar.profiling.profiler_pipeline``; 2+ ranks only).
6. norm_act_bandwidth: forward + backward of LayerNorm, GELU and softmax on one ``NORM_ACT_SHAPE`` tensor
   (tokens × width: fp32 on CPUs, bf16 on GPUs, larger than the caches), bytes as ``cost_models.compute``
   counts them, 3 · (input + output) = 6 · |x|, over the seconds less the host time of their two op calls
   on CPU ranks (on GPUs launches overlap kernels); the median over the three ops of the median over ranks.
7. attention_efficiency: forward + backward of causal ``scaled_dot_product_attention`` (the fused kernel:
   flash on GPUs in bf16, torch's flash kernel for CPUs in fp32) at ``ATTENTION_SHAPES[kind]``; efficiency =
   the cost model's seconds at rate 1 (its FLOPs, halved for the causal mask, at the curve's rate for the
   forward's call size) / the median seconds over ranks, less two op calls' host time on CPU ranks.
8. compiled_time_scale: item 4 again with the probe block under ``torch.compile`` (compiled once, untimed,
   then timed the same way between two reference mms), priced with no host time per op (a compiled graph
   runs fused kernels, not one call per op): s_c = (measured compiled) / (q_c · Σ r_i). Against item 4's s it
   measures what inductor's fusion of pointwise chains and the dropped per-op host calls save on this
   machine; the cost model prices compiled modules with it (``Cluster.compiled_view``). Like item 4, GPUs
   record it in the source line but keep it unapplied (0). A rank whose compile fails makes every rank skip it.
9. optimizer_call_overhead, optimizer_bandwidth: AdamW steps over tiny and over 4 MB tensors, CPU ranks
   only (``autopar.profiling.profiler_optimizer``).
"""
from __future__ import annotations

import dataclasses
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from autopar.hardware.cluster import Cluster
from autopar.profiling.probe_step import (
    TinyBlock,
    end_to_end_factor,
    probe_shape,
    reference_mm_call,
    tiny_block_nodes,
)
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
from autopar.profiling.profiler_optimizer import measure_optimizer, optimizer_figures, optimizer_note
from autopar.profiling.profiler_pipeline import measure_pipeline, microbatch_overhead

# (tokens, in features, out features) of the linears timed for item 3: a spread of transformer-like shapes.
TRAINING_SHAPES = ((256, 256, 1024), (256, 1024, 256), (1024, 256, 768), (1024, 512, 512), (2048, 256, 256))
# GPUs: (tokens, in, out) of a transformer's linears at widths 1-4K, long enough (0.1-1 ms) that launches hide.
GPU_TRAINING_SHAPES = ((8192, 2048, 8192), (8192, 8192, 2048), (4096, 4096, 12288), (16384, 1024, 4096),
                       (8192, 2048, 2048))
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


def _timed(call, settings, probe) -> float:
    """Seconds per ``call`` by the profiler's method: warm-up, then windows with every rank at once."""
    dist.barrier()
    slowest = slowest_rank(warm_up(call, settings.warmup, probe), probe)
    return seconds_per_call(call, calls_per_window(slowest, settings), settings.windows, probe)


def training_dtypes(probe) -> tuple[str, ...]:
    return ("bfloat16", "float16") if probe.kind == "cuda" else ("float32",)


def _linear_step(shape, dtype: torch.dtype, device):
    """Forward + backward of one linear layer (three GEMMs), as a zero-argument call."""
    tokens, d_in, d_out = shape
    x = torch.randn(tokens, d_in, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(d_out, d_in, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(tokens, d_out, device=device, dtype=dtype)
    return lambda: torch.autograd.grad(F.linear(x, w), (x, w), g)


def training_shapes(probe) -> list[tuple[int, int, int]]:
    return list(GPU_TRAINING_SHAPES if probe.kind == "cuda" else TRAINING_SHAPES)


NORM_ACT_SHAPE = {"cpu": (4096, 512, "float32"), "cuda": (16384, 2048, "bfloat16")}  # tokens, width, dtype
NORM_ACT_OPS = ("layernorm", "gelu", "softmax")  # the calls of ``norm_act_calls``, in order


def norm_act_calls(kind: str, device) -> list:
    """Forward + backward of LayerNorm, GELU and softmax on one training-sized tensor (item 6), as calls."""
    tokens, width, dtype = NORM_ACT_SHAPE["cuda" if kind == "cuda" else "cpu"]
    x = torch.randn(tokens, width, device=device, dtype=getattr(torch, dtype), requires_grad=True)
    grad, ops = torch.randn_like(x), (nn.LayerNorm(width).to(device, x.dtype), F.gelu, lambda t: t.softmax(-1))
    wrt = [(x, *op.parameters()) if isinstance(op, nn.Module) else (x,) for op in ops]  # LayerNorm's too
    return [(lambda op=op, w=w: torch.autograd.grad(op(x), w, grad)) for op, w in zip(ops, wrt)]


def norm_act_bytes(kind: str) -> float:
    """Bytes one call of ``norm_act_calls`` moves as the cost model counts them: 3 · (input + output)."""
    tokens, width, dtype = NORM_ACT_SHAPE["cuda" if kind == "cuda" else "cpu"]
    return 6.0 * tokens * width * getattr(torch, dtype).itemsize


def norm_act_bandwidth(per_rank: list[dict], kind: str, overhead: float) -> float:
    """Item 6: median over the ops of bytes / (median seconds over ranks − host time of two op calls)."""
    host, measured = (0.0 if kind == "cuda" else 2 * overhead), [r["norm_act"] for r in per_rank if r.get("norm_act")]
    return statistics.median(norm_act_bytes(kind) / max(statistics.median(m[i] for m in measured) - host, 1e-9)
                             for i in range(len(measured[0]))) if measured else 0.0


# Item 7's attention call per device kind: (batch, heads, sequence, head dim), dtype. GPUs: a GPT-1.3B
# microbatch's, bf16 (the flash kernel). CPUs: a CPU-sized one, fp32 (torch's flash kernel for CPUs); its
# rate moves with the shape (0.25-0.57 of the fp32 curve on the development VM from sequence 128 to 1024),
# so the probe sits among the sequences CPU runs train at.
ATTENTION_SHAPES = {"cuda": ((8, 16, 2048, 128), "bfloat16"), "cpu": ((4, 4, 256, 64), "float32")}


def attention_call(device, kind: str = "cuda"):
    """Forward + backward of causal fused attention at ``ATTENTION_SHAPES[kind]`` (item 7), as a call."""
    shape, dtype = ATTENTION_SHAPES[kind]
    q, k, v, grad = (torch.randn(shape, device=device, dtype=getattr(torch, dtype), requires_grad=i < 3)
                     for i in range(4))
    return lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad)


def attention_flops(kind: str = "cuda") -> tuple[float, float]:
    """(forward, backward) FLOPs of ``attention_call`` as the cost model counts them (flop_counter on meta)."""
    from torch.utils.flop_counter import FlopCounterMode

    shape, dtype = ATTENTION_SHAPES[kind]
    q, k, v = (torch.empty(shape, device="meta", dtype=getattr(torch, dtype), requires_grad=True) for _ in "qkv")
    with FlopCounterMode(display=False) as counter:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        fwd = counter.get_total_flops()
        out.backward(torch.ones_like(out))
    return float(fwd), float(counter.get_total_flops() - fwd)


def attention_efficiency(cluster: Cluster, per_rank: list[dict], kind: str = "cuda", overhead: float = 0.0) -> float:
    """Item 7: the cost model's causal-attention seconds at rate 1 over the measured median, less the host
    time of its two op calls on CPU ranks (the cost model charges those as op_overhead); 0 when not measured
    or the kind's dtype has no curve."""
    measured = [r["attention"] for r in per_rank if r.get("attention")]
    dtype = ATTENTION_SHAPES[kind][1]
    if not measured or dtype not in cluster.matmul_curve:
        return 0.0
    fwd, bwd = attention_flops(kind)
    ideal = 0.5 * (fwd + bwd) / cluster.matmul_flops(dtype, fwd)
    host = 0.0 if kind == "cuda" else 2 * overhead
    return ideal / max(statistics.median(measured) - host, 1e-12)


def measure_rank(settings, probe, reference: SpeedReference) -> dict:
    """This rank's raw measurements: {"mesh": {(mesh, kind): [(m0, m1, s)]}, "pipeline": ``profiler_pipeline.
    measure_pipeline``'s; the compute probes "tiny_step", "probe_step", "probe_reference", "linears": {dtype:
    [...]}, "norm_act", "attention", "probe_compiled" in ``reference`` units (calls timed between reference
    mms, ``probes.SpeedReference``), which ``training_seconds`` turns into seconds; and "spreads": {term:
    (ratio, probe, reference spread, windows)} of the per-op terms (``probes.Timing``), for the source line."""
    out = {"mesh": {}, "tiny_step": None, "linears": {}, "probe_step": None, "probe_reference": None}
    for mesh in meshes_of(dist.get_world_size()):
        groups = _axis_groups(mesh)
        for kind in COLLECTIVES:
            for nbytes in settings.message_bytes:
                (call0, m0), (call1, m1) = (collective_call(kind, nbytes, mesh[a], groups[a], probe.torch)
                                              for a in (0, 1))
                out["mesh"].setdefault((mesh, kind), []).append((m0, m1, _timed(lambda: (call0(), call1()),
                                                                                 settings, probe)))
    device, timings = probe.torch, {}

    def relative(call, term: str | None = None):
        timing = reference.measure(call, settings, settings.probe_window_s)
        if term:
            timings[term] = timing
        return timing.ratio

    block, x = TinyBlock().to(device), torch.randn(4, 8, device=device)
    out["tiny_step"] = relative(lambda: block(x).backward(), "op_overhead")
    shape = probe_shape(probe.kind)
    dtype = getattr(torch, shape.dtype)
    block = TinyBlock(shape.width).to(device, dtype)
    x = torch.randn(shape.tokens, shape.width, device=device, dtype=dtype)
    a, b = (torch.randn(shape.reference_side, shape.reference_side, device=device, dtype=dtype) for _ in range(2))
    out["probe_step"] = relative(lambda: block(x).backward(), "probe step")
    out["probe_reference"] = relative(reference_mm_call(a, b))  # the curve's own call: q compares like with like
    if settings.compiled_probe:
        out["probe_compiled"] = _compiled_probe_step(block, x, relative)
    for name in training_dtypes(probe):
        dtype = getattr(torch, name)
        out["linears"][name] = [relative(_linear_step(s, dtype, probe.torch)) for s in training_shapes(probe)]
    out["norm_act"] = [relative(call, op) for call, op in zip(norm_act_calls(probe.kind, device), NORM_ACT_OPS)]
    out["attention"] = relative(attention_call(device, probe.kind))
    out["optimizer"] = measure_optimizer(relative, probe.kind)
    out["pipeline"] = measure_pipeline(settings, probe, reference)
    for m, timing in (out["pipeline"] or {}).pop("timings", {}).items():
        timings[f"pipeline M={m}"] = timing
    out["spreads"] = {term: (t.ratio_spread, t.probe_spread, t.reference_spread, t.windows)
                      for term, t in timings.items()}
    return out


def training_seconds(out: dict, level: float) -> dict:
    """``measure_rank``'s output with its compute probes turned from reference units into seconds (× level,
    the seconds of one reference call at the profile's median speed), the pipeline's CPU too where it was
    timed against the reference."""
    out = dict(out, linears={name: [r * level for r in ratios] for name, ratios in out["linears"].items()})
    for key in ("tiny_step", "probe_step", "probe_reference", "attention"):
        if out.get(key) is not None:
            out[key] *= level
    for key in ("norm_act", "optimizer"):
        if out.get(key):
            out[key] = [r * level for r in out[key]]
    if out.get("probe_compiled"):
        out["probe_compiled"] = tuple(r * level for r in out["probe_compiled"])
    pipeline = out.get("pipeline")
    if pipeline and pipeline.get("units") == "reference":
        out["pipeline"] = dict(pipeline, units="seconds", cpu={m: r * level for m, r in pipeline["cpu"].items()})
    return out


def spread_note(per_rank: list[dict]) -> str:
    """The per-op terms' spreads (``probes.Timing``; the largest over ranks already) for the source line."""
    spreads = per_rank[0].get("spreads")
    if not spreads:
        return ""
    terms = ", ".join(f"{term} {r * 100:.0f}/{p * 100:.0f}/{ref * 100:.0f} % ({n} windows)"
                      for term, (r, p, ref, n) in spreads.items())
    return ("spread (IQR / median over windows, largest over ranks) of the ratio to the reference / the probe's "
            f"own time / the reference beside it: {terms}")


def _compiled_probe_step(block, x, relative) -> tuple[float, float] | None:
    """Item 8: (the compiled probe step, the reference mm) in reference units; None on every rank when any
    rank could not compile it (they all skip the timing, so no rank waits at a barrier alone)."""
    compiled = torch.compile(block, dynamic=False)
    try:
        compiled(x).backward()  # compiles forward and backward, outside the timing
        ok = torch.ones((), device=x.device)
    except Exception:  # noqa: BLE001 - no compiler here: the factor stays unmeasured
        ok = torch.zeros((), device=x.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        return None
    return relative(lambda: compiled(x).backward()), 1.0


# ---- in the caller --------------------------------------------------------------------------------
def training_matmul_factor(cluster: Cluster, dtype_name: str, shapes, seconds, overhead: float) -> float:
    """Median over ``shapes`` of curve-predicted GEMM seconds (3 GEMMs of 2·t·i·o FLOPs) / measured kernel
    seconds (the measured step less its 2 op calls' overhead on CPUs; on GPUs the measured step itself)."""
    from autopar.cost_models.compute import host_overlaps_kernels

    host = 0.0 if host_overlaps_kernels(cluster) else 2 * overhead
    factors = []
    for (tokens, d_in, d_out), measured in zip(shapes, seconds):
        flops = 2.0 * tokens * d_in * d_out
        predicted = 3 * flops / cluster.matmul_flops(dtype_name, flops)
        factors.append(predicted / max(measured - host, 1e-9))
    return statistics.median(factors)


def _share(alone, axis: int, m0: float, m1: float) -> float:
    """Axis ``axis``'s part of a pair's time: its single-axis fit over both (half when either is unknown)."""
    if alone[0] is None or alone[1] is None:
        return 0.5
    t0, t1 = alone[0].time(m0), alone[1].time(m1)
    return (t0 if axis == 0 else t1) / (t0 + t1)


def in_mesh_fits(cluster: Cluster, per_rank: list[dict]) -> dict:
    """The intra-node fits plus "<kind>/<n>@<R>x<C>" ones from the alternating-axes measurement (item 1)."""
    fits = dict(cluster.intra_node.fits)
    for key, points in per_rank[0]["mesh"].items():
        mesh, kind = key
        times = [statistics.median(r["mesh"][key][i][2] for r in per_rank) for i in range(len(points))]
        alone = [cluster.intra_node.fits.get(f"{kind}/{mesh[a]}") for a in (0, 1)]
        for axis in (0, 1):
            parts = [_share(alone, axis, m0, m1) * t for (m0, m1, _), t in zip(points, times)]
            fits[f"{kind}/{mesh[axis]}@{mesh[0]}x{mesh[1]}"] = fit_alpha_beta([p[axis] for p in points], parts)
    return fits


def apply_training_measurements(cluster: Cluster, per_rank: list[dict], probe) -> tuple[Cluster, str]:
    """``cluster`` with in-mesh fits, op_overhead and training-scaled matmul curves; and a note for its source."""
    link = dataclasses.replace(cluster.intra_node, fits=in_mesh_fits(cluster, per_rank))
    tiny = [r["tiny_step"] for r in per_rank if r["tiny_step"] is not None]
    overhead = statistics.median(tiny) / (2 * tiny_block_nodes()) if tiny else 0.0
    curve, peak, notes = dict(cluster.matmul_curve), dict(cluster.peak_flops), []
    for name in per_rank[0]["linears"]:
        if name not in curve:
            continue
        seconds = [statistics.median(r["linears"][name][i] for r in per_rank)
                   for i in range(len(per_rank[0]["linears"][name]))]
        factor = training_matmul_factor(cluster, name, training_shapes(probe), seconds, overhead)
        curve[name] = [[flops, rate * factor] for flops, rate in curve[name]]
        peak[name] = max(rate for _, rate in curve[name])
        notes.append(f"{name} curve × {factor:.2f} for training-shaped matmuls")
    norm_act = norm_act_bandwidth(per_rank, probe.kind, overhead)
    if norm_act:
        notes.append(f"norm/activation ops at {norm_act / 1e9:.1f} GB/s")
    attention = attention_efficiency(dataclasses.replace(cluster, matmul_curve=curve, peak_flops=peak), per_rank,
                                     probe.kind, overhead)
    if attention:
        notes.append(f"fused attention at {attention:.2f} of the matmul rate")
    per_call, optimizer_rate = optimizer_figures(per_rank)
    notes.append(optimizer_note(per_call, optimizer_rate))
    out = dataclasses.replace(cluster, intra_node=link, inter_node=link if cluster.nodes == 1 else cluster.inter_node,
                              op_overhead=overhead, matmul_curve=curve, peak_flops=peak, norm_act_bandwidth=norm_act,
                              attention_efficiency=attention, optimizer_call_overhead=per_call,
                              optimizer_bandwidth=optimizer_rate)
    probes = [(r["probe_step"], r["probe_reference"]) for r in per_rank if r.get("probe_step") is not None]
    if probes:
        scale = end_to_end_factor(out, statistics.median(p for p, _ in probes),
                                  statistics.median(q for _, q in probes), square=cluster)
        if probe.kind == "cuda":
            notes.append(f"probe step factor {scale:.2f} measured, not applied (GPU_PROBE's docstring)")
        else:
            out = dataclasses.replace(out, compute_time_scale=scale)
            notes.append(f"compute_time_scale {scale:.2f} from a probe training step")
    out = _apply_compiled_factor(out, per_rank, probe, notes, square=cluster)
    host, note = microbatch_overhead(out, per_rank)
    out = dataclasses.replace(out, microbatch_overhead=host)
    notes.append(note)
    notes.append(spread_note(per_rank))
    note = (f"in-mesh collective fits; op_overhead {overhead * 1e6:.1f} µs; "
            + ("; ".join(n for n in notes if n) or "no curve scaled"))
    return out, note


def _apply_compiled_factor(cluster: Cluster, per_rank: list[dict], probe, notes: list[str],
                           square: Cluster | None = None) -> Cluster:
    """Item 8: ``cluster`` with ``compiled_time_scale`` (CPU ranks; GPUs note it only), when it was measured;
    square: the isolated cluster the reference mm is compared with (``end_to_end_factor``)."""
    timed = [r["probe_compiled"] for r in per_rank if r.get("probe_compiled")]
    if not timed:
        return cluster
    scale = end_to_end_factor(cluster, statistics.median(s for s, _ in timed), statistics.median(q for _, q in timed),
                              compiled=True, square=square)
    if probe.kind == "cuda":
        notes.append(f"compiled probe step factor {scale:.2f} measured, not applied")
        return cluster
    notes.append(f"compiled_time_scale {scale:.2f} from the probe step under torch.compile")
    return dataclasses.replace(cluster, compiled_time_scale=scale)
