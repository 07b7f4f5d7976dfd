"""Mixture-of-experts layers of Hugging Face ``transformers``: the grouped expert matmul and its routing.

``transformers`` 5.x runs the experts of Mixtral, Qwen2-MoE and friends as
``grouped_mm(x [S, K], w [E, K, N], offs [E]) -> [S, N]``: the S token-expert rows are sorted by expert,
and expert e owns rows [offs[e-1], offs[e]) (offs[-1] = 0 implied). Which op export records depends on the
dtype: bf16 weights (what Mixtral-sized models train in) give PyTorch's own ``aten._grouped_mm``; fp32 under
export gives the custom op ``transformers::grouped_mm_fallback`` (a loop of ``mm``). Both get the same rule
(``aten._grouped_mm`` only in its MoE form: 2-D x, 3-D w, offsets given, no bias). Per axis:

* split N (the experts' output features): w Shard(2), x Replicate, out Shard(1) — tensor parallel;
* split K: x Shard(1), w Shard(1), out Partial — the op is linear in each operand;
* split E (expert parallel): w Shard(0) so each device holds E/W whole experts; x Replicate; each device
  computes only the rows of its own experts and writes zeros elsewhere (``local_experts``), so the sum
  over the axis is the full output: out ``EXPERT_ROWS``, a Partial whose rows live on one device each,
  which the expert MLP keeps up to its second matmul (``expert_rows.py``). Rows are contiguous per expert,
  so the local rows are one slice [offs[e0-1], offs[e1-1]) and the device calls the same grouped op on it
  (exact, differentiable).

The op is registered by name, since ``transformers`` registers it only when imported.

Routing ops: ``topk``/``sort`` along dim d keep every other dim's shard (the whole of d is needed);
``histc`` of a shard counts that shard's values, so the output is Partial (counts add up).
``index_put_`` writes scattered rows in place (the sort-inverse permutation): it stays replicated, since a
copy made by a redistribution would not alias the value it mutates.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from autopar.ir.expert_rows import is_grouped_mm
from autopar.ir.ops import OpView
from autopar.passes.strategies.base import AxisRule, norm_dim
from autopar.passes.strategies.registry import register
from autopar.placement import EXPERT_ROWS, P, R

aten = torch.ops.aten
GROUPED_MM_FALLBACK = "transformers.grouped_mm_fallback.default"


@register(GROUPED_MM_FALLBACK, aten._grouped_mm.default)
def grouped_mm_rule(view: OpView) -> list[AxisRule]:
    if not is_grouped_mm(view.node):
        return []
    (_, k), (experts, _, n) = view.in_shapes[0], view.in_shapes[1]
    rules = []
    if n > 1:
        rules.append(AxisRule((R, Shard(2), R), Shard(1)))
    if k > 1:
        rules.append(AxisRule((Shard(1), Shard(1), R), P))
    if experts > 1:
        rules.append(AxisRule((R, Shard(0), R), EXPERT_ROWS, "local_experts"))
    return rules


def _kept_dims(shape: tuple[int, ...], dim: int) -> list[AxisRule]:
    return [AxisRule((Shard(d),), Shard(d)) for d in range(len(shape)) if d != dim and shape[d] > 1]


@register(aten.topk)
def topk_rule(view: OpView) -> list[AxisRule]:
    shape = view.in_shapes[0]
    return _kept_dims(shape, norm_dim(view.kwarg("dim", -1), len(shape)))


@register(aten.sort)
def sort_rule(view: OpView) -> list[AxisRule]:
    shape = view.in_shapes[0]
    return _kept_dims(shape, norm_dim(view.kwarg("dim", -1), len(shape)))


@register(aten.histc)
def histc_rule(view: OpView) -> list[AxisRule]:
    shape = view.in_shapes[0]
    return [AxisRule((Shard(d),), P) for d in range(len(shape)) if shape[d] > 1]


@register(aten.index_put_)
def index_put_rule(view: OpView) -> list[AxisRule]:
    return []
