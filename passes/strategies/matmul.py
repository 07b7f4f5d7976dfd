"""Matmul family as einsum strings: mm "mk,kn->mn", bmm "bmk,bkn->bmn", linear "...k,nk->...n", ...

For one mesh axis, ``einsum_rules`` proposes:
  * shard a label that survives to the output: inputs carrying it are Shard(its dim), the others
    Replicate, the output Shard (data parallel on a batch label, column-parallel on n);
  * shard a contracted label: inputs carrying it are Shard, the output is Partial (row-parallel);
    an additive input (bias) lacks the label and is scaled by 1/W so the W summands add it once.
A size-1 (broadcast) dim never carries a shard: that input stays Replicate.
"""
from __future__ import annotations

import string

import torch
from torch.distributed.tensor import Shard

from autopar.ir.ops import OpView
from autopar.passes.strategies.base import AxisRule
from autopar.passes.strategies.registry import register
from autopar.placement import P, R

aten = torch.ops.aten


def einsum_rules(view: OpView, in_labels: list[str | None], out_labels: str,
                 additive: set[int] = frozenset()) -> list[AxisRule]:
    """AxisRules for an einsum-like op; ``in_labels[i]`` labels tensor input i (None: always Replicate)."""
    rules = []
    all_in = set("".join(labels for labels in in_labels if labels))
    for label in sorted(all_in | set(out_labels)):
        if label in out_labels:
            inputs = tuple(_shard_if(view, i, labels, label) for i, labels in enumerate(in_labels))
            if all(p.is_replicate() for p in inputs):
                continue  # every operand broadcasts this dim: nothing to split
            rules.append(AxisRule(inputs, Shard(out_labels.index(label))))
        elif sum(1 for labels in in_labels if labels and label in labels) >= 2:
            inputs = tuple(_shard_if(view, i, labels, label) for i, labels in enumerate(in_labels))
            kernel = "scale_additive" if any(i in additive for i in range(len(in_labels))) else None
            rules.append(AxisRule(inputs, P, kernel))
    return [r for r in rules if any(not p.is_replicate() for p in r.inputs + (r.output,))]


def _shard_if(view: OpView, i: int, labels: str | None, label: str):
    if not labels or label not in labels:
        return R
    dim = labels.index(label)
    shape = view.in_shapes[i]
    return Shard(dim) if shape is not None and shape[dim] > 1 else R


def _batch_labels(n: int) -> str:
    return string.ascii_uppercase[:n]


@register(aten.mm)
def mm_rule(view: OpView) -> list[AxisRule]:
    return einsum_rules(view, ["mk", "kn"], "mn")


@register(aten.addmm)
def addmm_rule(view: OpView) -> list[AxisRule]:
    bias = "mn"[2 - len(view.in_shapes[0]):] if view.in_shapes[0] else ""
    return einsum_rules(view, [bias, "mk", "kn"], "mn", additive={0})


@register(aten.bmm)
def bmm_rule(view: OpView) -> list[AxisRule]:
    return einsum_rules(view, ["bmk", "bkn"], "bmn")


@register(aten.baddbmm)
def baddbmm_rule(view: OpView) -> list[AxisRule]:
    bias = "bmn"[3 - len(view.in_shapes[0]):] if view.in_shapes[0] else ""
    return einsum_rules(view, [bias, "bmk", "bkn"], "bmn", additive={0})


@register(aten.linear)
def linear_rule(view: OpView) -> list[AxisRule]:
    """y = x @ w.T + b with x [..., k], w [n, k], b [n]."""
    batch = _batch_labels(len(view.in_shapes[0]) - 1)
    labels = [batch + "k", "nk"] + (["n"] if view.n_in == 3 else [])
    return einsum_rules(view, labels, batch + "n", additive={2} if view.n_in == 3 else set())


@register(aten.matmul)
def matmul_rule(view: OpView) -> list[AxisRule]:
    """Batched matmul with right-aligned broadcast batch dims; 1-D operands are left replicated."""
    a, b = view.in_shapes
    if len(a) < 2 or len(b) < 2:
        return []
    nbatch = max(len(a), len(b)) - 2
    batch = _batch_labels(nbatch)
    a_labels = batch[nbatch - (len(a) - 2):] + "mk"
    b_labels = batch[nbatch - (len(b) - 2):] + "kn"
    return einsum_rules(view, [a_labels, b_labels], batch + "mn")
