"""Cost of the mixture-of-experts op ``autopar::moe_experts``: the token rows that cross an axis, expert load.

Routing: h[e] is the share of the routed (token, choice) assignments expert e receives (Σ h = 1): uniform,
h = 1/E, unless the user passes a measured histogram (the planner option ``expert_routing``, the same for
every MoE layer). An axis of W devices that splits the E experts holds experts [d·E/W, (d+1)·E/W) on device
d; H_d = Σ h over those experts is device d's share of the assignments.

All-to-all dispatch (kernel ``expert_all_to_all``, ``runtime/expert_dispatch.py``): a device holds T_l
tokens (x [T_l, H] after every split of the strategy), each routed to k experts, so it dispatches
r = T_l · k · H · itemsize bytes of token rows. Device d keeps the rows of its own experts, sends
r·(1 − H_d) and receives r·H_d from each of the W − 1 others. The slowest device bounds an all-to-all,
so the crossing fraction is

    f = max_d max(1 − H_d, (W − 1)·H_d)               (uniform routing: (W − 1)/W, in and out alike)

and one all-to-all costs t = α + f·r / β, which is ``AxisLink.time("all_to_all", m)`` at m = r·f·W/(W − 1)
(the ring's (W − 1)/W of a local size m). Per microbatch: dispatch and combine forward, their reversed
exchanges carrying the gradients backward (4 all-to-alls of r·f), plus one exchange of the E token counts
(forward; backward reuses the splits). The gather-based split (``local_experts_op``) sends nothing itself:
its tokens arrive replicated and its Partial output is reduced by the redistributions around it, which the
resharding edges price.

Compute: a device computes the rows of its own experts. Under either expert split its share of the op's
work is H_d instead of 1/W and the slowest device bounds the op, so the strategy's work fraction is
multiplied by W · max_d H_d (1 for uniform routing; ``imbalance``).

FLOPs (flop_counter sees only the op's fake kernel): per assignment the expert MLP multiplies by its two
weight matrices, forward 2·(|W_in[e]| + |W_out[e]|); backward computes the input and weight gradients, twice
that. With a capacity factor c a fraction min(1, c) of the assignments is kept (balanced routing).

Backward memory against time: the expert-split kernels differentiate the forward they ran, so they keep per
assignment row of their experts the row in (H), the first matmul's output (N_in: 2I gated, I plain), the
activation's output (I) and the expert's output row (H): (2H + N_in + I) · itemsize bytes, on the busiest
device max_d H_d · T_l·k·(W for all-to-all, 1 for the gathered split) rows (``kernel_saved_bytes``). The
op run whole (tokens split, experts replicated or split on their hidden dim) keeps only its inputs and
recomputes its forward in backward: its work is 4 forward-equivalents instead of 3 (``RECOMPUTE``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch.fx as fx

from autopar.errors import OptionError
from autopar.ir.moe_op import OP_NAME
from autopar.placement import local_shape

MOE_OP = OP_NAME  # str(node.target) of the op in a captured graph
EXPERT_SPLIT_KERNELS = ("expert_all_to_all", "local_experts_op")
DISPATCHES_PER_STEP = 4  # dispatch + combine forward, and their gradients backward
RECOMPUTE = 4.0 / 3.0  # the op run whole recomputes its forward in backward: 1 + 1 + 2 forwards, not 1 + 2


def is_moe_op(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target) == MOE_OP


def check_expert_routing(routing) -> tuple[float, ...] | None:
    """The histogram as shares that sum to 1 (counts are normalized), None when not given; one OptionError
    for anything that is not a non-empty sequence of finite, non-negative numbers with a positive sum."""
    if routing is None:
        return None
    how = ("pass expert_routing= as one number per expert (the tokens or share of the routed assignments each "
           "expert received, e.g. [0.4, 0.2, 0.2, 0.2] or measured counts), or None for uniform routing")
    if isinstance(routing, (str, bytes, dict)) or not hasattr(routing, "__len__") or len(routing) == 0:
        raise OptionError(f"expert_routing={routing!r} is not a routing histogram; {how}")
    bad = [v for v in routing if isinstance(v, bool) or not isinstance(v, (int, float))
           or not math.isfinite(v) or v < 0]
    if bad:
        raise OptionError(f"expert_routing has {bad[0]!r}, which is not a finite non-negative number; {how}")
    total = float(sum(routing))
    if total <= 0:
        raise OptionError(f"expert_routing={list(routing)!r} sums to 0: no expert receives any token; {how}")
    return tuple(float(v) / total for v in routing)


def check_routing_against_graph(graph, routing: Sequence[float] | None) -> None:
    """OptionError when a histogram is given but the graph has no MoE experts op, or an op whose expert
    count differs from the histogram's length."""
    if routing is None:
        return
    counts = sorted({n.args[3].meta["val"].shape[0] for n in graph.gm.graph.nodes if is_moe_op(n)})
    if not counts:
        raise OptionError(f"expert_routing has {len(routing)} entries but the model has no mixture-of-experts "
                          f"layer captured as autopar::moe_experts; leave expert_routing=None")
    if counts != [len(routing)]:
        raise OptionError(f"expert_routing has {len(routing)} entries but the model's MoE layers have "
                          f"{' and '.join(map(str, counts))} experts; pass one share per expert")


def device_shares(routing: Sequence[float] | None, n_experts: int, ways: int) -> list[float]:
    """H_d for each of ``ways`` devices holding contiguous expert blocks (uniform: 1/ways each)."""
    if not routing or len(routing) != n_experts or n_experts % ways:
        return [1.0 / ways] * ways
    per = n_experts // ways
    return [sum(routing[d * per:(d + 1) * per]) for d in range(ways)]


def crossing_fraction(shares: Sequence[float]) -> float:
    """f = max_d max(1 − H_d, (W − 1)·H_d): the slowest device's rows in or out, per row it dispatches."""
    ways = len(shares)
    if ways <= 1:
        return 0.0
    return max(max(1.0 - h, (ways - 1) * h) for h in shares)


def imbalance(shares: Sequence[float]) -> float:
    """W · max_d H_d: the slowest device's work over a balanced device's (1 for uniform routing)."""
    return len(shares) * max(shares) if shares else 1.0


def dispatch_bytes(local_tokens: int, top_k: int, hidden: int, itemsize: int, shares: Sequence[float]) -> float:
    """r·f: bytes the slowest device moves in one all-to-all of the dispatch (module docstring)."""
    return local_tokens * top_k * hidden * itemsize * crossing_fraction(shares)


def all_to_all_seconds(link, crossing: float, ways: int, n_experts: int) -> float:
    """Seconds per microbatch of the dispatch on ``link``: 4 all-to-alls moving ``crossing`` bytes on the
    slowest device, and the forward exchange of the token counts (int64 per expert)."""
    if ways <= 1:
        return 0.0
    message = crossing * ways / (ways - 1)
    return DISPATCHES_PER_STEP * link.time("all_to_all", message) + link.time("all_to_all", 8.0 * n_experts)


def kept_fraction(node: fx.Node) -> float:
    """The share of the assignments the experts compute: min(1, capacity factor), 1 when dropless."""
    capacity = node.args[8] if len(node.args) > 8 else node.kwargs.get("capacity_factor")
    return min(1.0, float(capacity)) if capacity is not None else 1.0


def moe_flops(node: fx.Node) -> tuple[float, float]:
    """(forward, backward) FLOPs of the op at its global shapes (module docstring)."""
    x, index, w_in, w_out = (node.args[i].meta["val"] for i in (0, 1, 3, 4))
    per_assignment = 2.0 * (w_in.numel() + w_out.numel()) / w_in.shape[0]
    forward = per_assignment * x.shape[0] * index.shape[1] * kept_fraction(node)
    return forward, 2.0 * forward


def op_crossing_bytes(view, axis: int, strategy, mesh_shape, routing) -> float:
    """r·f of the op's all-to-all dispatch on ``axis`` under ``strategy`` (tokens as its x spec splits them)."""
    x, index, w_in = view.in_vals[0], view.in_vals[1], view.in_vals[3]
    local_tokens = local_shape(tuple(x.shape), strategy.in_specs[0], mesh_shape)[0]
    shares = device_shares(routing, w_in.shape[0], mesh_shape[axis])
    kept = kept_fraction(view.node)
    return kept * dispatch_bytes(local_tokens, index.shape[1], x.shape[1], x.element_size(), shares)


def dispatch_seconds(view, axis: int, strategy, mesh_shape, link, routing) -> float:
    """Seconds per microbatch of the op's all-to-all dispatch on ``axis`` (``all_to_all_seconds``)."""
    crossing = op_crossing_bytes(view, axis, strategy, mesh_shape, routing)
    return all_to_all_seconds(link, crossing, mesh_shape[axis], view.in_vals[3].shape[0])


def dispatch_messages(view, strategy, mesh_shape, links, routing) -> list[tuple[str, int, float, str, float]]:
    """The op's all-to-alls for a plan's collective list, kind "expert_all_to_all" (a token dispatch, not a
    layout change): (kind, axis, bytes on the slowest device, phase, seconds), dispatch and combine in
    forward and again in backward, per expert-all-to-all axis."""
    out = []
    for axis, tag in strategy.kernels:
        ways = mesh_shape[axis]
        if tag != "expert_all_to_all" or ways <= 1:
            continue
        crossing = op_crossing_bytes(view, axis, strategy, mesh_shape, routing)
        seconds = links[axis].time("all_to_all", crossing * ways / (ways - 1))
        out += [("expert_all_to_all", axis, crossing, phase, seconds) for phase in ("forward",) * 2 + ("backward",) * 2]
    return out


def _expert_axis(strategy) -> int | None:
    return next((axis for axis, tag in strategy.kernels if tag in EXPERT_SPLIT_KERNELS), None)


def with_expert_load(view, strategy, mesh_shape, routing, differentiable: bool = True):
    """``strategy`` with its work fraction scaled for the op (any other node's strategy unchanged): by
    ``imbalance`` on the axis that splits the experts, or, without an expert split, by ``RECOMPUTE`` when
    the op is differentiated (module docstring)."""
    if not is_moe_op(view.node):
        return strategy
    axis = _expert_axis(strategy)
    if axis is None:
        scale = RECOMPUTE if differentiable else 1.0
    else:
        scale = imbalance(device_shares(routing, view.in_vals[3].shape[0], mesh_shape[axis])) if routing else 1.0
    return strategy if scale == 1.0 else dataclasses.replace(strategy, work_fraction=strategy.work_fraction * scale)


def kernel_saved_bytes(view, strategy, mesh_shape, routing) -> float:
    """Bytes the expert-split kernels keep for backward on the busiest device (0 for any other node and for
    the op run whole, which keeps only its inputs): per assignment row its experts computed, the row in,
    the first matmul's output, the activation's output and the expert's output row (module docstring)."""
    if not is_moe_op(view.node) or (axis := _expert_axis(strategy)) is None:
        return 0.0
    x, index, w_in = view.in_vals[0], view.in_vals[1], view.in_vals[3]
    ways = mesh_shape[axis]
    w_in_local, w_out_local = (local_shape(tuple(view.in_vals[i].shape), strategy.in_specs[i], mesh_shape)
                               for i in (3, 4))
    transposed = view.node.args[7] if len(view.node.args) > 7 else view.node.kwargs.get("transposed", True)
    wide = w_in_local[2] if transposed else w_in_local[1]  # [E, in, out] stored transposed, else [E, out, in]
    inner = w_out_local[1] if transposed else w_out_local[2]
    hidden = x.shape[1]
    local_tokens = local_shape(tuple(x.shape), strategy.in_specs[0], mesh_shape)[0]
    senders = ways if dict(strategy.kernels)[axis] == "expert_all_to_all" else 1
    rows = local_tokens * index.shape[1] * senders * max(device_shares(routing, w_in.shape[0], ways))
    return kept_fraction(view.node) * rows * (2 * hidden + wide + inner) * x.element_size()
