"""Elementwise ops with broadcasting: shard any output dim; inputs follow where they are not broadcast.

Output dim d maps to input dim ``d - (out_ndim - in_ndim)`` (right alignment). An input whose dim has
size 1 there (or that lacks it) is broadcast and stays Replicate. Partial passes through only where the
op is linear in that operand:
  * ``add``/``sub`` of tensors: all operands Partial (their summands add up); a scalar term would be
    added W times, so it forbids Partial;
  * ``mul``/``div`` (numerator only): one operand Partial, the others Replicate;
  * copies and casts (``clone``, ``to``, ``alias``, ``neg``, ``detach_``, ...): Partial in, Partial out.
"""
from __future__ import annotations

import numbers

import torch
from torch.distributed.tensor import Shard

from autopar.ir.ops import OpView
from autopar.passes.strategies.base import AxisRule
from autopar.passes.strategies.registry import register
from autopar.placement import P, R

aten = torch.ops.aten

NONLINEAR = [
    aten.gelu, aten.relu, aten.silu, aten.sigmoid, aten.tanh, aten.exp, aten.log, aten.pow, aten.sqrt,
    aten.rsqrt, aten.abs, aten.erf, aten.sin, aten.cos, aten.reciprocal, aten.clamp, aten.clamp_min,
    aten.clamp_max, aten.minimum, aten.maximum, aten.where, aten.masked_fill, aten.dropout,
    aten.native_dropout, aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge, aten.logical_and,
    aten.logical_or, aten.logical_not, aten.bitwise_and, aten.bitwise_or, aten.bitwise_not, aten.__and__,
    aten.__or__, aten.hardtanh, aten.leaky_relu, aten.elu, aten.softplus, aten.mish, aten.hardswish,
    aten.hardsigmoid, aten.square, aten.log1p, aten.expm1, aten.sign, aten.floor, aten.ceil, aten.round,
    aten.fill, aten.zeros_like, aten.ones_like, aten.full_like, aten.empty_like, aten.rand_like,
    aten.randn_like, aten.lerp, aten.addcmul, aten.addcdiv, aten.isnan, aten.isinf, aten.nan_to_num,
    aten.remainder, aten.fmod, aten.floor_divide, aten.tril, aten.triu, aten.bitwise_xor, aten.logical_xor,
    aten.max.other, aten.min.other,  # elementwise overloads; the reducing ones are in reductions.py
]
SUMS = [aten.add, aten.sub, aten.rsub]
SCALES = [aten.mul, aten.div]
COPIES = [aten.neg, aten.clone, aten.contiguous, aten.alias, aten.to, aten._to_copy, aten.type_as,
          aten.detach, aten.detach_, aten.lift_fresh_copy, aten.positive]


def broadcast_rules(view: OpView) -> list[AxisRule]:
    """Shard each output dim of size > 1; inputs broadcast along it stay Replicate."""
    out_shape = view.out_shape
    if out_shape is None:
        return []
    rules = []
    for d in range(len(out_shape)):
        if out_shape[d] <= 1:
            continue
        inputs = []
        for shape in view.in_shapes:
            offset = len(out_shape) - len(shape or ())
            j = d - offset
            sharded = shape is not None and 0 <= j < len(shape) and shape[j] == out_shape[d]
            inputs.append(Shard(j) if sharded else R)
        if any(p.is_shard() for p in inputs):
            rules.append(AxisRule(tuple(inputs), Shard(d)))
    return rules


def _has_scalar_operand(view: OpView) -> bool:
    args = list(view.node.args[:2])
    return any(isinstance(a, numbers.Number) and not isinstance(a, bool) for a in args)


@register(*NONLINEAR)
def nonlinear_rule(view: OpView) -> list[AxisRule]:
    if view.target in (aten.tril.default, aten.triu.default):
        return [r for r in broadcast_rules(view) if r.output.dim < view.out_ndim - 2]
    return broadcast_rules(view)


@register(*SUMS)
def sum_rule(view: OpView) -> list[AxisRule]:
    rules = broadcast_rules(view)
    if view.n_in >= 2 and not _has_scalar_operand(view) and all(s == view.out_shape for s in view.in_shapes):
        rules.append(AxisRule(tuple(P for _ in range(view.n_in)), P))
    return rules


@register(*SCALES)
def scale_rule(view: OpView) -> list[AxisRule]:
    rules = broadcast_rules(view)
    candidates = range(1 if view.target.overloadpacket is aten.div else view.n_in)
    for i in candidates:
        if view.in_shapes[i] == view.out_shape:
            rules.append(AxisRule(tuple(P if j == i else R for j in range(view.n_in)), P))
    return rules


@register(*COPIES)
def copy_rule(view: OpView) -> list[AxisRule]:
    rules = broadcast_rules(view)
    out_val = view.out_vals[0] if view.out_vals else None
    if view.n_in == 1 and out_val is not None and out_val.dtype.is_floating_point:
        rules.append(AxisRule((P,), P))
    return rules
