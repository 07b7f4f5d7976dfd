"""Expert-parallel kernels of the MoE experts op (``ir/moe_op.py``; rules in ``passes/strategies/moe_experts.py``).

``expert_all_to_all`` (all-to-all dispatch, as GShard, Tutel and Megatron do): on one mesh axis of W devices,
device d holds its own tokens (x, index, weights: Shard(0)) and experts [d·n, (d+1)·n) (n = E / W). Per device:

  1. keep: the capacity mask of its tokens (whole routing groups, so it is the one-device mask), or all;
  2. order the kept assignments (t·k + j) by expert, stable: destination devices come out contiguous;
     c[e] = assignments to expert e (E counts, E / W per destination);
  3. exchange the counts (all_to_all_single of c viewed [W, n]): r[s, e] = rows source s sends local expert e;
  4. send the rows x[t] of the ordered assignments with ``all_to_all_single`` (splits Σ_e c[d·n + e] out,
     Σ_e r[s, e] in, uneven; autograd: the backward is the reverse all-to-all of the gradients);
  5. regroup the received rows (by source, then expert) by local expert, run each expert on its rows,
     restore the by-source order and send them back the same way;
  6. un-permute: row i of what comes back is assignment order[i]; out[t] = Σ_j keep·weights[t, j]·row(t, j).

Each token row crosses the axis once per routed expert held elsewhere, and once back: rows moved per device
per direction ≈ T_local·k·(W - 1) / W with a balanced router (against T·k·(W - 1)/W rows for the gathered
split, which also needs the whole x on every device). Dropless by default: the splits carry whatever the
router sends, including zero rows to an expert or a device. Every collective goes through ``faults.guard``.
Under ``compile=True`` the kernel runs eagerly between compiled graphs (``torch.compiler.disable``): its
splits are read from the routing each step (``tolist``), and dynamo would specialize on every new value and
recompile; the compiled code on either side is compiled once.

``local_experts_op`` (the gather-based split, kept as an alternative): x, index, weights whole on every
device; each computes only the assignments to its own experts, so its output is a summand of the full one
(Partial over the axis).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.ir.moe_op import capacity_keep, combine, dispatch_order, expert_rows, experts_math
from autopar.runtime import devices, faults, groups


def local_experts_op(x, index, weights, w_in, w_out, *, n_experts: int, first: int, activation: str, gated: bool,
                     transposed: bool, capacity_factor: float | None, group_size: int) -> torch.Tensor:
    """The summand of the op's output from experts [first, first + w_in.shape[0]) (module docstring)."""
    return experts_math(x, index, weights, w_in, w_out, activation, gated, transposed, capacity_factor,
                        group_size, n_experts=n_experts, first=first)


@torch.compiler.disable  # splits are data (counts per step): traced, every new count would recompile
def expert_all_to_all(x, index, weights, w_in, w_out, *, group: str, n_experts: int, activation: str,
                      gated: bool, transposed: bool, capacity_factor: float | None,
                      group_size: int) -> torch.Tensor:
    """This device's token rows of the op's output, its experts computing for every device (module docstring)."""
    world, n_local = groups.size(group), w_in.shape[0]
    assert n_local * world == n_experts, f"{n_experts} experts do not split into {world} shards of {n_local}"
    keep = capacity_keep(index, n_experts, capacity_factor, group_size) if capacity_factor is not None else None
    order, counts = dispatch_order(index, keep, 0, n_experts)
    counts = torch.tensor(counts, dtype=torch.int64, device="cpu").view(world, n_local)
    received_counts = _exchange_counts(devices.to_wire(counts), group).cpu()  # splits are host lists
    sent_splits = counts.sum(1).tolist()
    received_splits = received_counts.sum(1).tolist()
    k = index.shape[1]
    received = AllToAll.apply(x[order // k], received_splits, sent_splits, group)
    by_expert, restore = (t.to(x.device) for t in _regroup(received_counts))
    done = expert_rows(received[by_expert], received_counts.sum(0).tolist(), w_in, w_out, activation, gated,
                       transposed)
    returned = AllToAll.apply(done[restore], sent_splits, received_splits, group)
    return unpermute(returned, order, weights, keep, x.dtype)


def unpermute(rows: torch.Tensor, order: torch.Tensor, weights, keep, out_dtype) -> torch.Tensor:
    """Row i of ``rows`` is assignment order[i]: weight them and sum each token's k assignments."""
    return combine(rows, order, weights, keep, out_dtype)


def _regroup(received_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(by_expert, restore): the permutation putting rows received by source (then local expert) in local
    expert order (stable: by source within an expert), and its inverse."""
    world, n_local = received_counts.shape
    experts = torch.arange(n_local, device=received_counts.device)
    expert_of_row = experts.repeat(world).repeat_interleave(received_counts.reshape(-1))
    by_expert = torch.sort(expert_of_row, stable=True).indices
    restore = torch.empty_like(by_expert)
    restore[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
    return by_expert, restore


def _exchange_counts(counts: torch.Tensor, group: str) -> torch.Tensor:
    """counts [W, n] (row d: what this device sends each expert of device d) -> [W, n] (row s: what
    device s sends each local expert)."""
    received = torch.empty_like(counts)
    faults.guard("all_to_all", group, dist.all_to_all_single, received.view(-1), counts.reshape(-1).contiguous(),
                 group=groups.get(group))
    return received


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: str) -> torch.Tensor:
    sent = devices.to_wire(x.contiguous())
    out = sent.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    faults.guard("all_to_all", group, dist.all_to_all_single, out, sent, out_splits, in_splits,
                 group=groups.get(group))
    return out.to(x.device)


class AllToAll(torch.autograd.Function):
    """Forward: all_to_all_single with uneven splits (send ``in_splits[d]`` rows to device d, receive
    ``out_splits[s]`` from s); backward: the same exchange reversed, carrying the gradients home."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: str) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None
