"""autopar.moe: mixture-of-experts layers as one op the planner can split by experts (all-to-all dispatch).

    out = autopar.moe.moe_experts(x, index, weights, w_in, w_out, activation="relu", capacity_factor=1.0,
                                  group_size=S)

computes out[t] = Σ_j weights[t, j] · expert_{index[t, j]}(x[t]) as one graph op (``autopar::moe_experts``;
semantics, capacity and autograd in ``autopar/ir/moe_op.py``). Hugging Face MoE models need nothing: their
experts reach the same op at capture (``passes/capture_moe.py``).
"""
from __future__ import annotations

import torch

from autopar.errors import UsageError
from autopar.ir.moe_op import ACTIVATIONS

__all__ = ["moe_experts"]


def moe_experts(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, w_in: torch.Tensor,
                w_out: torch.Tensor, *, activation: str = "silu", gated: bool = False, transposed: bool = True,
                capacity_factor: float | None = None, group_size: int = 0) -> torch.Tensor:
    """The experts of an MoE layer on tokens x [T, H] routed to ``index`` [T, k] with ``weights`` [T, k].

    w_in: [E, H, N] (``transposed``) or [E, N, H]; w_out: [E, I, H] or [E, H, I]; N = 2·I when ``gated``
    (gate and up concatenated), else I. ``capacity_factor``: drop what exceeds ⌈factor · k · group_size / E⌉
    assignments per expert in each group of ``group_size`` tokens (GShard); None: dropless."""
    _check(x, index, weights, w_in, w_out, activation, gated, transposed, capacity_factor, group_size)
    return torch.ops.autopar.moe_experts(x, index, weights, w_in, w_out, activation, gated, transposed,
                                         None if capacity_factor is None else float(capacity_factor),
                                         int(group_size))


def _check(x, index, weights, w_in, w_out, activation, gated, transposed, capacity_factor, group_size) -> None:
    if activation not in ACTIVATIONS:
        raise UsageError(f"moe_experts: activation {activation!r} is not one of {sorted(ACTIVATIONS)}; pick one")
    if x.dim() != 2 or index.dim() != 2 or weights.shape != index.shape or index.shape[0] != x.shape[0]:
        raise UsageError(f"moe_experts: expected x [T, H], index and weights [T, k], got x {tuple(x.shape)}, "
                         f"index {tuple(index.shape)}, weights {tuple(weights.shape)}; flatten the tokens first")
    if index.dtype.is_floating_point or index.dtype == torch.bool:
        raise UsageError(f"moe_experts: index must hold integer expert ids, got {index.dtype}")
    hidden_in = w_in.shape[1] if transposed else w_in.shape[2]
    width = w_in.shape[2] if transposed else w_in.shape[1]
    inner = w_out.shape[1] if transposed else w_out.shape[2]
    if w_in.dim() != 3 or w_out.dim() != 3 or w_in.shape[0] != w_out.shape[0] or hidden_in != x.shape[1] or \
            width != inner * (2 if gated else 1):
        raise UsageError(f"moe_experts: expert weights w_in {tuple(w_in.shape)}, w_out {tuple(w_out.shape)} do "
                         f"not fit x {tuple(x.shape)} (transposed={transposed}, gated={gated}); expected "
                         f"[E, H, N] and [E, I, H] when transposed, N = 2·I when gated")
    if capacity_factor is not None and (capacity_factor <= 0 or group_size <= 0 or x.shape[0] % group_size):
        raise UsageError(f"moe_experts: a capacity factor needs a positive factor and a group size dividing the "
                         f"{x.shape[0]} tokens, got factor {capacity_factor}, group size {group_size}")
