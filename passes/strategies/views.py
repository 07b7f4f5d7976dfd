"""Views and data movement: reshape, permute, squeeze, slice, split, cat, expand, pad, getitem.

These ops move no values between devices when the sharded dim maps to one output dim. For a reshape,
``reshape_groups`` pairs input dims with output dims of equal total size; only a group's *major* dim
(its first dim of size > 1) may carry a shard, since a shard of a minor dim is not a contiguous block of
the merged or split dim. Sliced, split or concatenated dims never carry a shard. Partial passes through
every op here (they are all linear).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from autopar.ir.ops import OpView, getitem_op
from autopar.passes.strategies.base import AxisRule, norm_dim
from autopar.passes.strategies.registry import register
from autopar.placement import P, R

aten = torch.ops.aten


def dim_map_rules(view: OpView, mapping: dict[int, int], partial: bool = True) -> list[AxisRule]:
    """Rules for a single-input op where input dim i becomes output dim mapping[i] unchanged."""
    rules = [AxisRule((Shard(i),) + (R,) * (view.n_in - 1), Shard(o)) for i, o in mapping.items()
             if view.in_shapes[0][i] > 1]
    if partial:
        rules.append(AxisRule((P,) + (R,) * (view.n_in - 1), P))
    return rules


def reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair dims of ``src`` and ``dst`` into groups of equal product, left to right."""
    groups, i, j = [], 0, 0
    while i < len(src) and j < len(dst):
        ins, outs, pi, po = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != po:
            if pi < po and i < len(src):
                ins.append(i)
                pi *= src[i]
                i += 1
            elif j < len(dst):
                outs.append(j)
                po *= dst[j]
                j += 1
            else:
                break
        groups.append((ins, outs))
    return groups


def _major(dims: list[int], shape: tuple[int, ...]) -> int | None:
    return next((d for d in dims if shape[d] > 1), None)


@register(aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten, aten.view_as,
          aten.reshape_as)
def reshape_rule(view: OpView) -> list[AxisRule]:
    src, dst = view.in_shapes[0], view.out_shape
    mapping = {}
    for ins, outs in reshape_groups(src, dst):
        mi, mo = _major(ins, src), _major(outs, dst)
        if mi is not None and mo is not None:
            mapping[mi] = mo
    return dim_map_rules(view, mapping)


@register(aten.permute)
def permute_rule(view: OpView) -> list[AxisRule]:
    nd = len(view.in_shapes[0])
    dims = [norm_dim(d, nd) for d in view.arg(1)]
    return dim_map_rules(view, {d: k for k, d in enumerate(dims)})


@register(aten.transpose)
def transpose_rule(view: OpView) -> list[AxisRule]:
    nd = len(view.in_shapes[0])
    a, b = norm_dim(view.arg(1), nd), norm_dim(view.arg(2), nd)
    mapping = {d: d for d in range(nd)}
    mapping[a], mapping[b] = b, a
    return dim_map_rules(view, mapping)


@register(aten.t, aten.numpy_T)
def t_rule(view: OpView) -> list[AxisRule]:
    nd = len(view.in_shapes[0])
    return dim_map_rules(view, {d: nd - 1 - d for d in range(nd)})


@register(aten.unsqueeze)
def unsqueeze_rule(view: OpView) -> list[AxisRule]:
    nd = len(view.in_shapes[0])
    d = norm_dim(view.arg(1), nd + 1)
    return dim_map_rules(view, {i: (i if i < d else i + 1) for i in range(nd)})


@register(aten.squeeze)
def squeeze_rule(view: OpView) -> list[AxisRule]:
    src, dst = view.in_shapes[0], view.out_shape
    kept = [i for i in range(len(src)) if not (src[i] == 1 and len(dst) < len(src) and _squeezed(view, i))]
    return dim_map_rules(view, {i: k for k, i in enumerate(kept)})


def _squeezed(view: OpView, i: int) -> bool:
    dims = view.arg(1)
    if dims is None:
        return True
    dims = [dims] if isinstance(dims, int) else list(dims)
    return i in [norm_dim(d, len(view.in_shapes[0])) for d in dims]


@register(aten.expand)
def expand_rule(view: OpView) -> list[AxisRule]:
    src, dst = view.in_shapes[0], view.out_shape
    off = len(dst) - len(src)
    rules = []
    for d in range(len(dst)):
        j = d - off
        if j >= 0 and src[j] == dst[d] and dst[d] > 1:
            rules.append(AxisRule((Shard(j),), Shard(d)))
        elif dst[d] > 1:
            rules.append(AxisRule((R,), Shard(d)))  # expand a replicated input straight to a local slice
    return rules + [AxisRule((P,), P)]


@register(aten.slice, aten.narrow)
def slice_rule(view: OpView) -> list[AxisRule]:
    src, dst = view.in_shapes[0], view.out_shape
    nd = len(src)
    dim = norm_dim(view.arg(1, 0), nd)
    mapping = {i: i for i in range(nd) if i != dim or src[i] == dst[i]}
    return dim_map_rules(view, mapping)


@register(aten.select)
def select_rule(view: OpView) -> list[AxisRule]:
    nd = len(view.in_shapes[0])
    dim = norm_dim(view.arg(1), nd)
    return dim_map_rules(view, {i: (i if i < dim else i - 1) for i in range(nd) if i != dim})


@register(aten.split, aten.split_with_sizes, aten.chunk, aten.tensor_split)
def split_rule(view: OpView) -> list[AxisRule]:
    nd = len(view.in_shapes[0])
    dim = norm_dim(view.arg(2, 0), nd)
    return dim_map_rules(view, {i: i for i in range(nd) if i != dim})


@register(aten.unbind)
def unbind_rule(view: OpView) -> list[AxisRule]:
    nd = len(view.in_shapes[0])
    dim = norm_dim(view.arg(1, 0), nd)
    return dim_map_rules(view, {i: (i if i < dim else i - 1) for i in range(nd) if i != dim})


@register(getitem_op())
def getitem_rule(view: OpView) -> list[AxisRule]:
    shape = view.in_shapes[0]
    if shape is None:
        return []
    return dim_map_rules(view, {i: i for i in range(len(shape))})


@register(aten.cat, aten.concat)
def cat_rule(view: OpView) -> list[AxisRule]:
    shape = view.out_shape
    dim = norm_dim(view.arg(1, 0), len(shape))
    same_rank = all(s is not None and len(s) == len(shape) for s in view.in_shapes)
    if not same_rank:
        return []
    rules = [AxisRule(tuple(Shard(d) for _ in range(view.n_in)), Shard(d))
             for d in range(len(shape)) if d != dim and shape[d] > 1]
    return rules + [AxisRule(tuple(P for _ in range(view.n_in)), P)]


@register(aten.stack)
def stack_rule(view: OpView) -> list[AxisRule]:
    shape = view.out_shape
    dim = norm_dim(view.arg(1, 0), len(shape))
    rules = [AxisRule(tuple(Shard(i) for _ in range(view.n_in)), Shard(i if i < dim else i + 1))
             for i in range(len(shape) - 1) if view.in_shapes[0][i] > 1]
    return rules + [AxisRule(tuple(P for _ in range(view.n_in)), P)]


@register(aten.broadcast_tensors)
def broadcast_tensors_rule(view: OpView) -> list[AxisRule]:
    """Every output has the broadcast shape: shard it where an input is not broadcast."""
    from autopar.passes.strategies.pointwise import broadcast_rules

    return broadcast_rules(view) + [AxisRule(tuple(P for _ in range(view.n_in)), P)]


@register(aten.pad, aten.constant_pad_nd)
def pad_rule(view: OpView) -> list[AxisRule]:
    src, dst = view.in_shapes[0], view.out_shape
    return dim_map_rules(view, {i: i for i in range(len(src)) if src[i] == dst[i]}, partial=False)
