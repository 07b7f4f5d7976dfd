"""Local kernels for ops whose sharded form is not the ATen op on local shards.

``vocab_parallel_embedding``: the table is split by rows; a rank reads zero for indices it does not own,
so summing over the group (the Partial output's all-reduce) gives the lookup.

``sharded_cross_entropy``: logits [N, C] with rows split over ``batch_groups`` and/or classes split over
``class_groups``. With class shards (Megatron's vocab-parallel cross-entropy), per row i:

    m_i = max_c z_ic  (all-reduce MAX)      s_i = Σ_c exp(z_ic − m_i)  (all-reduce SUM)
    t_i = z_{i,y_i} − m_i on the rank owning y_i, 0 elsewhere  (all-reduce SUM)
    loss_i = log s_i − t_i,      ∂loss_i/∂z_ic = softmax_ic − [c = y_i]

With row shards, a mean is the local sum divided by the *global* count of counted targets
(``ignore_index`` excluded), so each rank's value is a summand of the true mean (a Partial).

``local_experts_grouped_mm``: expert parallelism for ``transformers``' grouped expert matmul (see
``passes/strategies/experts.py``): this rank holds experts [e0, e0 + n) and computes their rows only, kept
compact (``EXPERT_ROWS``) until ``pad_expert_rows`` puts them back among all rows as a plain Partial.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.runtime import faults, groups, traced_collectives

REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def vocab_parallel_embedding(weight: torch.Tensor, indices: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """Rows [vocab_start, vocab_start + weight.shape[0]) of the table; zero for other indices."""
    local = indices - vocab_start
    outside = (local < 0) | (local >= weight.shape[0])
    rows = F.embedding(local.masked_fill(outside, 0), weight)
    return rows * (~outside).unsqueeze(-1).to(rows.dtype)


def local_experts_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, first_expert: int,
                             native: bool, x_rows: bool, pad: bool, total_rows: int) -> torch.Tensor:
    """The rows of x [S, K] routed to the local experts ``weight`` [n, K, N], each times its expert.

    ``offs`` [E] are the global cumulative row ends, so the local rows are the slice [lo, hi) =
    [offs[e0 - 1], offs[e0 + n - 1]), and their local offsets are those ends minus lo. ``x_rows``: x holds
    only those rows already (an EXPERT_ROWS input), else x is whole and is sliced. The result is those rows
    only (EXPERT_ROWS), or with ``pad`` all ``total_rows``, zero outside [lo, hi) (a plain Partial).
    ``native``: the graph's op was ``aten._grouped_mm`` (bf16 models), else ``transformers``' fallback."""
    ends = offs[first_expert:first_expert + weight.shape[0]]
    lo = int(offs[first_expert - 1]) if first_expert > 0 else 0
    local = x if x_rows else x[lo:int(ends[-1])]
    if native:
        rows = torch.ops.aten._grouped_mm(local, weight, ends - lo)
    else:
        rows = torch.ops.transformers.grouped_mm_fallback(local, weight, ends - lo)
    return pad_expert_rows(rows, offs, first_expert, total_rows) if pad else rows


def pad_expert_rows(rows: torch.Tensor, offs: torch.Tensor, first_expert: int, total_rows: int) -> torch.Tensor:
    """An EXPERT_ROWS value (this device's rows, from row offs[first_expert - 1] on) as a plain Partial: all
    ``total_rows`` rows, zero outside its own."""
    lo = int(offs[first_expert - 1]) if first_expert > 0 else 0
    return F.pad(rows, (0, 0) * (rows.dim() - 1) + (lo, total_rows - lo - rows.shape[0]))


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _reduce(x: torch.Tensor, keys: list[str], op: str = "sum") -> torch.Tensor:
    """``x`` reduced over each group of ``keys`` (in place when eager; a functional collective when traced)."""
    for key in keys:
        if torch.compiler.is_compiling():
            x = traced_collectives.all_reduce(x, key, op)
        else:
            faults.guard("all_reduce", key, dist.all_reduce, x, op=_OPS[op], group=groups.get(key))
    return x


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, class_start, ignore_index, class_keys):
        z = logits.float()
        m = _reduce(z.max(dim=-1).values.clone(), class_keys, "max")
        shifted = z - m.unsqueeze(-1)
        e = shifted.exp()
        s = _reduce(e.sum(dim=-1), class_keys)
        local_t = target - class_start
        owned = (local_t >= 0) & (local_t < z.shape[-1]) & (target != ignore_index)
        safe_t = local_t.masked_fill(~owned, 0)
        t = shifted.gather(-1, safe_t.unsqueeze(-1)).squeeze(-1) * owned
        t = _reduce(t, class_keys)
        loss = s.log() - t
        ctx.save_for_backward(e / s.unsqueeze(-1), safe_t, owned)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, safe_t, owned = ctx.saved_tensors
        g = softmax * grad.unsqueeze(-1)
        g.scatter_add_(-1, safe_t.unsqueeze(-1), -(grad * owned).unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None, None


def sharded_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, reduction: int = 1,
                          ignore_index: int = -100, class_groups: tuple = (), class_start: int = 0,
                          batch_groups: tuple = ()) -> torch.Tensor:
    """Cross-entropy of local logits (see module docstring); reduction codes follow ATen (0/1/2)."""
    valid = target != ignore_index
    if class_groups:
        per_row = _VocabParallelCE.apply(logits, target, class_start, ignore_index, list(class_groups))
        per_row = per_row * valid
    else:
        per_row = F.cross_entropy(logits, target, reduction="none", ignore_index=ignore_index)
    return _finish(per_row, valid, reduction, batch_groups)


def sharded_nll_loss(log_probs: torch.Tensor, target: torch.Tensor, *, reduction: int = 1,
                     ignore_index: int = -100, batch_groups: tuple = ()) -> torch.Tensor:
    """nll_loss on local rows; a mean divides by the global count of counted targets."""
    per_row = F.nll_loss(log_probs, target, reduction="none", ignore_index=ignore_index)
    return _finish(per_row, target != ignore_index, reduction, batch_groups)


def _finish(per_row: torch.Tensor, valid: torch.Tensor, reduction: int, batch_groups) -> torch.Tensor:
    if REDUCTIONS[reduction] == "none":
        return per_row
    total = per_row.sum()
    if REDUCTIONS[reduction] == "sum":
        return total
    count = _reduce(valid.sum().to(per_row.dtype).detach().clone(), list(batch_groups))
    return total / count
