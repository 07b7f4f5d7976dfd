"""Causal attention with its queries split over the sequence on one mesh axis (context parallelism).

A rank at coordinate r of an axis of W devices holds query rows [r·c, (r+1)·c) (c = L / W) and every key and
value: the generated code all-gathers k and v before the call (Llama 3's choice: the simplest exact
backward, since the all-gather's backward reduce-scatters their gradients). Row i of the sequence attends to
keys [0, i]:

    out_i = softmax(scale · q_i K[:i+1]ᵀ) V[:i+1]

so a block of rows [s, s + n) needs only the key prefix [0, s + n), under a causal mask aligned to its
lower-right corner. Left as is, chunk r costs (r + 1/2)·c² and rank W-1 works 2W-1 times as long as rank 0.

Load balance (the zig-zag split, in the all-gather form): cut the sequence into 2W half-chunks h_0 … h_{2W-1}
of n = c/2 rows. Rank r holds h_{2r}, h_{2r+1}; it keeps h_{2r} and swaps h_{2r+1} with its mirror rank
m = W-1-r, which keeps h_{2m} = h_{2W-2-2r} and sends h_{2W-1-2r}. Each rank then computes

    h_{2r} against keys [0, (2r+1)·n)   and   h_{2W-1-2r} against keys [0, (2W-2r)·n)

whose causal work is (2r + 1/2) + (2W - 2r - 1/2) = 2W blocks of n²: the same on every rank (the middle rank
of an odd W is its own mirror and keeps both halves, 2W as well). The swapped half's output goes back the
same way. A swap is a permutation, so it is its own backward: gradients are exact. Costs beyond the all-
gather: two point-to-point exchanges of half a local query block in forward, two in backward (priced by
``passes/intra_op_groups``). With c odd there are no halves and each rank computes its chunk as it is.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.runtime import devices, faults, groups


def causal_context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: str,
                             dropout_p: float = 0.0, scale: float | None = None,
                             enable_gqa: bool = False) -> torch.Tensor:
    """Causal SDPA of this rank's query chunk ``q`` [..., c, E] against whole ``k``, ``v`` [..., L, E] (module
    docstring); the result is this rank's rows of the full causal attention, [..., c, Ev]."""
    r, world = groups.local_rank_in(group), groups.size(group)
    c = q.shape[-2]
    sdpa = dict(dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)
    if c % 2 or world == 1:
        return _causal_block(q, k, v, r * c, sdpa)
    n, mirror = c // 2, world - 1 - r
    kept, sent = q[..., :n, :], q[..., n:, :]
    if mirror == r:
        return torch.cat([_causal_block(kept, k, v, r * c, sdpa), _causal_block(sent, k, v, r * c + n, sdpa)], -2)
    peer = groups.members(group)[mirror]
    received = _MirrorSwap.apply(sent, peer, group)
    out_kept = _causal_block(kept, k, v, r * c, sdpa)
    out_received = _causal_block(received, k, v, mirror * c + n, sdpa)
    return torch.cat([out_kept, _MirrorSwap.apply(out_received, peer, group)], -2)


def _causal_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, sdpa: dict) -> torch.Tensor:
    """Rows [start, start + n) of causal attention: the key prefix [0, start + n) under a lower-right mask."""
    n = q.shape[-2]
    end = start + n
    rows = torch.arange(start, end, device=q.device).unsqueeze(-1)
    mask = torch.arange(end, device=q.device).unsqueeze(0) <= rows
    return F.scaled_dot_product_attention(q, k[..., :end, :], v[..., :end, :], attn_mask=mask, **sdpa)


class _MirrorSwap(torch.autograd.Function):
    """Forward: exchange a tensor with ``peer`` (a global rank); backward: exchange the gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, peer: int, group: str) -> torch.Tensor:
        ctx.peer, ctx.group = peer, group
        return _exchange(x, peer, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.peer, ctx.group), None, None


def _exchange(x: torch.Tensor, peer: int, group: str) -> torch.Tensor:
    """Send ``x`` to ``peer`` and receive the peer's tensor of the same shape (both ranks call this)."""
    sent = devices.to_wire(x.contiguous())
    out = torch.empty_like(sent)
    pg = groups.get(group)
    sends = faults.guard("send", group, dist.isend, sent, peer, group=pg)
    recvs = faults.guard("recv", group, dist.irecv, out, peer, group=pg)
    faults.guard("send", group, sends.wait)
    faults.guard("recv", group, recvs.wait)
    return out.to(x.device)
