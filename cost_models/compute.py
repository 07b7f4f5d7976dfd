"""Compute cost of one op under one strategy: FLOPs and bytes -> seconds by a roofline, plus host overhead.

    d(node, strategy) = max( flops · work_fraction / F ,  bytes_local / B )        (device seconds)
    o(node)           = calls · op_overhead                                    (host seconds)
    t = d + o on CPU ranks,  t = max(d, o) on GPUs                             (``with_host_time``)
                        (forward + backward; calls = 1, or 2 when the op is differentiable)

F = cluster.matmul_flops(dtype, flops of one call): the measured rate at this call's size when the
cluster has a matmul curve (one call = the forward's local FLOPs; a matmul's backward is two calls of
that size), else peak × efficiency. B is the cluster's memory bandwidth. FLOPs come from
``torch.utils.flop_counter`` run on ``meta`` tensors of the node's global shapes (forward, then
backward when any float input needs a gradient); ops it does not count (elementwise, norms) have
0 FLOPs and are priced by bytes. bytes_local = (inputs + outputs, local shapes) × (1 forward +
2 backward when differentiable): backward reads the output gradient and the saved inputs and writes
input gradients. Pure views, and ops whose output aliases an input (``contiguous`` of a contiguous tensor,
dropout with p = 0: found by the fake-tensor probe of ``cost_models.saved_tensors``), move no data.

B is the cluster's *achieved* memory bandwidth (presets: peak × the fraction a streaming kernel reaches,
cited there), so non-matmul ops are priced by the bandwidth they really get. Normalizations, activations
and softmaxes (``NORM_ACT_OPS``) reach much less than a streaming kernel (row reductions, transcendentals,
several kernels per op): where the cluster measured their rate (``Cluster.norm_act_bandwidth``, profiled),
B is that rate for them (``memory_bound_bandwidth``). Every roofline time is then
multiplied by ``Cluster.compute_time_scale``, the preset's calibrated end-to-end factor (on a profiled CPU
cluster, the profiler's measured one).

Attention is priced by the kernel the model really runs (``attention_kernel``): an explicit
``aten._scaled_dot_product_{flash,efficient,cudnn}_attention`` node names its fused kernel, and the composite
``aten.scaled_dot_product_attention`` gets the one torch's dispatcher would pick on the cluster's devices
(GPUs with bf16 tensor cores, sm80+: flash for fp16/bf16 without a mask and head dim <= 256 and divisible
by 8; otherwise memory-efficient; CPU clusters: torch's flash kernel for CPUs at the profiled
``attention_efficiency``, the plain roofline where the cluster has none).

    fused (flash, efficient):  t = flops · causal / (F · rate[kernel]) vs bytes of q, k, v, out
                               rate = ATTENTION_RATE, or for flash the cluster's measured
                               ``attention_efficiency`` where it has one (``attention_rate``)
                               causal = 1/2 with is_causal (the kernels skip the masked tiles), else 1
    math (scores materialized): t = flops / F + b·h·s_q·s_k · itemsize · SCORE_PASSES / B

A model that writes attention as separate ops (matmul, softmax, matmul) is priced op by op, the score
matrix's bytes included, which is the materialized kernel by construction.

op_overhead (``Cluster.op_overhead``, 0 unless measured) is the host time of one eager op call: Python,
dispatcher, autograd bookkeeping, kernel launch. Every call_function node pays it once in forward and once
more in backward when it is differentiable, views included (each is an ATen call and an autograd node). A
CPU rank runs the kernel on the thread that issued it, so the two add; a GPU queues kernels asynchronously
and the host issues the next op while the device runs this one, so an op costs the slower of the two: a
large matmul hides its launch, and a model of small kernels runs at the host's pace (a GPT of width 512
on an H200 stepped in 22.5 ms where its kernels alone take 8).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from autopar.cost_models.experts import MOE_OP, moe_flops
from autopar.cost_models.optimizer_calls import ZERO_GRAD_CALLS_PER_TENSOR, optimizer_calls_per_tensor
from autopar.ir.ops import is_free_view, node_signature
from autopar.placement import local_shape

aten = torch.ops.aten

def _meta_like(val: Any, requires_grad: bool) -> Any:
    if isinstance(val, torch.Tensor):
        t = torch.empty(val.shape, dtype=val.dtype, device="meta")
        if requires_grad and val.dtype.is_floating_point:
            t.requires_grad_(True)
        return t
    return val


def node_flops(node: fx.Node) -> tuple[float, float]:
    """(forward FLOPs, backward FLOPs) of a call_function node at its global shapes."""
    if node.op != "call_function" or is_free_view(node):
        return 0.0, 0.0
    return _flops_cached(node_signature(node), node)


_FLOPS: dict[str, tuple[float, float]] = {}  # signature -> (fwd, bwd); ops repeat across identical layers


def _flops_cached(signature: str, node: fx.Node) -> tuple[float, float]:
    if signature not in _FLOPS:
        _FLOPS[signature] = _measure_flops(node)
    return _FLOPS[signature]


def _grouped_mm_flops(node: fx.Node) -> tuple[float, float]:
    """x [S, K] @ grouped w [E, K, N]: every row meets exactly one expert, so 2·S·K·N forward, twice that
    backward (input and weight gradients). flop_counter does not see inside the custom op's loop of mm, and
    counts ``aten._grouped_mm`` as zero."""
    (s, k), n = node.args[0].meta["val"].shape, node.args[1].meta["val"].shape[2]
    return 2.0 * s * k * n, 4.0 * s * k * n


# Ops by qualified name whose FLOPs flop_counter misses (a custom op registered only once its library is
# imported; aten._grouped_mm, which it counts as zero; autopar's MoE experts op, whose fake kernel it
# sees): FLOPs by formula.
NAMED_FLOPS = {"transformers.grouped_mm_fallback.default": _grouped_mm_flops,
               "aten._grouped_mm.default": _grouped_mm_flops, MOE_OP: moe_flops}


def _measure_flops(node: fx.Node) -> tuple[float, float]:
    if str(node.target) in NAMED_FLOPS:
        return NAMED_FLOPS[str(node.target)](node)
    if not hasattr(node.target, "_schema"):
        return 0.0, 0.0
    args, kwargs = pytree.tree_map(
        lambda a: _meta_like(a.meta.get("val"), True) if isinstance(a, fx.Node) else a, (node.args, node.kwargs))
    try:
        with FlopCounterMode(display=False) as counter:
            out = node.target(*args, **kwargs)
            fwd = counter.get_total_flops()
            outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            total = counter.get_total_flops()
    except Exception:  # an op meta cannot run (data-dependent output shape): price it by bytes only
        return 0.0, 0.0
    return float(fwd), float(total - fwd)


def tensor_bytes(val: Any) -> int:
    return math.prod(val.shape) * val.element_size() if isinstance(val, torch.Tensor) else 0


def local_bytes(val: Any, spec, mesh_shape) -> float:
    if not isinstance(val, torch.Tensor):
        return 0.0
    return math.prod(local_shape(tuple(val.shape), spec, mesh_shape)) * val.element_size()


def host_overlaps_kernels(cluster) -> bool:
    """Whether the host issues ops while the device runs earlier ones (GPUs), rather than running each
    kernel on the issuing thread (CPU ranks)."""
    return getattr(cluster, "device_type", "cpu") == "cuda"


def with_host_time(device_seconds: float, host_seconds: float, cluster) -> float:
    """One op's seconds from its kernel time and its host time: the sum on CPU ranks, the larger on GPUs."""
    if host_overlaps_kernels(cluster):
        return max(device_seconds, host_seconds)
    return device_seconds + host_seconds


def cast_time(casts, in_vals: list, in_specs, mesh_shape, cluster, differentiable: bool) -> float:
    """Seconds of autocast's copies of one op's inputs under a precision policy. ``casts``: (input position,
    copy bytes / input bytes) per copied input (``cost_models.memory.cast_inputs``: a bf16 copy of an fp32
    activation or weight read by a matmul, 0.5; the fp32 copy of bf16 logits for cross-entropy, 2). Each copy
    is one more kernel and one more op call, and so is its gradient's copy back in backward:

        t = Σ_casts with_host_time(scale · passes · b · (1 + ratio) / B,  passes · op_overhead)
            b = the input's local bytes; passes = 2 when the op is differentiable, else 1
    """
    passes = 2 if differentiable else 1
    scale = getattr(cluster, "compute_time_scale", 1.0)
    total = 0.0
    for pos, ratio in casts:
        moved = passes * local_bytes(in_vals[pos], in_specs[pos], mesh_shape) * (1.0 + ratio)
        total += with_host_time(scale * moved / cluster.memory_bandwidth,
                                passes * getattr(cluster, "op_overhead", 0.0), cluster)
    return total


def op_overhead_time(cluster, differentiable: bool) -> float:
    """Host seconds of one node's op calls: op_overhead × (1 forward + 1 backward when differentiable)."""
    return getattr(cluster, "op_overhead", 0.0) * (2 if differentiable else 1)


# Fused attention's achieved rate relative to a large GEMM's on the same GPU. FlashAttention-2 (Dao 2023,
# §4.1, A100): forward up to 73 % and backward up to 63 % of peak, against ~86 % for the best bf16 GEMM
# (stas00/ml-engineering MAMF table: 267.9 of 312 TFLOPS), i.e. ~0.75 of the GEMM rate over fwd+bwd.
# The memory-efficient kernel (xformers-style, FlashAttention-1 level) reaches "only 25-40 % of the
# theoretical maximum FLOPs/s" (Dao 2023, abstract, of FlashAttention-1 on A100): the range's midpoint,
# 32.5 % of peak, over the same GEMM's 85.9 % is 0.38 of the GEMM rate (it was priced at 0.5, above the range).
ATTENTION_RATE = {"flash": 0.75, "efficient": 0.325 / 0.859}
# Passes over the score matrix of a materialized attention, forward + backward: S = QK^T written (1),
# softmax reads S and writes P (2), PV reads P (1); backward writes dP (1), softmax backward reads P and dP
# and writes dS (3), and dQ, dK, dV read dS, dS, P (3).
SCORE_PASSES = 11
SCORE_PASSES_FORWARD = 4
_FUSED_TARGETS = {"_scaled_dot_product_flash_attention": "flash", "_scaled_dot_product_cudnn_attention": "flash",
                  "_scaled_dot_product_flash_attention_for_cpu": "flash",
                  "_scaled_dot_product_efficient_attention": "efficient",
                  "_scaled_dot_product_attention_math": "math"}


def attention_rate(kernel: str, cluster) -> float:
    """Fused attention's rate as a fraction of the matmul curve's: the cluster's measured one for flash
    (``Cluster.attention_efficiency``), else ``ATTENTION_RATE``."""
    measured = getattr(cluster, "attention_efficiency", 0.0)
    return measured if measured and kernel == "flash" else ATTENTION_RATE[kernel]


def attention_kernel(node: fx.Node, cluster) -> str | None:
    """"flash", "efficient" or "math" for an attention node on ``cluster`` (module docstring), None for any
    other node and for the composite op on CPU clusters that measured no ``attention_efficiency``."""
    name = getattr(getattr(node.target, "overloadpacket", None), "__name__", "")
    if name in _FUSED_TARGETS:
        return _FUSED_TARGETS[name]
    if name != "scaled_dot_product_attention":
        return None
    if getattr(cluster, "device_type", "cpu") != "cuda":  # torch's CPU dispatch: its flash kernel, if measured
        return "flash" if getattr(cluster, "attention_efficiency", 0.0) else None
    q = node.args[0].meta.get("val")
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    head_dim = q.shape[-1]
    flash_ok = ("bfloat16" in cluster.peak_flops and q.dtype in (torch.float16, torch.bfloat16)
                and mask is None and head_dim <= 256 and head_dim % 8 == 0)
    if flash_ok:
        return "flash"
    return "efficient" if head_dim % 8 == 0 else "math"


def attention_time(node: fx.Node, kernel: str, flops: float, io_bytes: float, strategy, cluster,
                   differentiable: bool) -> float:
    """Seconds of one attention node's forward (+ backward) under ``kernel`` (module docstring); ``flops`` and
    ``io_bytes`` are the local ones, the score matrix is scaled to the local share by the work fraction."""
    q = node.args[0].meta.get("val")
    k = node.args[1].meta.get("val")
    name = str(q.dtype).replace("torch.", "")
    rate = cluster.matmul_flops(name, node_flops(node)[0] * strategy.work_fraction)
    if kernel == "math":
        scores = math.prod(q.shape[:-1]) * k.shape[-2] * q.element_size() * strategy.work_fraction
        passes = SCORE_PASSES if differentiable else SCORE_PASSES_FORWARD
        return flops / rate + scores * passes / cluster.memory_bandwidth
    causal = 0.5 if (node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)) else 1.0
    return max(flops * causal / (rate * attention_rate(kernel, cluster)), io_bytes / cluster.memory_bandwidth)


# Ops (ATen overload packets) priced at ``Cluster.norm_act_bandwidth`` where the cluster has one: norms,
# activations with transcendentals, softmaxes and the losses built on them.
NORM_ACT_OPS = frozenset({
    "layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm", "native_group_norm",
    "batch_norm", "_native_batch_norm_legit_functional", "gelu", "silu", "tanh", "sigmoid", "softmax", "_softmax",
    "log_softmax", "_log_softmax", "cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss_nd"})


def memory_bound_bandwidth(node: fx.Node, cluster) -> float:
    """Bytes/s a memory-bound op of ``node``'s kind achieves: ``norm_act_bandwidth`` for ``NORM_ACT_OPS``
    where the cluster measured it, else ``memory_bandwidth``."""
    measured = getattr(cluster, "norm_act_bandwidth", 0.0)
    if measured and getattr(getattr(node.target, "overloadpacket", None), "__name__", "") in NORM_ACT_OPS:
        return measured
    return cluster.memory_bandwidth


_MOVES_NO_DATA = "autopar_moves_no_data"  # node.meta key: (what the answer was computed from, the answer)


def moves_no_data(node: fx.Node) -> bool:
    """A view, or an op whose output shares an input's storage (measured on fake tensors, cached).

    Kept in ``node.meta`` while the node's target, arguments and values (its own and its inputs') are the
    very same objects (compared by identity): the saved-tensor rule's own cache key flattens the arguments
    and hashes the op's signature, and intra-op pricing asks once per signature, strategy and mesh."""
    if is_free_view(node):
        return True
    stamp = (node.target, node.args, node.kwargs, node.meta.get("val"),
             *(a.meta.get("val") for a in node.all_input_nodes))
    hit = node.meta.get(_MOVES_NO_DATA)
    if hit is not None and len(hit[0]) == len(stamp) and all(x is y for x, y in zip(hit[0], stamp)):
        return hit[1]
    from autopar.cost_models.saved_tensors import saved_rule  # saved_tensors imports this module

    answer = saved_rule(node, set()).alias_of is not None
    node.meta[_MOVES_NO_DATA] = (stamp, answer)
    return answer


def compute_time(node: fx.Node, strategy, in_vals: list, out_vals: list, mesh_shape, cluster,
                 differentiable: bool) -> float:
    """Seconds for forward (+ backward when ``differentiable``) of ``node`` under ``strategy``: the
    roofline of its local FLOPs and bytes with ``op_overhead_time`` (``with_host_time``; module docstring)."""
    if node.op != "call_function":
        return 0.0
    overhead = op_overhead_time(cluster, differentiable)
    if moves_no_data(node):
        return overhead
    fwd_flops, bwd_flops = node_flops(node)
    flops = (fwd_flops + (bwd_flops if differentiable else 0.0)) * strategy.work_fraction
    moved = sum(local_bytes(v, s, mesh_shape) for v, s in zip(in_vals, strategy.in_specs))
    moved += sum(local_bytes(v, strategy.out_spec, mesh_shape) for v in out_vals)
    moved *= 3.0 if differentiable else 1.0
    scale = getattr(cluster, "compute_time_scale", 1.0)
    kernel = attention_kernel(node, cluster)
    if kernel is not None:
        seconds = attention_time(node, kernel, flops, moved, strategy, cluster, differentiable)
        return with_host_time(scale * seconds, overhead, cluster)
    # The output's dtype is the one the op computes in: under autocast a linear reads fp32 tensors and
    # computes (and returns) bf16; without autocast inputs and output agree.
    floating = [v for v in out_vals + in_vals if isinstance(v, torch.Tensor) and v.dtype.is_floating_point]
    dtype = floating[0].dtype if floating else torch.float32
    name = str(dtype).replace("torch.", "")
    rate = cluster.matmul_flops(name, fwd_flops * strategy.work_fraction)
    bandwidth = memory_bound_bandwidth(node, cluster)
    return with_host_time(scale * max(flops / rate, moved / bandwidth), overhead, cluster)


# Bytes each optimizer step moves per parameter element, in units of the parameter's itemsize:
# adamw/adam read p, g, exp_avg, exp_avg_sq and write p, exp_avg, exp_avg_sq (7); sgd with momentum
# reads p, g, buf and writes p, buf (5); plain sgd reads p, g and writes p (3).
OPTIMIZER_TRAFFIC = {"adamw": 7, "adam": 7, "sgd_momentum": 5, "sgd": 3}


def optimizer_host_calls(optimizer: str) -> int:
    """Op calls per parameter tensor of one step and zero_grad on CPU ranks, counted from torch's optimizer
    (``cost_models.optimizer_calls``: AdamW 10 + 1 on torch 2.13)."""
    return optimizer_calls_per_tensor(optimizer) + ZERO_GRAD_CALLS_PER_TENSOR


def stepped_numel(shape, spec, mesh_shape, zero_level: int) -> float:
    """Elements of one parameter that a rank's optimizer step updates: its local shard stored as ``spec``,
    divided by n = ∏ sizes of the mesh axes ``spec`` replicates it on where ZeRO (level >= 1) shards the
    step n ways."""
    numel = float(math.prod(local_shape(tuple(shape), spec, tuple(mesh_shape))))
    if zero_level >= 1:
        numel /= math.prod(size for size, p in zip(mesh_shape, spec) if not p.is_shard())
    return numel


def optimizer_step_time(numel: float, n_tensors: int, itemsize: int, optimizer: str, cluster) -> float:
    """Seconds of one ``optimizer.step()`` and ``zero_grad()`` over ``n_tensors`` local parameter tensors of
    ``numel`` elements:

        t = numel · itemsize · OPTIMIZER_TRAFFIC[optimizer] / optimizer_bandwidth(cluster)
            + n_tensors · optimizer_host_calls(optimizer) · optimizer_call_seconds(cluster)   (CPU ranks only)

    On CPU ranks torch steps one tensor at a time, so each tensor pays the ATen calls of the optimizer's
    per-tensor update (counted, ``cost_models.optimizer_calls``) and zero_grad's per-tensor host work; the
    profile measures both the host time per such call and the rate of the per-element passes
    (``autopar.profiling.profiler_optimizer``). On GPUs the foreach kernels take many tensors per launch, so
    the per-tensor host charge is left out.

    Part of a plan's predicted step time (``plan_builder.predict``) and, per parameter at its local shard and
    ZeRO level, of the intra-op ILP's objective (``passes.intra_op_zero.price_optimizer_step``).
    """
    traffic = numel * itemsize * OPTIMIZER_TRAFFIC[optimizer] / optimizer_bandwidth(cluster)
    return traffic + optimizer_host_seconds(n_tensors, optimizer, cluster)


def optimizer_host_seconds(n_tensors: int, optimizer: str, cluster) -> float:
    """Host seconds of one step and zero_grad over ``n_tensors`` tensors stepped one at a time: their counted
    calls at ``optimizer_call_seconds`` on CPU ranks; 0 on GPUs (foreach kernels, host hidden)."""
    if host_overlaps_kernels(cluster):
        return 0.0
    return n_tensors * optimizer_host_calls(optimizer) * optimizer_call_seconds(cluster)


def optimizer_bandwidth(cluster) -> float:
    """Bytes per second of an optimizer step's element passes as OPTIMIZER_TRAFFIC counts them: the profile's
    measured ``Cluster.optimizer_bandwidth`` (CPU ranks), else the streaming ``memory_bandwidth``."""
    return getattr(cluster, "optimizer_bandwidth", 0.0) or cluster.memory_bandwidth


def optimizer_call_seconds(cluster) -> float:
    """Host seconds per ATen call of an optimizer step: the profile's measured ``Cluster.optimizer_call_overhead``
    (CPU ranks), else a graph op's ``op_overhead``."""
    return getattr(cluster, "optimizer_call_overhead", 0.0) or getattr(cluster, "op_overhead", 0.0)
