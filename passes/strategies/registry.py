"""The rule registry: ATen op (packet, overload, callable or qualified name) -> its ``AxisRule`` function.

Each rule family module registers its rules here at import (``strategies/__init__`` imports them all); a
lookup tries the exact target, then its overload packet, then its qualified name. Kept apart from the
package's ``__init__`` so the families import it, not the package that imports them.

An in-place ATen op without a rule of its own (``div_``, ``mul_``, ``add_``, ``masked_fill_``, ...) gets the
rule of its out-of-place form (same overload name), applied as if the node were that form: the result has
the shape of ``self`` and the same values, so every layout valid for ``x.div(y)`` is valid for ``x.div_(y)``.
What differs is aliasing: the op writes into ``self``, and when the plan moves ``self`` to another layout
first, it writes into the moved copy. That is exact when nothing reads ``self``'s storage after the op except
through the op's own output: ``self`` is not a graph input, not a view of another value (``view``, ``slice``,
``transpose``, ... return aliases), no reader of ``self`` comes after the op and none before it is a view
(whose later readers would see the write). Otherwise the op keeps the
replicated strategy alone (as ``index_put_`` does).
"""
from __future__ import annotations

import copy
import functools
from typing import Callable

import torch
import torch.fx as fx

from autopar.ir.ops import OpView
from autopar.passes.strategies.base import AxisRule

RuleFn = Callable[[OpView], list[AxisRule]]
_RULES: dict[object, RuleFn] = {}


def register(*targets) -> Callable[[RuleFn], RuleFn]:
    """Register a rule for ATen op packets (``torch.ops.aten.mm``), single overloads (``aten.max.other``),
    plain callables (operator.getitem), or an op's qualified name (``"lib.op.overload"``) for custom ops
    that exist only once their library is imported."""

    def deco(fn: RuleFn) -> RuleFn:
        for t in targets:
            _RULES[t] = fn
        return fn

    return deco


def rule_for(target) -> RuleFn | None:
    own = _own_rule(target)
    if own is not None:
        return own
    out_of_place = out_of_place_form(target)
    if out_of_place is None or _own_rule(out_of_place) is None:
        return None
    return functools.partial(_in_place_rule, out_of_place)


def _own_rule(target) -> RuleFn | None:
    if target in _RULES:
        return _RULES[target]
    packet = getattr(target, "overloadpacket", None)
    if packet in _RULES:
        return _RULES[packet]
    return _RULES.get(str(target)) if isinstance(target, torch._ops.OpOverload) else None


@functools.lru_cache(maxsize=None)
def out_of_place_form(target) -> torch._ops.OpOverload | None:
    """``aten.div.Tensor`` for ``aten.div_.Tensor``: the op of the same overload without the trailing ``_``,
    for an ATen op that writes its first argument in place (None for anything else)."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    schema = target._schema
    base = schema.name.partition("::")[2]
    first = schema.arguments[0].alias_info if schema.arguments else None
    if not base.endswith("_") or base.startswith("_") or first is None or not first.is_write:
        return None
    packet = getattr(torch.ops.aten, base[:-1], None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


def _in_place_rule(out_of_place: torch._ops.OpOverload, view: OpView) -> list[AxisRule]:
    """The out-of-place form's rules for an in-place node whose write cannot be lost (module docstring)."""
    if not _write_stays_local(view.node):
        return []
    as_out_of_place = copy.copy(view)
    as_out_of_place.target = out_of_place
    return _own_rule(out_of_place)(as_out_of_place)


def in_place_key(node: fx.Node) -> str:
    """"" for a node that is no rule-less in-place op; else whether its write stays local: nodes of equal
    signature share one strategy list, and this is the one property of the graph around them it depends on."""
    if node.op != "call_function" or _own_rule(node.target) is not None or out_of_place_form(node.target) is None:
        return ""
    return "|in-place" if _write_stays_local(node) else "|in-place-aliased"


def _write_stays_local(node: fx.Node) -> bool:
    """Nothing reads the storage ``node`` writes into after it, except through ``node`` itself: no view of it,
    no reader after it, and it is no view or graph input itself."""
    written = node.args[0] if node.args else None
    if not isinstance(written, fx.Node) or written.op != "call_function":
        return False  # a graph input (parameter, buffer, user tensor): its own storage must change
    if _returns_alias(written) and not (out_of_place_form(written.target) is not None and _write_stays_local(written)):
        return False  # a view of another value, which would keep the old values (a chain of writes is fine)
    others = [user for user in written.users if user is not node]
    before = _nodes_between(written, node)
    return all(user in before and not _returns_alias(user) for user in others)


def _nodes_between(first: fx.Node, last: fx.Node) -> set[fx.Node]:
    """The nodes after ``first`` and before ``last`` in graph order (``first`` precedes ``last``: it is an
    argument of it). A walk over that span, not an index of the whole graph: planning asks per in-place node
    per mesh option, and the span from a value to its in-place write is a few nodes."""
    span, cursor = set(), first.next
    while cursor is not last:
        span.add(cursor)
        cursor = cursor.next
    return span


def _returns_alias(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and any(r.alias_info is not None for r in target._schema.returns)


def has_rule(node: fx.Node) -> bool:
    return node.op != "call_function" or rule_for(node.target) is not None
