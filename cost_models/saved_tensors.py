"""Which tensors an op's backward keeps: measured once per op signature on fake tensors.

``saved_rule(node, grad_names)`` runs the node's ATen op under ``FakeTensorMode`` (CPU fake tensors with
the node's shapes, strides and dtypes: no memory, no compute) inside
``torch.autograd.graph.saved_tensors_hooks``, with ``requires_grad`` set on the float inputs that are on
the gradient path, and sorts every tensor autograd packs by its storage:

    an input's storage   -> SavedRule.inputs   (positions in ``OpView.tensor_args``; a saved view of an
                                                input, e.g. linear's ``weight.t()``, keeps that input)
    an output's storage  -> SavedRule.output
    any other storage    -> SavedRule.new_bytes (each distinct storage once, at its full size: dropout
                                                 masks, softmax/log-softmax results, logsumexp, ...)

It also records ``alias_of``: the input whose storage output 0 shares (views, ``contiguous`` of a
contiguous tensor, dropout with p = 0 on CPU), so memory accounting can follow an alias to the tensor
that really holds the bytes.

Under a precision policy the probe runs inside the same CPU autocast the planner relabels dtypes with
(``ir.precision.apply_to_graph``), so it sees the copies autocast makes of an op's inputs: every
``_to_copy`` whose source is an input's storage is recorded in ``SavedRule.casts`` as (input position,
bytes of the copy, whether backward keeps it). A kept copy is no longer that input's storage, so it
counts neither in ``inputs`` nor in ``new_bytes``. Two cases matter for memory:

    linear / matmul on an fp32 activation   backward keeps the bf16 copy (2 bytes per element), made
                                            once per reader, not the fp32 input (4 bytes);
    cross_entropy on bf16 logits            autocast computes it in fp32: the kept log-softmax is fp32
                                            (4 bytes per logit, in ``new_bytes``) and the fp32 copy of
                                            the logits (a cast that is not kept) sizes backward's
                                            transient (``cost_models.memory.cast_inputs``).

Autocast caches the copy of a leaf tensor that requires grad (a parameter) until the autocast context
exits; those copies are the per-weight copy of ``memory.TrainingSpec.param_bytes``, not activations.

Invariants: the rule depends only on the op, its arguments' shapes/dtypes/strides and non-tensor values,
and which inputs need a gradient, so it is cached by (``node_signature``, the inputs' strides, gradient
flags, device type, autocast dtype). The signature holds shapes and dtypes only, and strides decide views:
``reshape`` of a transposed tensor copies, of a contiguous one aliases (a graph captured on the meta device
has the transposed layout where the CPU graph's attention output is contiguous), so a key without strides
would give a later plan the rule of whichever graph was probed first.
An op that fake tensors cannot run (data-dependent shapes) gets the hand-written rule of
``FALLBACK_SAVES_INPUTS`` / ``FALLBACK_SAVES_OUTPUT`` with ``measured=False``.

The probe sees the CPU kernels. For ``device_type="cuda"`` two ops are corrected to their CUDA kernels:
dropout keeps a 1-byte bool mask (``native_dropout``) instead of CPU's float noise tensor, and
``scaled_dot_product_attention`` with dropout keeps q, k, v, output and logsumexp (flash attention)
instead of the CPU math path's T×T probabilities.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import operator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.ir.ops import node_signature

aten = torch.ops.aten

FALLBACK_SAVES_INPUTS = {
    aten.linear, aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.matmul, aten.layer_norm,
    aten.native_layer_norm, aten.rms_norm, aten.scaled_dot_product_attention, aten.gelu, aten.silu,
    aten.relu, aten.tanh, aten.sigmoid, aten.pow, aten.mul, aten.div, aten.exp, aten.log, aten.sqrt,
    aten.rsqrt, aten.embedding, aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd, aten.where,
    aten.masked_fill, aten.erf, aten.abs, aten.clamp, aten.minimum, aten.maximum,
}
FALLBACK_SAVES_OUTPUT = {aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax,
                         aten.scaled_dot_product_attention, aten.exp, aten.tanh, aten.sigmoid}
_SAVES_NOTHING = {aten.add, aten.sub, aten.neg, aten.sum, aten.mean, aten.cat, aten.stack, aten.clone,
                  aten.contiguous, aten.to, aten._to_copy, aten.dropout, aten.cumsum}


@dataclasses.dataclass(frozen=True)
class SavedRule:
    """What one op's backward keeps alive. inputs: positions in ``OpView.tensor_args``; output: whether
    it keeps its own output; new_bytes: bytes of tensors it creates only for backward (global shapes);
    alias_of: the input position whose storage output 0 shares, or None; measured: probed, not a table;
    casts: (input position, bytes, kept by backward) of every copy autocast made of an input."""

    inputs: tuple[int, ...] = ()
    output: bool = False
    new_bytes: float = 0.0
    alias_of: int | None = None
    measured: bool = True
    casts: tuple[tuple[int, float, bool], ...] = ()


_CACHE: dict[tuple, SavedRule] = {}


def saved_rule(node: fx.Node, grad_names: set[str], device_type: str = "cpu",
               autocast_dtype: torch.dtype | None = None) -> SavedRule:
    """The ``SavedRule`` of a call_function node; ``grad_names``: nodes whose output needs a gradient;
    ``autocast_dtype``: the precision policy's compute dtype (None: no autocast, fp32)."""
    if node.op != "call_function" or node.target is operator.getitem or not hasattr(node.target, "_schema"):
        return SavedRule(measured=False)
    flat = _flat_args(node)
    flags = tuple(isinstance(a, fx.Node) and a.name in grad_names for a in flat)
    key = (node_signature(node), _strides(flat), flags, device_type, autocast_dtype)
    if key not in _CACHE:
        rule = _probe(node, flags, autocast_dtype)
        _CACHE[key] = _cuda_kernels(node, rule) if device_type == "cuda" else rule
    return _CACHE[key]


def _flat_args(node: fx.Node) -> list:
    return pytree.tree_flatten((node.args, node.kwargs))[0]


def _strides(flat: list) -> tuple:
    """The strides of the tensor arguments' values (the probe's fake tensors take them: ``_fake_tensor``)."""
    def of(val):
        if isinstance(val, torch.Tensor):
            return tuple(val.stride())
        if isinstance(val, (tuple, list)):
            return tuple(of(v) for v in val)
        return None

    return tuple(of(a.meta.get("val")) for a in flat if isinstance(a, fx.Node))


def _probe(node: fx.Node, flags: tuple[bool, ...], autocast_dtype: torch.dtype | None = None) -> SavedRule:
    """Run the op once on fake tensors (under CPU autocast when ``autocast_dtype`` is given) and classify
    what autograd packs (see the module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    packed: list[torch.Tensor] = []
    copies = _Copies()
    autocast = (torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())
    try:
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t)
        with _quiet_fake_tensor_log(), FakeTensorMode(), copies, hooks:
            fakes = [_fake(a, grad) if isinstance(a, fx.Node) else a for a, grad in zip(flat, flags)]
            args, kwargs = pytree.tree_unflatten(fakes, spec)
            with torch.enable_grad(), autocast:
                out = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op fake tensors cannot run is priced by the fallback table
        return fallback_rule(node)
    inputs = [f for a, f in zip(flat, fakes) if isinstance(a, fx.Node) and isinstance(f, torch.Tensor)]
    outputs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    return _classify(packed, inputs, outputs, copies.source)


class _Copies(TorchDispatchMode):
    """Records {storage of a ``_to_copy`` result: storage of its source}: autocast's casts reach the
    dispatcher as ``_to_copy`` below the autocast key. The results are kept alive while the probe runs, so
    no later tensor reuses their storage's address."""

    def __init__(self):
        super().__init__()
        self.source: dict[int, tuple[int, int]] = {}  # copy storage -> (source storage, copy bytes)
        self._alive: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is aten._to_copy.default and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor):
            self.source[_storage_id(out)] = (_storage_id(args[0]), out.untyped_storage().nbytes())
            self._alive.append(out)
        return out


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """Silence FakeTensorMode's ERROR log while probing. A graph whose rescaling is inexact (a size derived
    from the batch that ``batch_dims`` cannot follow) keeps such ops at the full batch, so some probes meet
    shapes that do not broadcast; the op's meta kernel raises, fake_tensor logs a full traceback at ERROR
    before re-raising, and ``_probe`` prices the op by its fallback rule. The exception is the signal;
    the log line would only reach the user as a scary traceback during a successful plan."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = disabled


def _fake(arg: fx.Node, grad: bool):
    """A fake CPU tensor like ``arg``'s value (same shape, stride, dtype); lists of tensors element-wise."""
    val = arg.meta.get("val")
    if isinstance(val, (tuple, list)):
        return type(val)(_fake_tensor(v, False) for v in val)
    return _fake_tensor(val, grad)


def _fake_tensor(val, grad: bool):
    if not isinstance(val, torch.Tensor):
        return val
    t = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device="cpu")
    return t.requires_grad_(True) if grad and val.dtype.is_floating_point else t


def _storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _classify(packed: list, inputs: list, outputs: list, copies: dict | None = None) -> SavedRule:
    """``copies``: {storage of a ``_to_copy`` result: (storage of its source, bytes)} (``_Copies``)."""
    in_ids = [_storage_id(t) for t in inputs]
    out_ids = {_storage_id(t) for t in outputs}
    casts = {sid: (in_ids.index(src), nbytes) for sid, (src, nbytes) in (copies or {}).items() if src in in_ids}
    saved_inputs, keeps_output, new, kept_casts = set(), False, {}, set()
    for t in packed:
        if not isinstance(t, torch.Tensor):
            continue
        sid = _storage_id(t)
        if sid in in_ids:
            saved_inputs.add(in_ids.index(sid))
        elif sid in out_ids:
            keeps_output = True
        elif sid in casts:
            kept_casts.add(sid)
        else:
            new[sid] = t.untyped_storage().nbytes()
    alias = in_ids.index(_storage_id(outputs[0])) if outputs and _storage_id(outputs[0]) in in_ids else None
    cast_list = tuple(sorted((pos, float(nbytes), sid in kept_casts) for sid, (pos, nbytes) in casts.items()))
    return SavedRule(tuple(sorted(saved_inputs)), keeps_output, float(sum(new.values())), alias, casts=cast_list)


def fallback_rule(node: fx.Node) -> SavedRule:
    """The hand-written rule: listed ops keep their inputs and/or output; unknown ops keep their inputs."""
    packet = getattr(node.target, "overloadpacket", node.target)
    n_tensors = sum(isinstance(a, fx.Node) for a in _flat_args(node))
    keeps_inputs = packet in FALLBACK_SAVES_INPUTS or packet not in (_SAVES_NOTHING | FALLBACK_SAVES_OUTPUT)
    return SavedRule(tuple(range(n_tensors)) if keeps_inputs else (), packet in FALLBACK_SAVES_OUTPUT,
                     measured=False)


def _cuda_kernels(node: fx.Node, rule: SavedRule) -> SavedRule:
    """The CUDA kernels' saved tensors where they differ from CPU's (see the module docstring)."""
    packet = getattr(node.target, "overloadpacket", None)
    p = _dropout_p(node)
    if packet is aten.dropout and p > 0:
        numel = math.prod(node.meta["val"].shape)
        return dataclasses.replace(rule, new_bytes=float(numel))  # bool mask, 1 byte per element
    if packet is aten.scaled_dot_product_attention and p > 0:
        q = node.args[0].meta["val"]
        lse = math.prod(q.shape[:-1]) * 4  # float32 logsumexp per query row
        copied = {pos for pos, _, kept in rule.casts if kept}  # autocast's copies of q, k, v are kept instead
        return SavedRule(tuple(i for i in (0, 1, 2) if i not in copied), True, float(lse), None, casts=rule.casts)
    return rule


def _dropout_p(node: fx.Node) -> float:
    packet = getattr(node.target, "overloadpacket", None)
    if packet is aten.dropout:
        return float(node.args[1]) if len(node.args) > 1 else float(node.kwargs.get("p", 0.0))
    if packet is aten.scaled_dot_product_attention:
        return float(node.args[4]) if len(node.args) > 4 else float(node.kwargs.get("dropout_p", 0.0))
    return 0.0
