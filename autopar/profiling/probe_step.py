"""Item 4 (and 8) of the profiler's training conditions: the end-to-end compute factor from a probe step.

A training step pays what no single probe of ``profiler_training`` sees (elementwise ops on tensors larger
than the caches, the allocator, autograd's accumulation, unfused epilogues). Every rank runs forward +
backward of ``TinyBlock(width)`` on ``tokens`` tokens (``probe_shape``: 192 wide, 384 tokens, fp32 on CPUs;
2048 wide, 4096 tokens, bf16 on GPUs), all ranks at once, timed against the reference mm like every compute
probe (``probes.SpeedReference``); the cost model prices the same captured graph (``probe_step_ops``: per
op, roofline seconds r_i and host seconds o_i), and with q = the reference mm's seconds / those the
square-mm curve as measured gives it (≈ 1: both at the profile's reference speed; the same call as the
curve's, into a preallocated output: ``reference_mm_call``),

    measured = Σ_i combine(s · q · r_i, o_i)      (combine: + on CPU ranks, max on GPUs; ``with_host_time``)

gives compute_time_scale s: (measured − Σ o_i) / (q · Σ r_i) on CPUs, by bisection on GPUs. Under
``torch.compile`` (item 8) every o_i is 0. q is taken against the curve *before* the training-matmul factor
scales it: a square mm compared with the scaled curve reads the factor as a slower machine, and s then
divides every roofline time by the factor a second time.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.hardware.cluster import Cluster

PROBE_WIDTH, PROBE_TOKENS = 192, 384  # item 4 on CPUs: a transformer block large enough that its kernels dominate
REFERENCE_SIDE = 256  # item 4 on CPUs: the square mm timed beside the probe step


@dataclasses.dataclass(frozen=True)
class ProbeShape:
    """Item 4's probe block (width, tokens, dtype) and the reference mm (side, same dtype) for a device kind."""

    width: int
    tokens: int
    dtype: str
    reference_side: int


CPU_PROBE = ProbeShape(PROBE_WIDTH, PROBE_TOKENS, "float32", REFERENCE_SIDE)
# On GPUs the factor is measured and recorded in the cluster's source, not applied: on an H200 it read 0.82
# and made one-GPU GPT/Llama predictions worse (median error 31 % against 19 % at 1.0, same ranking),
# because the probe's materialized attention is priced pessimistically where the models run flash SDPA.
GPU_PROBE = ProbeShape(2048, 4096, "bfloat16", 4096)


def probe_shape(device_type: str) -> ProbeShape:
    return GPU_PROBE if device_type == "cuda" else CPU_PROBE


class TinyBlock(nn.Module):
    """A pre-norm transformer block of width 8 on 4 tokens: the op mix of a GPT, with kernels ~free."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.ln, self.qkv, self.out, self.fc = (nn.LayerNorm(width), nn.Linear(width, 3 * width),
                                                nn.Linear(width, width), nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        x = x + self.out((q @ k.transpose(-2, -1)).softmax(-1) @ v)
        return (x + self.fc(F.gelu(x))).sum()


def reference_mm_call(a: torch.Tensor, b: torch.Tensor):
    """Item 4's reference mm as the square-mm curve and ``probes.SpeedReference`` time it: ``torch.mm`` into
    one output allocated here, once. q compares this call's seconds with the curve's, so both sides must be
    the same call: an allocating ``torch.mm(a, b)`` adds the allocator's time per call (1-2 % at fp32 256³ on
    one CPU thread) to q, which divides it out of compute_time_scale although the probe step's own
    allocations are already in its measured time (profiles then priced compute that much too fast)."""
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    return lambda: torch.mm(a, b, out=out)


def tiny_block_nodes() -> int:
    """call_function nodes of ``TinyBlock``'s captured graph: the op calls one forward makes."""
    from autopar.passes.capture import capture

    return sum(n.op == "call_function" for n in capture(TinyBlock(), (torch.randn(4, 8),)).gm.graph.nodes)


def probe_step_ops(cluster: Cluster, shape: ProbeShape | None = None) -> list[tuple[float, float]]:
    """(roofline seconds r_i, host seconds o_i) per op of forward + backward of ``TinyBlock(shape.width)`` on
    ``shape.tokens`` tokens in ``shape.dtype`` (default: the cluster's device's ``probe_shape``) on one
    device of ``cluster``, at compute_time_scale 1."""
    from autopar.cost_models.compute import compute_time, op_overhead_time
    from autopar.ir.ops import OpView, requires_grad_nodes
    from autopar.passes.capture import capture
    from autopar.placement import R

    shape = shape or probe_shape(cluster.device_type)
    dtype = getattr(torch, shape.dtype)
    graph = capture(TinyBlock(shape.width).to(dtype), (torch.randn(shape.tokens, shape.width, dtype=dtype),))
    needs = requires_grad_nodes(graph.gm, {p.name for p in graph.placeholders if p.kind == "parameter"})
    # roofline alone: no overhead in compute_time, which then returns the device seconds whatever the device
    bare = dataclasses.replace(cluster, compute_time_scale=1.0, op_overhead=0.0)
    ops = []
    for node in graph.gm.graph.nodes:
        if node.op != "call_function":
            continue
        view, grad = OpView(node), node.name in needs
        whole = _Whole(tuple((R,) * len(getattr(v, "shape", ())) for v in view.in_vals), (R,) * 2)
        ops.append((compute_time(node, whole, view.in_vals, view.out_vals, (1, 1), bare, grad),
                    op_overhead_time(cluster, grad)))
    return ops


def probe_step_prediction(cluster: Cluster, width: int = PROBE_WIDTH, tokens: int = PROBE_TOKENS):
    """(roofline seconds, overhead seconds) summed over ``probe_step_ops`` for an fp32 probe of this size."""
    ops = probe_step_ops(cluster, ProbeShape(width, tokens, "float32", REFERENCE_SIDE))
    return sum(r for r, _ in ops), sum(o for _, o in ops)


@dataclasses.dataclass(frozen=True)
class _Whole:
    """A strategy that keeps every tensor whole on one device (what ``compute_time`` reads of a Strategy)."""

    in_specs: tuple
    out_spec: tuple
    work_fraction: float = 1.0


def end_to_end_factor(cluster: Cluster, measured: float, reference: float | None = None,
                      shape: ProbeShape | None = None, compiled: bool = False, square: Cluster | None = None) -> float:
    """compute_time_scale of item 4: the s with measured = Σ combine(s·q·r_i, o_i), q = the reference mm's
    measured seconds over the seconds ``square``'s curve gives it (1 when ``reference`` is None); shape: the
    probe (default: the cluster's device's ``probe_shape``). ``compiled``: item 8's s_c, every o_i taken as 0.

    square: the cluster whose curve holds the square-mm rates as measured (default ``cluster``). The profiler
    passes its isolated cluster: ``cluster``'s curve is scaled by the training-matmul factor (item 3), and a
    square mm compared with that curve would read the factor as a slowdown of the machine and divide every
    roofline time by it a second time (profiles predicted 1/factor, 1.2-1.5×, too slow)."""
    from autopar.cost_models.compute import host_overlaps_kernels, with_host_time

    shape = shape or probe_shape(cluster.device_type)
    ops = probe_step_ops(cluster, shape)
    if compiled:
        ops = [(r, 0.0) for r, _ in ops]
    q = 1.0
    if reference is not None:
        flops = 2.0 * shape.reference_side**3
        q = reference / (flops / (square or cluster).matmul_flops(shape.dtype, flops))
    roofline, overhead = sum(r for r, _ in ops) * q, sum(o for _, o in ops)
    if compiled or not host_overlaps_kernels(cluster):
        return max(measured - overhead, 1e-9) / max(roofline, 1e-12)
    low, high = 1e-3, 1e3  # predicted(s) grows with s: bisection in log space
    for _ in range(60):
        mid = math.sqrt(low * high)
        predicted = sum(with_host_time(mid * q * r, o, cluster) for r, o in ops)
        low, high = (mid, high) if predicted < measured else (low, mid)
    return math.sqrt(low * high)
