"""Embedding lookup: weight [V, H], indices [...] -> out [..., H].

Per mesh axis: shard any indices dim (the output follows, the table is replicated: data parallel);
shard H (table Shard(1), output Shard on its last dim); or shard the vocabulary V (table Shard(0),
Megatron's vocab-parallel embedding): each device looks up only the rows it owns and reads zero for
the rest (``vocab_embedding``), so the output is Partial and one all-reduce completes it.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from autopar.ir.ops import OpView
from autopar.passes.strategies.base import AxisRule
from autopar.passes.strategies.registry import register
from autopar.placement import P, R

aten = torch.ops.aten


@register(aten.embedding)
def embedding_rule(view: OpView) -> list[AxisRule]:
    idx = view.in_shapes[1]  # weight: (vocab, hidden)
    rules = [AxisRule((R, Shard(d)), Shard(d)) for d in range(len(idx)) if idx[d] > 1]
    rules.append(AxisRule((Shard(1), R), Shard(len(idx))))
    rules.append(AxisRule((Shard(0), R), P, "vocab_embedding"))
    return rules
