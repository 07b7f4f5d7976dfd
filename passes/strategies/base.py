"""Vocabulary of the strategy rules: what a rule sees (``OpView``) and what it returns (``AxisRule``).

A rule describes the ways to split one op along *one* mesh axis. ``combine`` (in ``__init__``) takes the
product over the mesh axes to get 2-D ``Strategy`` objects. This works because every rule shards
the op's iteration space by one label per axis: two axes sharding the same tensor dim nest as DTensor
nests them (axis 0 outer), on inputs and output alike.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor.placement_types import Placement

from autopar.placement import R, Spec, spec_str


@dataclasses.dataclass(frozen=True)
class AxisRule:
    """One way to split an op along one mesh axis.

    inputs: a placement per tensor input (in ``OpView.tensor_args`` order); output: the placement of
    the output (of every output, for multi-output ops). kernel: a tag naming the local rewrite codegen
    must apply when this rule is used on an axis (see ``KERNELS``), or None when the ATen op itself
    is correct on local shards.
    """

    inputs: tuple[Placement, ...]
    output: Placement
    kernel: str | None = None


# Local rewrites a rule may ask for, with what codegen does for axes of size W using them.
KERNELS = {
    "scale_additive": "the additive input (bias) is multiplied by 1/W before the op (output is Partial)",
    "mean_partial": "the op's output is multiplied by 1/W (a mean over a sharded dim becomes a Partial sum)",
    "vocab_embedding": "indices outside this rank's vocabulary rows read zero (output is Partial)",
    "ce_batch": "loss = local sum / global count of counted targets (output is Partial)",
    "ce_class": "softmax statistics are all-reduced over the class shards (vocab-parallel cross-entropy)",
    "local_experts": "a grouped expert matmul computes only its own experts' rows, zeros elsewhere (output is Partial)",
}


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A full sharding of one node on the mesh: a spec per tensor input and the output spec.

    work_fraction: the share of the op's FLOPs one device performs (1 / product of the sizes of
    the axes whose rule splits the work; 1.0 when the op is replicated).
    kernels: (axis, tag) pairs for the local rewrites codegen must apply.
    """

    in_specs: tuple[Spec, ...]
    out_spec: Spec
    work_fraction: float = 1.0
    kernels: tuple[tuple[int, str], ...] = ()

    def __str__(self) -> str:
        ins = ",".join(spec_str(s) for s in self.in_specs)
        return f"{spec_str(self.out_spec)} <- ({ins})"


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
    import operator

    return operator.getitem


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def all_replicated_rule(view: OpView) -> AxisRule:
    return AxisRule(tuple(R for _ in range(view.n_in)), R)


def aten_ops(*names: str) -> list:
    """The ATen op packets with these names that exist in this torch build (older builds lack some)."""
    return [getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n)]


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1
