"""Which values of a graph can carry an expert-parallel ``EXPERT_ROWS`` layout, and where they come from.

An expert-parallel grouped matmul keeps on each device only the token-expert rows of its own experts (see
``passes/strategies/expert_rows.py`` for the rules, ``runtime/kernels.py`` for the local kernels). A value
can carry those rows when it is such a matmul's output, or comes from one through ops that keep rows in
place and zero rows zero (``ROW_KEEPING``, ``chunk``/``split`` along a non-row dim, ``getitem`` of their
pieces, ``mul`` of operands from the same matmul or by an operand broadcast over rows). ``rows_source``
finds that matmul; its offsets say which rows a device owns, its expert shards which experts.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten
GROUPED_MM_OPS = ("transformers.grouped_mm_fallback.default", "aten._grouped_mm.default")
ROW_KEEPING = {aten.silu, aten.gelu, aten.relu, aten.tanh, aten.neg, aten.clone, aten.contiguous, aten.alias,
               aten.to, aten._to_copy, aten.detach, aten.positive}
SPLITS = {aten.chunk, aten.split, aten.split_with_sizes, aten.tensor_split}


def _shape(a) -> tuple:
    return tuple(getattr(a.meta.get("val"), "shape", ())) if isinstance(a, fx.Node) else ()


def is_grouped_mm(node: fx.Node) -> bool:
    """A grouped expert matmul in its MoE form: x [S, K], w [E, K, N], offs [E], no bias."""
    if node.op != "call_function" or str(node.target) not in GROUPED_MM_OPS or len(node.args) < 3:
        return False
    extra = [a for a in list(node.args[3:4]) + [node.kwargs.get("bias")] if a is not None]
    return [len(_shape(a)) for a in node.args[:3]] == [2, 3, 1] and not extra


_CACHE_KEY = "autopar_rows_source"  # node.meta entry: (args the answer was found for, answer)


def rows_source(node) -> fx.Node | None:
    """The grouped matmul whose rows ``node`` can carry (see module docstring), or None. Cached in the
    node's meta with the args it was found for (every node is asked, once per strategy list and ILP)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    cached = node.meta.get(_CACHE_KEY)
    if cached is not None and cached[0] == node.args:
        return cached[1]
    found = _find_source(node)
    node.meta[_CACHE_KEY] = (node.args, found)
    return found


def _find_source(node: fx.Node) -> fx.Node | None:
    if is_grouped_mm(node):
        return node
    packet = getattr(node.target, "overloadpacket", None)
    if node.target is operator.getitem or packet in ROW_KEEPING or (packet in SPLITS and _split_dim(node) != 0):
        return rows_source(node.args[0])
    if packet is aten.mul:
        tensors = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        sources = {rows_source(a) for a in tensors}
        if len(sources - {None}) != 1:
            return None
        (source,) = sources - {None}
        rows = _shape(source)[0]
        other_rows_broadcast = all(rows_source(a) is source or _row_broadcast(a, rows) for a in tensors)
        return source if other_rows_broadcast else None
    return None


def rows_offsets(node) -> fx.Node | None:
    """The offsets node of ``rows_source(node)`` (None when there is none)."""
    source = rows_source(node)
    return source.args[2] if source is not None else None


def _row_broadcast(a: fx.Node, rows: int) -> bool:
    """``a`` is read the same by every row of an [S, ...] operand: fewer dims, or size 1 in the row dim."""
    shape = _shape(a)
    return len(shape) < 2 or shape[0] == 1


def _split_dim(node: fx.Node) -> int:
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    return dim % len(_shape(node.args[0]))
