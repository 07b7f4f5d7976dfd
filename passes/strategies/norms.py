"""Normalization layers: layer_norm, native_layer_norm, rms_norm.

Statistics run over the trailing ``normalized_shape`` dims, which must be whole on each device; any
leading dim (batch, sequence) may be sharded, with weight and bias replicated. Sharding the hidden dim
would need an all-reduce of the statistics inside the op, which ATen's kernel cannot do; a plan that
wants it gathers first, and the ILP prices that.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from autopar.ir.ops import OpView
from autopar.passes.strategies.base import AxisRule
from autopar.passes.strategies.registry import register
from autopar.placement import R

aten = torch.ops.aten


@register(aten.layer_norm, aten.native_layer_norm, aten.rms_norm, aten._fused_rms_norm)
def norm_rule(view: OpView) -> list[AxisRule]:
    shape = view.in_shapes[0]
    n_norm = len(view.arg(1))
    rules = []
    for d in range(len(shape) - n_norm):
        if shape[d] > 1:
            rules.append(AxisRule((Shard(d),) + (R,) * (view.n_in - 1), Shard(d)))
    return rules
