"""Reductions and normalizing ops: sum, mean, amax/amin, max/min.dim, argmax, softmax, cumsum, logsumexp, diff.

A kept dim keeps its shard. A reduced dim may be sharded only for sum and mean, whose local results
are summands of the global one: the output is Partial, and a mean is scaled by 1/W
(``mean_partial``: mean of equal-size shards = average of local means). max/argmax/softmax/cumsum
need the whole reduced dim on each device, so it stays unsharded there.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from autopar.ir.ops import OpView
from autopar.passes.strategies.base import AxisRule, norm_dim
from autopar.passes.strategies.registry import register
from autopar.placement import P

aten = torch.ops.aten


def reduced_dims(view: OpView, dims_arg_index: int = 1) -> tuple[list[int], bool]:
    """(normalized reduced dims, keepdim) from the op's (dim, keepdim) arguments; no dim means all."""
    nd = len(view.in_shapes[0])
    dims = view.arg(dims_arg_index)
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(nd))
    elif isinstance(dims, int):
        dims = [dims]
    keepdim = bool(view.arg(dims_arg_index + 1, False)) if len(view.node.args) > dims_arg_index + 1 else \
        bool(view.node.kwargs.get("keepdim", False))
    return sorted(norm_dim(d, nd) for d in dims), keepdim


def kept_mapping(nd: int, reduced: list[int], keepdim: bool) -> dict[int, int]:
    out, k = {}, 0
    for i in range(nd):
        if i in reduced:
            k += 1 if keepdim else 0
            continue
        out[i] = k
        k += 1
    return out


def _kept_rules(view: OpView, reduced: list[int], keepdim: bool) -> list[AxisRule]:
    shape = view.in_shapes[0]
    mapping = kept_mapping(len(shape), reduced, keepdim)
    return [AxisRule((Shard(i),), Shard(o)) for i, o in mapping.items() if shape[i] > 1]


@register(aten.sum)
def sum_rule(view: OpView) -> list[AxisRule]:
    dims, keepdim = reduced_dims(view) if len(view.node.args) > 1 or "dim" in view.node.kwargs else \
        (list(range(len(view.in_shapes[0]))), False)
    shape = view.in_shapes[0]
    partial = [AxisRule((Shard(d),), P) for d in dims if shape[d] > 1]
    return _kept_rules(view, dims, keepdim) + partial + [AxisRule((P,), P)]


@register(aten.mean)
def mean_rule(view: OpView) -> list[AxisRule]:
    dims, keepdim = reduced_dims(view) if len(view.node.args) > 1 or "dim" in view.node.kwargs else \
        (list(range(len(view.in_shapes[0]))), False)
    shape = view.in_shapes[0]
    partial = [AxisRule((Shard(d),), P, "mean_partial") for d in dims if shape[d] > 1]
    return _kept_rules(view, dims, keepdim) + partial + [AxisRule((P,), P)]


# max/min are registered per overload: their ``other`` overloads are elementwise (pointwise.py).
@register(aten.amax, aten.amin, aten.argmax, aten.argmin, aten.max.default, aten.max.dim, aten.min.default,
          aten.min.dim, aten.logsumexp, aten.any, aten.all, aten.prod)
def extremum_rule(view: OpView) -> list[AxisRule]:
    if len(view.node.args) < 2 and "dim" not in view.node.kwargs:
        return []  # full reduction to a scalar: keep replicated
    dims, keepdim = reduced_dims(view)
    return _kept_rules(view, dims, keepdim)


@register(aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax, aten.cumsum, aten.cumprod)
def along_dim_rule(view: OpView) -> list[AxisRule]:
    shape = view.in_shapes[0]
    dim = norm_dim(view.arg(1), len(shape))
    return [AxisRule((Shard(i),), Shard(i)) for i in range(len(shape)) if i != dim and shape[i] > 1]


@register(aten.diff)
def diff_rule(view: OpView) -> list[AxisRule]:
    """diff along ``dim`` needs the whole of that dim; every other dim keeps its shard (no prepend/append)."""
    shape = view.in_shapes[0]
    if view.n_in != 1:
        return []
    dim = norm_dim(view.kwarg("dim", -1), len(shape))
    return [AxisRule((Shard(i),), Shard(i)) for i in range(len(shape)) if i != dim and shape[i] > 1]
