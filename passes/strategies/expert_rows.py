"""Expert-parallel values that stay on their experts' devices: the ``EXPERT_ROWS`` placement.

An expert-parallel grouped matmul (``experts.py``, kernel ``local_experts``) computes on each device only the
rows routed to its own experts and writes zeros in every other row. Its output is a Partial (the sum over the
axis is the whole value) of a special kind: each row is nonzero on at most one device (disjoint support).
``EXPERT_ROWS`` names that kind, so the expert MLP can run between its two grouped matmuls without
communication, as expert parallelism does:

    up = grouped_mm(x, w_up, offs)  [S, 2I]   EXPERT_ROWS        (x whole: every device sees every row)
    g, u = up.chunk(2, -1); h = silu(g) * u   EXPERT_ROWS        (zero rows stay zero, rows stay put)
    down = grouped_mm(h, w_down, offs)        EXPERT_ROWS        (reads only its own rows, which are exact)
    ... weights, un-permute, top-k sum        Partial            (reduced once, at the residual add)

A plain Partial would have to be summed before the nonlinear ``silu`` (f(a + b) is not f(a) + f(b)); with
disjoint support one of a, b is zero on every row, and f(a + 0) = f(a) + f(0) holds when f(0) = 0. Which
ops keep it, per axis:
  * ops with f(0) = 0 on one input that keep rows in place: ``silu``, ``gelu``, ``relu``, ``tanh``, ``neg``,
    copies and casts; ``chunk``/``split`` along a non-row dim and ``getitem`` of their pieces;
  * ``mul`` by a Replicate operand broadcast over rows, or of two EXPERT_ROWS operands from the same matmul;
  * a grouped matmul reads EXPERT_ROWS as its x when its experts are split on that axis and x comes
    from a grouped matmul with the same offsets through the ops above (same rows on the same device).
A device stores only its own rows, compacted (``runtime/kernels.py``): about S / W of them when the router
balances the experts (what MoE training's auxiliary loss aims at), so the cost and memory models size an
EXPERT_ROWS value as dim 0 split W ways (``placement.local_shape``); its rows are padded back, with zeros,
where it becomes a plain Partial. Rows are dim 0 (the token-expert rows of ``x [S, K]``). EXPERT_ROWS lives
on one mesh axis per value: the
experts of a grouped matmul that makes or reads it are split on that axis alone (experts split on two axes
give a plain Partial), so every reader's experts are the maker's. The gradient of an EXPERT_ROWS value is
right on the device's own rows only, which is all its readers use.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from autopar.ir.expert_rows import is_grouped_mm, rows_source
from autopar.ir.ops import OpView
from autopar.passes.strategies.base import AxisRule, Strategy
from autopar.placement import EXPERT_ROWS, P, R

aten = torch.ops.aten


def expert_rows_rules(view: OpView) -> list[AxisRule]:
    """The one-axis rules that keep an EXPERT_ROWS input EXPERT_ROWS (empty when no input can be one)."""
    node = view.node
    sources = [rows_source(a) for a in view.tensor_args]
    if all(s is None for s in sources) or view.out_shape is None:
        return []
    if is_grouped_mm(node):
        reads_own_rows = sources[0] is not None and sources[0].args[2] is node.args[2]
        return [AxisRule((EXPERT_ROWS, Shard(0), R), EXPERT_ROWS, "local_experts")] if reads_own_rows else []
    if rows_source(node) is None:
        return []
    return [AxisRule(tuple(EXPERT_ROWS if s is not None else R for s in sources), EXPERT_ROWS)]


def context_key(node: fx.Node) -> tuple:
    """What of a node's surroundings its EXPERT_ROWS rules depend on (identical layers share strategies)."""
    if node.op != "call_function":
        return ()
    sources = [rows_source(a) for a in node.args[:3] if isinstance(a, fx.Node)]
    own = node.args[2] if is_grouped_mm(node) else None
    return (rows_source(node) is not None,) + tuple(
        (s is not None, s is not None and s.args[2] is own) for s in sources)


def one_axis_experts(view: OpView, strategy: Strategy) -> Strategy | None:
    """Keep EXPERT_ROWS to one mesh axis: a grouped matmul whose experts are split on two axes makes a plain
    Partial (its rows are not one axis' experts) and cannot read EXPERT_ROWS (its rows would not be the
    maker's). Other ops pass through. None drops the strategy."""
    if not is_grouped_mm(view.node):
        return strategy
    expert_axes = sum(1 for p in strategy.in_specs[1] if p.is_shard() and p.dim == 0)
    if expert_axes < 2:
        return strategy
    if any(p == EXPERT_ROWS for p in strategy.in_specs[0]):
        return None
    out = tuple(P if p == EXPERT_ROWS else p for p in strategy.out_spec)
    return Strategy(strategy.in_specs, out, strategy.work_fraction, strategy.kernels)
