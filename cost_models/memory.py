"""Memory per device: training state of parameters, and activations saved for backward.

Parameter state, per parameter element held locally (mixed precision keeps an fp32 master copy):

    bytes = itemsize (weight) + itemsize (gradient) + optimizer state
    optimizer state: adamw/adam 2 × 4 bytes (exp_avg, exp_avg_sq in fp32), sgd with momentum 4, sgd 0,
                     + 4 for the fp32 master weight when the weight is fp16/bf16

So fp32 AdamW costs 16 bytes per parameter, and fp16 AdamW 2 + 2 + 8 + 4 = 16 (Megatron's figure).

Activations: a tensor is *saved* when some consumer's backward needs it (``SAVES_INPUTS``) or its
producer's backward needs its own output (``SAVES_OUTPUT``); it is counted once, at its producer's
layout. The copy a consumer makes when it reshards an input before saving it is not counted (an
under-estimate that the fidelity benchmark measures). Dropout also keeps a 1-byte mask per element.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from autopar.passes.strategies.base import OpView

aten = torch.ops.aten

OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd_momentum": 4, "sgd": 0}

SAVES_INPUTS = {
    aten.linear, aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.matmul, aten.layer_norm,
    aten.native_layer_norm, aten.rms_norm, aten.scaled_dot_product_attention, aten.gelu, aten.silu,
    aten.relu, aten.tanh, aten.sigmoid, aten.pow, aten.mul, aten.div, aten.exp, aten.log, aten.sqrt,
    aten.rsqrt, aten.embedding, aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd, aten.where,
    aten.masked_fill, aten.erf, aten.abs, aten.clamp, aten.minimum, aten.maximum,
}
SAVES_OUTPUT = {aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax,
                aten.scaled_dot_product_attention, aten.exp, aten.tanh, aten.sigmoid}
SAVES_NOTHING = {aten.add, aten.sub, aten.neg, aten.sum, aten.mean, aten.view, aten.reshape, aten._unsafe_view,
                 aten.expand, aten.permute, aten.transpose, aten.t, aten.unsqueeze, aten.squeeze, aten.select,
                 aten.slice, aten.split, aten.chunk, aten.unbind, aten.alias, aten.clone, aten.contiguous,
                 aten.to, aten._to_copy, aten.cat, aten.stack, aten.dropout, aten.detach, aten.flatten,
                 aten.arange, aten.zeros, aten.ones, aten.full, aten.new_zeros, aten.new_ones, aten.cumsum,
                 aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingSpec:
    """How the model is trained, as far as memory is concerned.

    optimizer: one of OPTIMIZER_STATE_BYTES' keys.  Master weights are assumed for fp16/bf16 parameters.
    """

    optimizer: str = "adamw"

    def __post_init__(self):
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise ValueError(f"optimizer {self.optimizer!r} is not modelled; use one of "
                             f"{sorted(OPTIMIZER_STATE_BYTES)}")

    def param_state_bytes_per_element(self, dtype: torch.dtype) -> float:
        item = torch.empty((), dtype=dtype).element_size()
        master = 4 if dtype in (torch.float16, torch.bfloat16) else 0
        return 2 * item + OPTIMIZER_STATE_BYTES[self.optimizer] + master


def _packet(node: fx.Node):
    return getattr(node.target, "overloadpacket", node.target)


def consumer_saves_input(consumer: fx.Node) -> bool:
    """Whether ``consumer``'s backward keeps its tensor inputs (unknown ops: assume yes)."""
    if consumer.op != "call_function":
        return False
    packet = _packet(consumer)
    if packet in SAVES_INPUTS:
        return True
    if packet in SAVES_NOTHING or packet in SAVES_OUTPUT:
        return False
    import operator

    return consumer.target is not operator.getitem


def saved_nodes(gm: fx.GraphModule, requires_grad: set[str]) -> dict[str, float]:
    """{node name: saved bytes per output byte}: 1.0 for a saved output, plus the dropout mask share.

    Only tensors on the gradient path are saved: a consumer whose output needs no gradient keeps nothing.
    """
    saved: dict[str, float] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.name not in requires_grad:
            continue
        if _packet(node) in SAVES_OUTPUT:
            saved[node.name] = 1.0
        if consumer_saves_input(node):
            for arg in OpView(node).tensor_args:
                if arg.op != "placeholder":
                    saved[arg.name] = 1.0
        if _packet(node) in (aten.dropout, aten.native_dropout) and float(node.args[1]) > 0:
            val = node.meta["val"]
            saved[node.name] = saved.get(node.name, 0.0) + 1.0 / val.element_size()
    return saved


def requires_grad_nodes(gm: fx.GraphModule, trainable: set[str]) -> set[str]:
    """Names of nodes whose output is a float tensor depending on a trainable placeholder."""
    out = set(trainable)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else [val]
        is_float = any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in vals)
        if is_float and any(a.name in out for a in OpView(node).tensor_args):
            out.add(node.name)
    return out
