"""Precision policy: which dtype each op computes in, which dtype gradients are reduced in, loss scaling.

Conventions users know, as in FSDP2's ``MixedPrecisionPolicy`` and ``torch.amp``:
  * parameters, gradients and optimizer state stay float32 (the parameters *are* the master weights);
  * ops run under ``torch.autocast(device, compute_dtype)``: autocast's own op lists decide what runs in the
    low dtype (matmuls, linear, convolutions, attention) and what stays float32 (softmax, log-softmax,
    cross-entropy and the other losses, norms, reductions); autopar does not keep a second list;
  * ``reduce_dtype``: the dtype of the gradient all-reduce / reduce-scatter after backward (float32 by default,
    as Megatron's ``accumulate_allreduce_grads_in_fp32``);
  * fp16 adds dynamic loss scaling with ``torch.amp.GradScaler``'s constants: the loss is multiplied by
    ``scale`` before backward; gradients are divided by it before the step; if any rank finds an inf/NaN,
    one all-reduce (MAX of a found-inf flag, under the collective timeout) tells every rank, every rank skips
    that step and multiplies the scale by ``backoff_factor``; after ``growth_interval`` clean steps in a row
    the scale grows by ``growth_factor``.

Why autocast rather than bf16 parameter copies (FSDP2's ``param_dtype``): the generated per-rank modules are
aten graphs, and autocast applies to aten calls, so the same graph runs in every policy; the planner sees the
dtypes the run will have by propagating fake tensors through the captured graph under the same autocast
(``apply_to_graph``), so compute is priced at the dtype's peak and activations and in-graph collectives at
their real bytes. The exception is ZeRO-3, whose units are gathered in the compute dtype, as FSDP2's
(``runtime.zero3``): ops then read the rounded weights, upcast where autocast computes in fp32.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings

import torch
import torch.fx as fx

from autopar.errors import PrecisionError


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """name: "fp32" | "bf16" | "fp16"; compute_dtype: autocast's low dtype (None: no autocast), which ZeRO-3
    also gathers parameters in (FSDP2's ``param_dtype``); reduce_dtype: gradient reduction dtype;
    loss_scaling: dynamic loss scaling (fp16)."""

    name: str
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype = torch.float32
    param_dtype: torch.dtype = torch.float32
    loss_scaling: bool = False
    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self):
        if self.compute_dtype not in (None, torch.bfloat16, torch.float16):
            raise PrecisionError(f"PrecisionPolicy {self.name!r}: compute_dtype={self.compute_dtype} is not one "
                                 f"autocast computes in, and ZeRO-3 gathers parameters in it; use torch.bfloat16, "
                                 f"torch.float16 or None (fp32)")
        if not (self.reduce_dtype.is_floating_point and self.reduce_dtype.itemsize >= 2):
            raise PrecisionError(f"PrecisionPolicy {self.name!r}: reduce_dtype={self.reduce_dtype} cannot hold "
                                 f"gradients; use torch.float32 (or torch.bfloat16 / torch.float16)")

    @property
    def compute_dtype_name(self) -> str:
        return str(self.compute_dtype or self.param_dtype).replace("torch.", "")

    def autocast(self, device_type: str):
        """The context every forward of the generated modules runs in."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.compute_dtype)

    def describe(self) -> str:
        if self.compute_dtype is None:
            return "fp32"
        text = f"{self.name}: {self.compute_dtype_name} compute, fp32 master weights and optimizer state, " \
               f"{str(self.reduce_dtype).replace('torch.', '')} gradient reduction"
        return text + (", dynamic loss scaling" if self.loss_scaling else "")


POLICIES = {
    "fp32": PrecisionPolicy("fp32"),
    "bf16": PrecisionPolicy("bf16", compute_dtype=torch.bfloat16),
    "fp16": PrecisionPolicy("fp16", compute_dtype=torch.float16, loss_scaling=True),
}


def resolve(precision) -> PrecisionPolicy:
    """``precision``: one of POLICIES' names, or a PrecisionPolicy."""
    if isinstance(precision, PrecisionPolicy):
        return precision
    if precision not in POLICIES:
        raise PrecisionError(f"precision={precision!r} is not known; use one of {sorted(POLICIES)} "
                             f"(or an autopar.ir.precision.PrecisionPolicy)")
    return POLICIES[precision]


def check_device(policy: PrecisionPolicy, device_type: str) -> None:
    """Raise ``PrecisionError`` when ``device_type`` cannot run ``policy``: a small matmul under the policy's
    autocast must run and come out in the compute dtype (autocast silently disables itself, with a warning,
    for a dtype the device does not support)."""
    if policy.compute_dtype is None:
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a = torch.ones(8, 8, device=device_type)
            with policy.autocast(device_type):
                got = (a @ a).dtype
    except (RuntimeError, AssertionError) as e:
        got = f"an error ({str(e).splitlines()[0][:120]})"
    if got != policy.compute_dtype:
        raise PrecisionError(f"precision={policy.name!r} needs {policy.compute_dtype_name} matmuls under autocast "
                             f"on {device_type!r}, but this build gives {got}; use precision='fp32' (or a "
                             f"device / PyTorch build with {policy.compute_dtype_name} kernels)")


def apply_to_graph(graph, policy: PrecisionPolicy):
    """Relabel every node's fake value with the dtype it has when the graph runs under ``policy``'s autocast.
    Fake tensors on the CPU are propagated through the graph under CPU autocast (a model on the meta device
    has meta values, which no autocast touches); each node then keeps its shape and device and takes the
    dtype found. Placeholders keep theirs: parameters stay float32. ``graph.compute_dtype`` records the
    policy's dtype (the memory model probes saved tensors under the same autocast). Returns ``graph``
    (changed in place); a no-op for fp32."""
    if policy.compute_dtype is None:
        return graph
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    scratch = FakeTensorMode(allow_non_fake_inputs=True)
    with scratch:
        args = [_like(n.meta.get("val"), device="cpu") for n in graph.gm.graph.find_nodes(op="placeholder")]
    on_cpu, copies = _on_cpu(graph.gm)
    with policy.autocast("cpu"):
        FakeTensorProp(on_cpu, scratch).propagate_dont_convert_inputs(*args)
    relabel = FakeTensorMode(allow_non_fake_inputs=True)
    with relabel:
        for node in graph.gm.graph.nodes:
            if node.op not in ("placeholder", "output"):
                node.meta["val"] = _retyped(node.meta.get("val"), copies[node].meta.get("val"))
    graph.compute_dtype = policy.compute_dtype
    return graph


def _on_cpu(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict]:
    """A copy of ``gm`` (and {original node: its copy}) whose ops that place a new tensor on a device
    (``arange(..., device=meta)``, ``to(x, meta)``: a model captured on the meta device records them)
    place it on the CPU instead, where the autocast propagation runs; the original graph is untouched."""
    copies: dict = {}
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, copies)
    graph.output(output)
    for node in graph.nodes:
        node.args = fx.node.map_aggregate(node.args, _cpu_device)
        node.kwargs = fx.node.map_aggregate(node.kwargs, _cpu_device)
    return fx.GraphModule(gm, graph), copies


def _cpu_device(arg):
    return torch.device("cpu") if isinstance(arg, torch.device) and arg.type != "cpu" else arg


def _like(val, device: str, dtype=None):
    """A tensor of ``val``'s shape and strides on ``device`` (inside a fake mode: a fake one)."""
    if not isinstance(val, torch.Tensor):
        return val
    return torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=dtype or val.dtype, device=device)


def _retyped(old, new):
    """``old`` (the captured value, on its own device) with the dtype(s) of ``new`` (the autocast run's)."""
    if isinstance(old, (tuple, list)) and isinstance(new, (tuple, list)) and len(old) == len(new):
        return type(old)(_retyped(o, n) for o, n in zip(old, new))
    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and new.dtype != old.dtype:
        return _like(old, old.device, new.dtype)
    return old
