"""torch.einsum: the equation is parsed into labels and handed to ``matmul.einsum_rules``.

``aten.einsum(equation, [operands], path)`` with an explicit output ("gsm,me->gse"): per mesh axis, shard a
label that survives to the output (operands carrying it Shard, the others Replicate, the output Shard),
or a label contracted between two or more operands (output Partial), exactly as for mm/bmm. An ellipsis
stands for the same broadcast dims in every operand and the output; it is written out as fresh labels,
right-aligned as einsum aligns them. Not offered (the op stays replicated on that label):
  * implicit-output equations ("ij,jk"), a label repeated within one operand (a diagonal, "ii->i"),
    since a diagonal shard is not a block of either dim;
  * a label summed within a single operand (it would be a Partial of one operand; left whole).
A size-1 (broadcast) dim never carries a shard (``einsum_rules``).
"""
from __future__ import annotations

import string

import torch

from autopar.ir.ops import OpView
from autopar.passes.strategies.base import AxisRule
from autopar.passes.strategies.matmul import einsum_rules
from autopar.passes.strategies.registry import register

aten = torch.ops.aten

_ELLIPSIS_LABELS = string.ascii_uppercase[::-1]  # fresh labels for "...", away from the usual lowercase ones


def parse_equation(equation: str, ranks: list[int]) -> tuple[list[str], str] | None:
    """(labels per operand, output labels) with "..." expanded, or None when no rule applies (module doc)."""
    equation = equation.replace(" ", "")
    if "->" not in equation:
        return None
    lhs, out = equation.split("->")
    operands = lhs.split(",")
    if len(operands) != len(ranks):
        return None
    width = max([rank - len(term.replace("...", "")) for term, rank in zip(operands, ranks) if "..." in term],
                default=0)
    fresh = _ELLIPSIS_LABELS[:width][::-1]
    if set(fresh) & set(equation):
        return None
    expanded = [_expand(term, rank, fresh) for term, rank in zip(operands, ranks)]
    output = _expand(out, width + len(out.replace("...", "")), fresh)
    if any(len(set(labels)) != len(labels) for labels in expanded + [output]):
        return None
    return expanded, output


def _expand(term: str, rank: int, fresh: str) -> str:
    """Replace "..." by the last ``rank - explicit`` fresh labels (right-aligned broadcast)."""
    if "..." not in term:
        return term
    explicit = len(term.replace("...", ""))
    n = rank - explicit
    return term.replace("...", fresh[len(fresh) - n:] if n else "")


@register(aten.einsum)
def einsum_rule(view: OpView) -> list[AxisRule]:
    ranks = [len(shape) if shape is not None else 0 for shape in view.in_shapes]
    parsed = parse_equation(view.arg(0), ranks)
    if parsed is None:
        return []
    in_labels, out_labels = parsed
    if any(len(labels) != rank for labels, rank in zip(in_labels, ranks)):
        return []
    return einsum_rules(view, in_labels, out_labels)
