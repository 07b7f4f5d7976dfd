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
kernels (``runtime/expert_dispatch.py``) share. Its backward is the op ``autopar::moe_experts_backward``, the
chain rule written out per expert: it recomputes each expert's hidden activations from the saved inputs (as
activation checkpointing does), so the op saves only its inputs, and compiled graphs keep both ops whole.
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


def _act_and_grad(h: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(h), act'(h)) of the activations in ``ACTIVATIONS``."""
    if activation == "relu":
        return h.clamp_min(0), (h > 0).to(h.dtype)
    if activation == "silu":
        s = torch.sigmoid(h)
        return h * s, s * (1 + h * (1 - s))
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(h / math.sqrt(2)))
        return h * cdf, cdf + h * torch.exp(-0.5 * h * h) / math.sqrt(2 * math.pi)
    c = math.sqrt(2 / math.pi)
    t = torch.tanh(c * (h + 0.044715 * h ** 3))
    return 0.5 * h * (1 + t), 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * c * (1 + 3 * 0.044715 * h * h)


def _one_expert_backward(v, dy, w_in, w_out, activation: str, gated: bool, transposed: bool):
    """(y, dv, dw_in, dw_out) of one expert on rows v given dy = ∂loss/∂y (module docstring's expert_e)."""
    w_in_m, w_out_m = (w_in, w_out) if transposed else (w_in.t(), w_out.t())  # [in, N], [I, out]
    h = v @ w_in_m
    if gated:
        gate, up = h.chunk(2, dim=-1)
        act, act_grad = _act_and_grad(gate, activation)
        a = act * up
    else:
        a, act_grad = _act_and_grad(h, activation)
    da = dy @ w_out_m.t()
    dh = torch.cat([da * up * act_grad, da * act], -1) if gated else da * act_grad
    dw_in, dw_out = v.t() @ dh, a.t() @ dy
    return a @ w_out_m, dh @ w_in_m.t(), (dw_in if transposed else dw_in.t()), (dw_out if transposed else dw_out.t())


@torch.library.custom_op("autopar::moe_experts_backward", mutates_args=())
def moe_experts_backward(grad: torch.Tensor, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                         w_in: torch.Tensor, w_out: torch.Tensor, activation: str, gated: bool, transposed: bool,
                         capacity_factor: float | None, group_size: int,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of x, weights, w_in, w_out given ∂loss/∂out (``grad``), by the chain rule per expert (an op
    of its own, so compiled backward graphs keep it whole, as forward graphs keep ``moe_experts``)."""
    keep = capacity_keep(index, w_in.shape[0], capacity_factor, group_size) if capacity_factor is not None else None
    order, counts = dispatch_order(index, keep, 0, w_in.shape[0])
    tokens = order // index.shape[1]
    scale = (weights if keep is None else weights * keep).reshape(-1)[order].unsqueeze(-1)
    rows_grad = grad[tokens].to(w_out.dtype)
    gx, gw_in, gw_out = torch.zeros_like(x), torch.zeros_like(w_in), torch.zeros_like(w_out)
    gweights = torch.zeros(weights.numel(), dtype=weights.dtype, device=weights.device)
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        part = slice(start, start + count)
        y, dv, gw_in[e], gw_out[e] = _one_expert_backward(
            x[tokens[part]].to(w_in.dtype), rows_grad[part] * scale[part].to(w_out.dtype), w_in[e], w_out[e],
            activation, gated, transposed)
        gweights[order[part]] = (rows_grad[part] * y).sum(-1).to(weights.dtype)
        gx.index_add_(0, tokens[part], dv.to(x.dtype))
        start += count
    return gx, gweights.view(weights.shape), gw_in, gw_out


@moe_experts_backward.register_fake
def _moe_experts_backward_fake(grad, x, index, weights, w_in, w_out, *attrs):
    return torch.empty_like(x), torch.empty_like(weights), torch.empty_like(w_in), torch.empty_like(w_out)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])
    ctx.attrs = inputs[5:]


def _backward(ctx, grad):
    """The op saves only its inputs; ``moe_experts_backward`` recomputes each expert's activations."""
    gx, gweights, gw_in, gw_out = torch.ops.autopar.moe_experts_backward(grad, *ctx.saved_tensors, *ctx.attrs)
    return (gx, None, gweights, gw_in, gw_out) + (None,) * len(ctx.attrs)


moe_experts.register_autograd(_backward, setup_context=_setup_context)
