"""What every layer reads of one graph node: ``OpView`` (inputs, outputs, arguments), ``node_signature``
(equal signatures mean equal strategies and costs), ``is_free_view`` (ops that move no data), and
``requires_grad_nodes`` (which values carry a gradient).

Invariants: ``OpView.tensor_args`` are the fx nodes among a node's args and kwargs in pytree order;
``node_signature`` depends only on the op, its non-tensor arguments and its inputs' shapes and dtypes.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

aten = torch.ops.aten


def _vals(node: fx.Node) -> Any:
    return node.meta.get("val")


def shape_of(val: Any) -> tuple[int, ...] | None:
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


class OpView:
    """What a rule sees of a node: its tensor inputs' shapes and dtypes, its output shape(s), and its
    non-tensor arguments (``arg(i)``/``kwarg(name)``). ``tensor_args`` are the fx nodes among the node's
    args and kwargs, flattened in pytree order; for ``getitem`` the input value is the selected element.
    """

    def __init__(self, node: fx.Node):
        self.node = node
        self.target = node.target
        flat, _ = pytree.tree_flatten((node.args, node.kwargs))
        self.tensor_args: list[fx.Node] = [a for a in flat if isinstance(a, fx.Node) and _is_tensorish(a)]
        self.in_vals = [self._consumed_val(a) for a in self.tensor_args]
        self.in_shapes = [shape_of(v) for v in self.in_vals]
        val = _vals(node)
        self.out_vals: list[torch.Tensor] = [v for v in (val if isinstance(val, (tuple, list)) else [val])
                                             if isinstance(v, torch.Tensor)]
        self.out_shape = shape_of(self.out_vals[0]) if self.out_vals else None

    def _consumed_val(self, arg: fx.Node) -> Any:
        val = _vals(arg)
        if isinstance(val, (tuple, list)) and self.target is getitem_op():
            return val[self.node.args[1]]
        return val

    @property
    def n_in(self) -> int:
        return len(self.tensor_args)

    @property
    def out_ndim(self) -> int:
        return len(self.out_shape) if self.out_shape is not None else 0

    def arg(self, i: int, default: Any = None) -> Any:
        return self.node.args[i] if i < len(self.node.args) else self.node.kwargs.get(_argname(self.node, i), default)

    def kwarg(self, name: str, default: Any = None) -> Any:
        if name in self.node.kwargs:
            return self.node.kwargs[name]
        schema = getattr(self.target, "_schema", None)
        if schema is not None:
            for i, a in enumerate(schema.arguments):
                if a.name == name:
                    return self.node.args[i] if i < len(self.node.args) else (
                        a.default_value if a.has_default_value() else default)
        return default

    def index_of(self, arg_node: fx.Node | None) -> int | None:
        """Position of ``arg_node`` among tensor_args (None if absent)."""
        for i, a in enumerate(self.tensor_args):
            if a is arg_node:
                return i
        return None


def _argname(node: fx.Node, i: int) -> str:
    schema = getattr(node.target, "_schema", None)
    return schema.arguments[i].name if schema is not None and i < len(schema.arguments) else f"arg{i}"


def _is_tensorish(node: fx.Node) -> bool:
    val = _vals(node)
    if isinstance(val, torch.Tensor):
        return True
    return isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val)


def getitem_op():
    return operator.getitem


FREE_VIEWS = {
    aten.view, aten._unsafe_view, aten.expand, aten.permute, aten.transpose, aten.t, aten.unsqueeze,
    aten.squeeze, aten.select, aten.slice, aten.split, aten.split_with_sizes, aten.chunk, aten.unbind,
    aten.alias, aten.detach, aten.lift_fresh_copy, aten.numpy_T, aten.narrow, aten.tensor_split,
    aten.broadcast_tensors,
}


def is_free_view(node: fx.Node) -> bool:
    """Pure views and ``getitem``: ops that move no data (no bytes, no FLOPs)."""
    if node.target is operator.getitem:
        return True
    packet = getattr(node.target, "overloadpacket", None)
    return packet in FREE_VIEWS


SIGNATURE_KEY = "autopar_signature"  # node.meta slot of the cached signature (``rescale`` drops it)


def node_signature(node: fx.Node) -> str:
    """Op and argument shapes/values: nodes with equal signatures have equal strategies and costs.

    Cached in ``node.meta``, valid while the node's target, args, kwargs, own value and its inputs' values
    are the very same objects (checked by identity: a pass that relabels values or rewires arguments
    replaces them, which invalidates the entry). Planning asks for every node's signature once per mesh
    option and pricing step, and building it walks the arguments with pytree."""
    inputs = node.all_input_nodes
    stamp = (node.target, node.args, node.kwargs, node.meta.get("val"), *(a.meta.get("val") for a in inputs))
    hit = node.meta.get(SIGNATURE_KEY)
    if hit is not None and len(hit[0]) == len(stamp) and all(x is y for x, y in zip(hit[0], stamp)):
        return hit[1]
    signature = _signature(node)
    node.meta[SIGNATURE_KEY] = (stamp, signature)
    return signature


def _signature(node: fx.Node) -> str:
    def describe(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return ("T", tuple(v.shape), str(v.dtype))
            if isinstance(v, (tuple, list)) and all(isinstance(x, torch.Tensor) for x in v):
                return ("TT", tuple((tuple(x.shape), str(x.dtype)) for x in v))
            return ("N", a.name)
        return a

    if node.op == "placeholder":
        val = node.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        return f"placeholder|{shape}|{getattr(val, 'dtype', None)}"
    return f"{node.op}|{node.target}|{pytree.tree_map(describe, (node.args, node.kwargs))}"


def requires_grad_nodes(gm: fx.GraphModule, trainable: set[str]) -> set[str]:
    """Names of nodes whose output is a float tensor depending on a trainable placeholder.

    A node's inputs are read as ``node.all_input_nodes`` (no ``OpView``): every name in the set is a
    tensor-valued node (a trainable placeholder, or a node admitted for its float output), so meeting one
    among all inputs is meeting it among ``OpView.tensor_args``."""
    out = set(trainable)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else [val]
        is_float = any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in vals)
        if is_float and any(a.name in out for a in node.all_input_nodes):
            out.add(node.name)
    return out
