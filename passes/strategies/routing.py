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
from autopar.passes.strategies import register
from autopar.passes.strategies.base import AxisRule

aten = torch.ops.aten


@register(aten.one_hot)
def one_hot_rule(view: OpView) -> list[AxisRule]:
    shape = view.in_shapes[0]
    return [AxisRule((Shard(d),), Shard(d)) for d in range(len(shape)) if shape[d] > 1]
