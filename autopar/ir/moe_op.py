"""The mixture-of-experts experts call as one graph op: ``torch.ops.autopar.moe_experts``.

Token-local semantics, for x [T, H], index [T, k] (ints), weights [T, k], expert weights w_in, w_out (dim 0 = the
E experts):

    out[t] = Σ_j keep[t, j] · weights[t, j] · expert_{index[t, j]}(x[t])                            [T, H]
    expert_e(v) = act(v W_in[e]) W_out[e]                       (gated: g, u = v W_in[e]; act(g) · u)

with W_in[e] = w_in[e] when ``transposed`` (weights stored [E, in, out], as the GShard example does) and
w_in[e]ᵀ otherwise (stored [E, out, in], as ``transformers`` does); the same for W_out. A gated layout
stores gate and up concatenated along the output features (``transformers``' ``gate_up_proj``).

``keep`` is 1 everywhere (dropless) unless ``capacity_factor`` is given: then the tokens are cut into groups
of ``group_size`` consecutive tokens and expert e takes at most C = ⌈capacity_factor · k · group_size / E⌉
assignments per group, in GShard's priority order (every token's first choice before any second choice,
tokens in order); the others are dropped (their weight counts as 0, the residual carries the token).
``keep`` depends on the index of one group only, so any split of the tokens into whole groups computes it
locally.

The op is opaque to export (one node per MoE layer, which the planner shards as a whole:
``passes/strategies/moe_experts.py``); its eager kernel is ``experts_math``, which the runtime's local
kernels (``runtime/expert_dispatch.py``) share. Autograd recomputes the forward in backward (as activation
checkpointing does): the op saves only its inputs.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu,
               "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}
OP_NAME = "autopar.moe_experts.default"  # str(node.target) of the op in a captured graph


def capacity_keep(index: torch.Tensor, n_experts: int, capacity_factor: float, group_size: int) -> torch.Tensor:
    """keep [T, k] (bool): which assignments fit their expert's capacity in their group (module docstring)."""
    tokens, k = index.shape
    group = group_size or tokens
    capacity = math.ceil(capacity_factor * k * group / n_experts)
    order = index.reshape(tokens // group, group, k).transpose(1, 2).reshape(-1, k * group)  # choice-major
    slots = F.one_hot(order.clamp(0, n_experts - 1), n_experts).cumsum(1) - 1
    position = slots.gather(2, order.clamp(0, n_experts - 1).unsqueeze(-1)).squeeze(-1)
    return (position < capacity).reshape(-1, k, group).transpose(1, 2).reshape(tokens, k)


def expert_rows(rows: torch.Tensor, counts: list[int], w_in: torch.Tensor, w_out: torch.Tensor,
                activation: str, gated: bool, transposed: bool) -> torch.Tensor:
    """Rows grouped by expert (``counts[e]`` consecutive rows for local expert e) through their experts."""
    outs, start = [], 0
    for e, count in enumerate(counts):
        if count:
            outs.append(_one_expert(rows[start:start + count], w_in[e], w_out[e], activation, gated, transposed))
            start += count
    if not outs:
        width = w_out.shape[2] if transposed else w_out.shape[1]
        return rows.new_zeros((0, width), dtype=w_out.dtype) + 0 * w_out.sum() + 0 * w_in.sum()
    return torch.cat(outs)


def _one_expert(v, w_in, w_out, activation: str, gated: bool, transposed: bool) -> torch.Tensor:
    h = v.to(w_in.dtype) @ (w_in if transposed else w_in.t())
    if gated:
        gate, up = h.chunk(2, dim=-1)
        h = ACTIVATIONS[activation](gate) * up
    else:
        h = ACTIVATIONS[activation](h)
    return h @ (w_out if transposed else w_out.t())


def dispatch_order(index: torch.Tensor, keep: torch.Tensor | None, first: int, n_local: int,
                   ) -> tuple[torch.Tensor, list[int]]:
    """(order, counts): the flat assignments (t·k + j) of experts [first, first + n_local), kept ones only,
    sorted by expert (stable: token order within an expert), and how many each of those experts got."""
    local = index.reshape(-1) - first
    valid = (local >= 0) & (local < n_local)
    if keep is not None:
        valid &= keep.reshape(-1)
    local = torch.where(valid, local, n_local)
    order = torch.sort(local, stable=True).indices
    counts = torch.bincount(local, minlength=n_local + 1)[:n_local].tolist()
    return order[:sum(counts)], counts


def combine(rows: torch.Tensor, assignments: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor | None,
            out_dtype: torch.dtype) -> torch.Tensor:
    """out[t] = Σ_j weight[t, j] · row of assignment t·k + j (zero for assignments not in ``assignments``)."""
    tokens, k = weights.shape
    placed = rows.new_zeros((tokens * k, rows.shape[1])).index_copy(0, assignments, rows)
    scale = weights if keep is None else weights * keep
    return (placed.view(tokens, k, -1) * scale.unsqueeze(-1).to(placed.dtype)).sum(1).to(out_dtype)


def experts_math(x, index, weights, w_in, w_out, activation: str, gated: bool, transposed: bool,
                 capacity_factor: float | None, group_size: int, n_experts: int | None = None,
                 first: int = 0) -> torch.Tensor:
    """The op's value (differentiable eager code), restricted to experts [first, first + w_in.shape[0]) of
    ``n_experts`` (default: all of them): the other assignments contribute zero."""
    n_experts = n_experts or w_in.shape[0]
    keep = capacity_keep(index, n_experts, capacity_factor, group_size) if capacity_factor is not None else None
    order, counts = dispatch_order(index, keep, first, w_in.shape[0])
    k = index.shape[1]
    rows = expert_rows(x[order // k], counts, w_in, w_out, activation, gated, transposed)
    return combine(rows, order, weights, keep, x.dtype)


@torch.library.custom_op("autopar::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, w_in: torch.Tensor,
                w_out: torch.Tensor, activation: str, gated: bool, transposed: bool,
                capacity_factor: float | None, group_size: int) -> torch.Tensor:
    return experts_math(x, index, weights, w_in, w_out, activation, gated, transposed, capacity_factor, group_size)


@moe_experts.register_fake
def _moe_experts_fake(x, index, weights, w_in, w_out, activation, gated, transposed, capacity_factor, group_size):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])
    ctx.attrs = inputs[5:]


def _backward(ctx, grad):
    """Recompute the forward with autograd on and differentiate it (the op saves only its inputs)."""
    saved = ctx.saved_tensors
    wanted = [i for i in (0, 2, 3, 4) if ctx.needs_input_grad[i]]
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(i in wanted) for i, t in enumerate(saved)]
        out = experts_math(*leaves, *ctx.attrs)
        grads = torch.autograd.grad(out, [leaves[i] for i in wanted], grad, allow_unused=True)
    by_input = dict(zip(wanted, grads))
    return tuple(by_input.get(i) for i in range(5)) + (None,) * len(ctx.attrs)


moe_experts.register_autograd(_backward, setup_context=_setup_context)
