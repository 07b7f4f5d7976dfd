"""The rule registry: ATen op (packet, overload, callable or qualified name) -> its ``AxisRule`` function.

Each rule family module registers its rules here at import (``strategies/__init__`` imports them all); a
lookup tries the exact target, then its overload packet, then its qualified name. Kept apart from the
package's ``__init__`` so the families import it, not the package that imports them.
"""
from __future__ import annotations

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
    if target in _RULES:
        return _RULES[target]
    packet = getattr(target, "overloadpacket", None)
    if packet in _RULES:
        return _RULES[packet]
    return _RULES.get(str(target)) if isinstance(target, torch._ops.OpOverload) else None


def has_rule(node: fx.Node) -> bool:
    return node.op != "call_function" or rule_for(node.target) is not None
