"""Scaled dot-product attention: q [..., L, E], k [..., S, E], v [..., S, Ev] -> out [..., L, Ev].

Per mesh axis, any leading dim (batch, heads) may be sharded on q, k, v and the output alike (heads
are independent: this is Megatron's attention split; with ``enable_gqa`` the heads of q and of k, v split
alike, each device keeping whole groups); the mask follows where it is not broadcast. The
query length L may be sharded with k and v replicated (context parallelism: reading k and v Replicate from
a sequence-split producer is the all-gather of keys and values, priced as any redistribution). With
``is_causal`` the local query block must know its offset: that rule carries the ``causal_context`` kernel
(``autopar/runtime/context_parallel.py``: prefix keys, lower-right mask, zig-zag load balance), only for
self-attention (S == L) and on one mesh axis at a time (``nested_context`` drops strategies splitting the
sequence on both axes). E and S are never sharded: the softmax runs over S and the scores contract E.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from autopar.ir.ops import OpView
from autopar.passes.strategies.base import AxisRule
from autopar.passes.strategies.registry import register
from autopar.placement import R

aten = torch.ops.aten


@register(aten.scaled_dot_product_attention)
def sdpa_rule(view: OpView) -> list[AxisRule]:
    q, k, v = view.in_shapes[:3]
    mask = view.in_shapes[3] if view.n_in > 3 else None
    nd = len(q)
    rules = []
    for d in range(nd - 2):
        if q[d] > 1 and (k[d] == q[d] or _grouped_heads(view, d, q, k)) and v[d] == k[d]:
            rules.append(AxisRule((Shard(d),) * 3 + _mask_placement(mask, nd, d, q[d]), Shard(d)))
    seq = Shard(nd - 2)
    if not view.kwarg("is_causal", False) and q[nd - 2] > 1:
        rules.append(AxisRule((seq, R, R) + _mask_placement(mask, nd, nd - 2, q[nd - 2]), seq))
    elif mask is None and q[nd - 2] > 1 and k[nd - 2] == q[nd - 2]:
        rules.append(AxisRule((seq, R, R), seq, kernel="causal_context"))
    return rules


def _grouped_heads(view: OpView, d: int, q: tuple, k: tuple) -> bool:
    """``enable_gqa``: q's heads (dim -3) read k's and v's in contiguous groups of q/k heads, so splitting both
    head dims into n equal blocks keeps every group with its key head on one device (shapes must divide)."""
    return view.kwarg("enable_gqa", False) and d == len(q) - 3 and 1 < k[d] < q[d] and q[d] % k[d] == 0


def nested_context(strategy) -> bool:
    """Whether a strategy splits a causal attention's sequence on more than one mesh axis (not supported:
    the load-balancing swap runs inside one axis's group)."""
    return sum(1 for _, tag in strategy.kernels if tag == "causal_context") > 1


def _mask_placement(mask: tuple[int, ...] | None, nd: int, d: int, size: int) -> tuple:
    if mask is None:
        return ()
    j = d - (nd - len(mask))
    return (Shard(j),) if 0 <= j < len(mask) and mask[j] == size else (R,)
