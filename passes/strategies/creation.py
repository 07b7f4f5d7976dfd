"""Tensor factories: arange, zeros, ones, full, empty, scalar_tensor, new_* .

Factories without tensor inputs stay replicated (they are cheap, and a sharded arange would need
rank offsets). ``new_zeros``-style ops read only their input's dtype and device, so that input may
arrive in any layout at no cost; their output is replicated.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from autopar.ir.ops import OpView
from autopar.passes.strategies.base import AxisRule, aten_ops
from autopar.passes.strategies.registry import register
from autopar.placement import P, R

aten = torch.ops.aten


@register(*aten_ops("arange", "zeros", "ones", "full", "empty", "scalar_tensor", "eye", "linspace"))
def factory_rule(view: OpView) -> list[AxisRule]:
    return []


@register(*aten_ops("new_zeros", "new_ones", "new_full", "new_empty"))
def new_factory_rule(view: OpView) -> list[AxisRule]:
    shape = view.in_shapes[0] or ()
    return [AxisRule((Shard(d),), R) for d in range(len(shape)) if shape[d] > 1] + [AxisRule((P,), R)]
