"""Classification losses: cross_entropy_loss and nll_loss on logits [N, C] and targets [N].

Per mesh axis:
  * shard the batch N: each device computes the loss of its rows. A sum is then a Partial; a mean is
    over the *counted* targets (``ignore_index`` excluded), so the local sum is divided by the global
    count, all-reduced over the axis (``ce_batch``); reduction "none" stays sharded.
  * shard the classes C (cross_entropy only; Megatron's vocab-parallel cross-entropy): the softmax's
    max and sum of exponentials, and the target logit, are all-reduced over the axis inside the op
    (``ce_class``); every device then holds the full loss (Replicate).
Class weights and label smoothing keep the op replicated.

Elementwise regression losses (mse, l1, smooth_l1, huber) may shard any dim of their equal-shape inputs:
"none" stays sharded, "sum" is Partial, "mean" is Partial scaled by 1/W (``mean_partial``, equal shards).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from autopar.ir.ops import OpView
from autopar.passes.strategies.base import AxisRule
from autopar.passes.strategies.registry import register
from autopar.placement import P, R

aten = torch.ops.aten

REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = 0, 1, 2


def _plain(view: OpView) -> bool:
    """2-D logits, 1-D targets, no class weights, no label smoothing."""
    if view.n_in != 2 or len(view.in_shapes[0]) != 2 or len(view.in_shapes[1]) != 1:
        return False
    return float(view.kwarg("label_smoothing", 0.0) or 0.0) == 0.0


def _batch_rule(view: OpView) -> AxisRule:
    reduction = view.kwarg("reduction", REDUCTION_MEAN)
    if reduction == REDUCTION_NONE:
        return AxisRule((Shard(0), Shard(0)), Shard(0))
    return AxisRule((Shard(0), Shard(0)), P, "ce_batch" if reduction == REDUCTION_MEAN else None)


@register(aten.cross_entropy_loss)
def cross_entropy_rule(view: OpView) -> list[AxisRule]:
    if not _plain(view):
        return []
    rules = [_batch_rule(view)] if view.in_shapes[0][0] > 1 else []
    if view.in_shapes[0][1] > 1:
        rules.append(AxisRule((Shard(1), R), R, "ce_class"))
    return rules


@register(aten.nll_loss, aten.nll_loss_nd, aten.nll_loss_forward)
def nll_loss_rule(view: OpView) -> list[AxisRule]:
    if not _plain(view) or view.target.overloadpacket is aten.nll_loss_forward:
        return []
    return [_batch_rule(view)] if view.in_shapes[0][0] > 1 else []


@register(aten.mse_loss, aten.l1_loss, aten.smooth_l1_loss, aten.huber_loss)
def elementwise_loss_rule(view: OpView) -> list[AxisRule]:
    shape = view.in_shapes[0]
    if any(s != shape for s in view.in_shapes):
        return []
    reduction = view.kwarg("reduction", REDUCTION_MEAN)
    rules = []
    for d in range(len(shape)):
        if shape[d] <= 1:
            continue
        shards = (Shard(d),) * view.n_in
        if reduction == REDUCTION_NONE:
            rules.append(AxisRule(shards, Shard(d)))
        else:
            rules.append(AxisRule(shards, P, "mean_partial" if reduction == REDUCTION_MEAN else None))
    return rules
