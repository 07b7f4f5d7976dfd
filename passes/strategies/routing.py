"""Routing helpers of mixture-of-experts layers: one_hot.

``one_hot(indices [...], C) -> [..., C]``: every index maps to its own row of C classes, so any dim of the
indices may be split and the output follows on the same dim; the class dim is created whole on each
device (a class split would need each device to know its class offset). Integer outputs carry no
gradient, so Partial never arises here.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from autopar.ir.ops import OpView
from autopar.passes.strategies.base import AxisRule, norm_dim
from autopar.passes.strategies.registry import register
from autopar.placement import P, R

aten = torch.ops.aten


@register(aten.one_hot)
def one_hot_rule(view: OpView) -> list[AxisRule]:
    shape = view.in_shapes[0]
    return [AxisRule((Shard(d),), Shard(d)) for d in range(len(shape)) if shape[d] > 1]


@register(aten.index.Tensor)
def index_rule(view: OpView) -> list[AxisRule]:
    """``x[i0, i1, ...]`` with index tensors on leading dims 0..n-1 (the form tokens-to-experts dispatch and
    position lookups take): out = broadcast(index shape) + x.shape[n:]. A trailing dim of x keeps its
    shard (indices Replicate); a dim of a single index tensor splits the output on that dim (x Replicate).
    A gather is linear in x: x Partial gives a Partial output (the experts' un-permute reads them so)."""
    indices = view.arg(1)
    if not indices or any(i is None for i in indices):
        return []
    x_shape, n = view.in_shapes[0], len(indices)
    lead = len(view.out_shape) - (len(x_shape) - n)
    rules = [AxisRule((Shard(d),) + (R,) * n, Shard(lead + d - n)) for d in range(n, len(x_shape)) if x_shape[d] > 1]
    if n == 1:
        idx_shape = view.in_shapes[1]
        rules += [AxisRule((R, Shard(d)), Shard(d)) for d in range(len(idx_shape)) if idx_shape[d] > 1]
    if view.out_vals and view.out_vals[0].dtype.is_floating_point:
        rules.append(AxisRule((P,) + (R,) * n, P))
    return rules


@register(aten.gather)
def gather_rule(view: OpView) -> list[AxisRule]:
    """``gather(x, dim, index)``: out has index's shape; a dim other than ``dim`` where x and index agree
    may be split on both (each device gathers within its own slice)."""
    x_shape, idx_shape = view.in_shapes[0], view.in_shapes[1]
    dim = norm_dim(view.arg(1), len(x_shape))
    return [AxisRule((Shard(d), Shard(d)), Shard(d)) for d in range(len(x_shape))
            if d != dim and x_shape[d] == idx_shape[d] and x_shape[d] > 1]
