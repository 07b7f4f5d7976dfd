"""Convolutional nets: convolution, batch norm, group norm (batch only), max / average / adaptive pooling.

Convolution, input [N, C_in, *spatial], weight [C_out, C_in / groups, *kernel], bias [C_out] -> out
[N, C_out, *spatial'], written per mesh axis like an einsum over (N, C_out, C_in) (see ``matmul``):
  * batch split: input Shard(0), weight and bias Replicate -> output Shard(0) (data parallel);
  * output-channel split: weight and bias Shard(0), input Replicate -> output Shard(1);
  * input-channel split: input Shard(1), weight Shard(1) -> output Partial; the bias is added by every
    device, so it is scaled by 1/W (``scale_additive``) and the W summands add it once.
Grouped convolutions (groups > 1) get the batch split only. Spatial dims are never split (a local
window would need a halo from its neighbours). Transposed convolutions get the batch split only.

Batch norm in training mode (``batch_norm``, ``native_batch_norm``, ``_native_batch_norm_legit*``):
statistics run per channel over (N, spatial), so a channel split (input Shard(1), weight / bias /
running stats Shard(0)) is exact. A batch split would compute per-shard statistics: what DDP without
SyncBatchNorm does, but not what one device computes; it is offered only when
``LOCAL_BATCH_NORM_STATS`` is set (for planning studies), never by default.

Group norm (``group_norm``): statistics are per sample, so the batch split is exact; a channel split would
need the local group count (num_groups / W) in the op's arguments, which ATen's kernel takes as given, so it
is not offered (models that want it write the norm with view + mean, see examples/wide_resnet.py).

Pooling (``max_pool*``, ``avg_pool*``, ``adaptive_*_pool*``, with or without indices): windows never cross
the batch or channel dims, so either may be split; the outputs (values and indices) follow.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from autopar.ir.ops import OpView
from autopar.passes.strategies.base import AxisRule, aten_ops
from autopar.passes.strategies.registry import register
from autopar.placement import P, R

aten = torch.ops.aten

LOCAL_BATCH_NORM_STATS = False  # offer the inexact batch split of batch norm (per-shard statistics)


def _conv_flags(view: OpView) -> tuple[bool, int]:
    """(transposed, groups) of a convolution-family op (conv2d has no ``transposed`` argument)."""
    if view.target.overloadpacket in (aten.convolution, aten._convolution):
        return bool(view.arg(6, False)), int(view.arg(8, 1))
    return False, int(view.kwarg("groups", 1) or 1)


@register(*aten_ops("convolution", "_convolution", "conv1d", "conv2d", "conv3d"))
def convolution_rule(view: OpView) -> list[AxisRule]:
    x, w = view.in_shapes[0], view.in_shapes[1]
    has_bias = view.n_in == 3
    transposed, groups = _conv_flags(view)
    tail = (R,) if has_bias else ()
    rules = [AxisRule((Shard(0), R) + tail, Shard(0))] if x[0] > 1 else []
    if transposed or groups != 1:
        return rules
    if w[0] > 1:
        rules.append(AxisRule((R, Shard(0)) + ((Shard(0),) if has_bias else ()), Shard(1)))
    if x[1] > 1:
        rules.append(AxisRule((Shard(1), Shard(1)) + tail, P, "scale_additive" if has_bias else None))
    return rules


BATCH_NORMS = aten_ops("batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                       "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training")


@register(*BATCH_NORMS)
def batch_norm_rule(view: OpView) -> list[AxisRule]:
    """Channel split (per-channel tensors Shard(0)). The multi-output variants (output and per-channel
    statistics) stay replicated: one AxisRule gives every output the same placement, and no placement fits
    both [N, C, ...] and [C]. torch.export's training IR captures nn.BatchNorm as single-output batch_norm."""
    x = view.in_shapes[0]
    per_channel = [s is not None and len(s) == 1 for s in view.in_shapes[1:]]
    if len(view.out_vals) > 1:
        return []  # outputs of different ranks (y [N, C, ...] and stats [C]): no single placement fits all
    rules = []
    if x[1] > 1:
        rules.append(AxisRule((Shard(1),) + tuple(Shard(0) if c else R for c in per_channel), Shard(1)))
    if LOCAL_BATCH_NORM_STATS and x[0] > 1:
        rules.append(AxisRule((Shard(0),) + (R,) * len(per_channel), Shard(0)))
    return rules


@register(*aten_ops("group_norm"))
def group_norm_rule(view: OpView) -> list[AxisRule]:
    x = view.in_shapes[0]
    return [AxisRule((Shard(0),) + (R,) * (view.n_in - 1), Shard(0))] if x[0] > 1 else []


POOLS = aten_ops("max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices", "max_pool3d_with_indices",
                 "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
                 "adaptive_avg_pool3d", "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_max_pool1d",
                 "adaptive_max_pool2d", "adaptive_max_pool3d")
SPATIAL_DIMS = {"1d": 1, "2d": 2, "3d": 3}


def _spatial_dims(view: OpView) -> int:
    name = view.target.overloadpacket.__name__
    return next(n for suffix, n in SPATIAL_DIMS.items() if suffix in name)


@register(*POOLS)
def pool_rule(view: OpView) -> list[AxisRule]:
    """Leading dims (batch, channels; only channels for an unbatched input) split; windows stay whole."""
    x = view.in_shapes[0]
    leading = len(x) - _spatial_dims(view)
    return [AxisRule((Shard(d),), Shard(d)) for d in range(leading) if x[d] > 1]
