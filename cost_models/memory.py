"""Memory per device: training state of parameters, and activations saved for backward.

Parameter state, per parameter element held locally (mixed precision keeps an fp32 master copy):

    bytes = itemsize (weight) + itemsize (gradient) + optimizer state
    optimizer state: adamw/adam 2 × 4 bytes (exp_avg, exp_avg_sq in fp32), sgd with momentum 4, sgd 0,
                     + 4 for the fp32 master weight when the weight is fp16/bf16

So fp32 AdamW costs 16 bytes per parameter, and fp16 AdamW 2 + 2 + 8 + 4 = 16 (Megatron's figure).

Activations (``saved_nodes``): what each op's backward keeps is *measured* by running the op once on fake
tensors (``cost_models.saved_tensors``). A tensor kept by any consumer is counted once, at the layout of
the node that owns its storage (views and aliases are followed back to it; placeholders are parameters
or user inputs and are not counted here). Tensors an op creates only for backward (dropout noise,
log-softmax of a cross-entropy, attention logsumexp, layer-norm statistics) are charged to the largest
tensor the op touches, as a fraction of that tensor's bytes, so they shard as the op does. The copy a
consumer makes when it reshards an input before saving it is not counted (an under-estimate the
fidelity benchmark measures).

Under a precision policy the ops are probed under the policy's autocast (``saved_tensors``). A copy
autocast makes of an input and backward keeps is charged to that input's owner, once per reader (autocast
caches no copy of a non-leaf): an fp32 activation x read by k linears costs k · numel(x) · 2 bytes in bf16
where it was k-independent 4 · numel(x) before. Copies of trainable parameters are autocast's cached
weight copies, charged with the parameter state (``TrainingSpec.param_bytes``), not here. An op autocast
computes in fp32 (cross_entropy, the norms and losses) keeps its fp32 intermediates: cross_entropy on bf16
logits of n elements keeps a 4n-byte log-softmax, not 2n.

Weight-update sharding (ZeRO, over the data-parallel axes of a parameter: the mesh axes it is replicated on),
per parameter element, with n = the product of those axes' sizes:

    level 0: weight + gradient + optimizer state          level 1: weight + gradient + state / n
    (state includes the fp32 master copy of a weight stored in fp16/bf16; with a precision policy the
    weights stay fp32 and autocast's compute-dtype copy of each, saved for backward, adds its itemsize)
    level 2: weight + (gradient + state) / n              level 3: (weight + gradient + state) / n
    (at level 3 the ops read the gathered unit, in the compute dtype under a policy, and backward gathers it
    again: no per-weight copy is kept; the units held at once are a transient, ``cost_models.zero3``)

The runtime keeps the synced gradients of each bucket (``autopar.ir.buckets``) in one flat buffer, padded for
levels ≥ 1 to n equal shards; ``held_state_bytes`` counts exactly what a rank then holds between steps. At
level 3 a bucket is a unit gathered whole around its uses (``runtime.zero3``); the units gathered at once add
transiently (``cost_models.zero3.zero3_transient``: the peak over the forward of the units whose prefetch-to-
last-read spans overlap, each its padded flat buffer at the gather itemsize, ``ir.buckets.peak_gathered``).

Peak over a step (``ilp.memory_of``): parameter state + every saved activation + the largest transient.
A node's transient is its output and that output's gradient, 2 × its output bytes, or, where autocast
widens an input (``cast_inputs``), 2 × the widened copy's bytes: backward of cross_entropy on bf16 logits
of n elements holds the fp32 gradient of the log-softmax and of the logits at once, 2 × 4n bytes beside the
kept 4n-byte log-softmax, where the bf16 logits alone would give 2 × 2n.
All saved activations are alive at the end of forward; gradients then replace them layer by layer, so
this sum bounds the real peak from above by at most the gradient bytes (4 of the 16 bytes/parameter).
Where a step runs one microbatch, the plan's prediction takes back what that bound overcounts for the
gradients no flat buffer keeps between steps (``single_step_release``): they are allocated in backward,
each once its last reader's backward runs, after everything read later in forward has been released.
"""
from __future__ import annotations

import dataclasses
import operator

import numpy as np
import torch
import torch.fx as fx

from autopar.cost_models.saved_tensors import saved_rule
from autopar.ir.ops import OpView, is_free_view

OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd_momentum": 4, "sgd": 0}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingSpec:
    """How the model is trained, as far as memory is concerned.

    optimizer: one of OPTIMIZER_STATE_BYTES' keys.  Master weights are assumed for fp16/bf16 parameters.
    """

    optimizer: str = "adamw"
    zero: tuple[tuple[str, int], ...] = ()   # (parameter placeholder, forced level)
    zero_search: bool = False                # parameters absent from ``zero``: the ILP chooses (else level 0)
    compute_itemsize: int = 0                # autocast's weight copies (saved for backward); 0 for fp32
    bucket_bytes: float = 25 * 2 ** 20       # gradient-sync bucket cap: a ZeRO-3 unit is gathered whole
    host_optimizer: bool = False             # optimizer state and master weights in host memory (ZeRO-Offload)
    host_activations: bool = False           # activations saved for backward kept in host memory (save_on_cpu)
    expert_routing: tuple[float, ...] | None = None  # MoE: share of assignments per expert (None: uniform)

    def __post_init__(self):
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise ValueError(f"optimizer {self.optimizer!r} is not modelled; use one of "
                             f"{sorted(OPTIMIZER_STATE_BYTES)}")

    def zero_level(self, name: str) -> int:
        return dict(self.zero).get(name, 0)

    def zero_searched(self, name: str) -> bool:
        """Whether the ILP chooses ``name``'s level (no level was forced for it)."""
        return self.zero_search and name not in dict(self.zero)

    def param_bytes(self, name: str, numel: float, dtype: torch.dtype, dp_ways: int, level: int | None = None) -> float:
        """Bytes one device keeps for ``numel`` local elements of parameter ``name`` replicated ``dp_ways``
        times (see the module docstring), plus the compute-dtype copy autocast saves for backward.
        ``level``: the ZeRO level to price (default: the forced one, else 0)."""
        item = torch.empty((), dtype=dtype).element_size()
        level, n = self.zero_level(name) if level is None else level, max(dp_ways, 1)
        weight = item / n if level >= 3 else item
        grad = item / n if level >= 2 else item
        master = 4 if dtype in (torch.float16, torch.bfloat16) else 0  # fp32 copy of a low-precision weight
        state = (OPTIMIZER_STATE_BYTES[self.optimizer] + master) / (n if level >= 1 else 1)
        state = 0.0 if self.host_optimizer else state  # held in host memory (cost_models.offload)
        copy = self.compute_itemsize if level < 3 or n == 1 else 0  # level 3 saves its gathered unit instead
        return numel * (weight + grad + state + copy)

    def param_state_bytes_per_element(self, dtype: torch.dtype) -> float:
        item = torch.empty((), dtype=dtype).element_size()
        master = 4 if dtype in (torch.float16, torch.bfloat16) else 0
        return 2 * item + OPTIMIZER_STATE_BYTES[self.optimizer] + master


def _out_bytes(node: fx.Node) -> float:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    return float(sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor)))


class _Owners:
    """Maps a node to the node owning its output's storage: through views and ops that alias an input."""

    def __init__(self, grad_names: set[str], device_type: str, autocast_dtype: torch.dtype | None = None):
        self.grad_names, self.device_type, self.autocast_dtype = grad_names, device_type, autocast_dtype
        self._memo: dict[str, fx.Node] = {}

    def __call__(self, node: fx.Node) -> fx.Node:
        if node.name not in self._memo:
            self._memo[node.name] = self._follow(node)
        return self._memo[node.name]

    def _follow(self, node: fx.Node) -> fx.Node:
        if node.op != "call_function":
            return node
        args = OpView(node).tensor_args
        if node.target is operator.getitem:  # an element of a view op's output (split, unbind) is a view
            src = node.args[0]
            return self(src) if isinstance(src, fx.Node) and is_free_view(src) else node
        if is_free_view(node):
            return self(args[0]) if args else node
        alias = saved_rule(node, self.grad_names, self.device_type, self.autocast_dtype).alias_of
        return self(args[alias]) if alias is not None and alias < len(args) else node


def saved_nodes(gm: fx.GraphModule, requires_grad: set[str], device_type: str = "cpu",
                autocast_dtype: torch.dtype | None = None) -> dict[str, float]:
    """{node name: saved bytes per output byte of that node}: 1.0 for a kept output, plus the share of
    tensors created for backward that the node is charged with, plus autocast's kept copies of it (see the
    module docstring).

    Only ops on the gradient path save anything: a node whose output needs no gradient records no
    backward. device_type picks the kernels' saving behaviour ("cpu", or "cuda": see saved_tensors);
    autocast_dtype is the precision policy's compute dtype (None for fp32).
    """
    owner = _Owners(requires_grad, device_type, autocast_dtype)
    kept: set[str] = set()
    extra: dict[str, float] = {}

    def charge(anchor: fx.Node, nbytes: float) -> None:
        extra[anchor.name] = extra.get(anchor.name, 0.0) + nbytes / max(_out_bytes(anchor), 1.0)

    for node in gm.graph.nodes:
        if node.op != "call_function" or node.name not in requires_grad or is_free_view(node):
            continue
        rule = saved_rule(node, requires_grad, device_type, autocast_dtype)
        args = OpView(node).tensor_args
        kept.update(owner(args[i]).name for i in rule.inputs if i < len(args) and owner(args[i]).op != "placeholder")
        if rule.output:
            kept.add(owner(node).name)
        if rule.new_bytes:
            charge(_anchor(node, args, owner), rule.new_bytes)
        for pos, nbytes, is_kept in rule.casts:
            if not is_kept or pos >= len(args):
                continue
            src = owner(args[pos])
            if src.op == "placeholder" and src.name in requires_grad:
                continue  # autocast's cached weight copy: TrainingSpec.param_bytes
            charge(node if src.op == "placeholder" else src, nbytes)
    return {name: (1.0 if name in kept else 0.0) + extra.get(name, 0.0) for name in kept | set(extra)}


def cast_inputs(gm: fx.GraphModule, requires_grad: set[str], device_type: str = "cpu",
                autocast_dtype: torch.dtype | None = None) -> dict[str, tuple[tuple[int, float], ...]]:
    """{node name: ((input position, copy bytes / input bytes), ...)} for the inputs autocast copies when
    the node runs (empty without a policy). A ratio of 2 is an fp32 copy of a bf16 input: the op computes
    in fp32, and its backward's transient is sized by that copy (see the module docstring)."""
    if autocast_dtype is None:
        return {}
    out: dict[str, tuple[tuple[int, float], ...]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.name not in requires_grad or is_free_view(node):
            continue
        args = OpView(node).tensor_args
        casts = tuple((pos, nbytes / max(_out_bytes(args[pos]), 1.0))
                      for pos, nbytes, _ in saved_rule(node, requires_grad, device_type, autocast_dtype).casts
                      if pos < len(args))
        if casts:
            out[node.name] = casts
    return out


def _anchor(node: fx.Node, args: list[fx.Node], owner: _Owners) -> fx.Node:
    """The node charged with ``node``'s new saved tensors: the owner of the largest tensor it touches
    (its output on ties), or ``node`` itself when that tensor is a placeholder's."""
    best, best_bytes = node, _out_bytes(node)
    for arg in args:
        if _out_bytes(arg) > best_bytes:
            best, best_bytes = arg, _out_bytes(arg)
    best = owner(best) if best is not node else node
    return node if best.op == "placeholder" else best


def zero_levels(zero, names_to_fqns: dict[str, str]) -> dict[str, int]:
    """{parameter placeholder: forced ZeRO level} from the ``zero`` option: an int for all parameters, or
    {fqn glob: level} (first matching glob wins). "auto" forces nothing: the ILP chooses every parameter's
    level (``passes.intra_op_zero``), as it does for the parameters no glob matches."""
    import fnmatch

    if zero == "auto":
        return {}
    if isinstance(zero, dict):
        out = {}
        for name, fqn in names_to_fqns.items():
            hit = next((lvl for glob, lvl in zero.items() if fnmatch.fnmatch(fqn, glob) or fnmatch.fnmatch(name, glob)),
                       None)
            if hit is not None:
                out[name] = hit
        return out
    return {name: zero for name in names_to_fqns}


def held_state_bytes(buckets: list[dict], loose: list[int], optimizer: str, itemsize: int = 4) -> dict[str, float]:
    """{params, grads, optimizer}: bytes one rank holds between steps. ``buckets``: {numel, ways, level} per
    synced bucket (its flat gradient buffer, or shard, persists); ``loose``: numel of every other trainable
    local tensor, whose gradient does not outlive the step (the optimizer's ``zero_grad`` sets it to None,
    torch's default). The optimizer keeps its state per tensor it steps (a bucket's shard at level ≥ 1,
    else each parameter) plus a 4-byte step counter per tensor for adam/adamw."""
    from autopar.ir.buckets import padded_numel

    per_elem, step = OPTIMIZER_STATE_BYTES[optimizer], 4 if optimizer.startswith("adam") else 0
    params = grads = state = 0.0
    for n in loose:
        params, state = params + n * itemsize, state + n * per_elem + step
    for b in buckets:
        padded = padded_numel(b["numel"], b["ways"], b["level"])
        shard = padded // b["ways"] if b["level"] >= 1 else None
        params += (shard if b["level"] >= 3 else padded) * itemsize
        grads += (shard if b["level"] >= 2 else padded) * itemsize
        state += (shard * per_elem + step) if shard is not None else b["numel"] * per_elem + step * b["count"]
    return {"params": params, "grads": grads, "optimizer": state}


def single_step_release(activations: list[tuple[int, float]], gradients: list[tuple[int, float]]) -> float:
    """Bytes a one-microbatch step's peak stays below Σ activations + Σ gradients, the ILP's bound, for
    gradients that do not exist between steps (``zero_grad`` sets them to None, torch's default).

    ``activations``: (forward position, bytes kept for backward); ``gradients``: (position of the last
    forward reader, bytes). Backward visits positions in reverse: when it reaches x, the activations of
    positions after x are released and the gradients of parameters read at or after x are allocated, so

        peak = max_x ( Σ_{x_a ≤ x} a + Σ_{x_g ≥ x} g ),    release = A + G − peak ≥ 0.
    """
    if not gradients:
        return 0.0
    size = 1 + max(x for x, _ in [*activations, *gradients])
    act, grad = np.zeros(size), np.zeros(size)
    for x, a in activations:
        act[x] += a
    for x, g in gradients:
        grad[x] += g
    live = np.cumsum(act) + np.cumsum(grad[::-1])[::-1]
    return float(max(0.0, act.sum() + grad.sum() - live.max()))
