"""Pass 2, strategies: for every node, the valid ways to shard it on a 2-D mesh.

Input:  a ``ModelGraph`` (every node has ``meta["val"]``) and a logical mesh shape (M0, M1).
Output: ``{node name: [Strategy, ...]}``; every list is non-empty and its first entry is the fully
replicated strategy, which is always valid. Invariants of every strategy:
  * shards divide evenly (``placement.divides``) on every input and output;
  * axes of size 1 are Replicate;
  * Partial appears only where the rule proves the op linear in that operand.

Rules live one file per op family (``matmul``, ``pointwise``, ``views``, ``reductions``, ``norms``,
``attention``, ``embedding``, ``loss``, ``creation``) and register 1-D ``AxisRule``s per ATen op; an in-place
op without its own rule takes its out-of-place form's (``registry``). An op without a rule runs replicated,
with one warning naming it: slower, never wrong.
"""
from __future__ import annotations

import itertools
import warnings

import torch
import torch.fx as fx

from autopar.ir.ops import OpView, shape_of
from autopar.passes.strategies.base import AxisRule, Strategy, all_replicated_rule
from autopar.passes.strategies.registry import RuleFn, has_rule, in_place_key, out_of_place_form, register, rule_for
from autopar.placement import R, Spec, divides

_WARNED: set[str] = set()  # ops already reported as rule-less in this process (planning asks many times)


# Import the rule families so they register themselves.
from autopar.passes.strategies import (  # noqa: E402,F401
    attention,
    conv,
    creation,
    einsum,
    embedding,
    expert_rows,
    experts,
    loss,
    matmul,
    moe_experts,
    norms,
    pointwise,
    reductions,
    routing,
    views,
)

_SIGNATURE_KEY = "autopar_strategy_signature"  # node.meta slot: (stamp it was computed for, signature)


def strategy_signature(node: fx.Node) -> str:
    """Nodes with equal strategy signatures have the same strategy list (index for index): the op's
    signature, whether its inputs can carry an expert-parallel layout (``expert_rows.context_key``), and for an
    in-place op whether its write may land in a moved copy (``registry.in_place_key``).

    Cached in ``node.meta`` (planning asks once per graph, mesh option and pricing scope), valid while
    ``_stamp``'s objects are the very same ones (checked by identity, as ``ir.ops.node_signature`` does)."""
    from autopar.ir.ops import node_signature

    stamp = _stamp(node)
    hit = node.meta.get(_SIGNATURE_KEY)
    if hit is not None and len(hit[0]) == len(stamp) and all(x is y for x, y in zip(hit[0], stamp)):
        return hit[1]
    signature = f"{node_signature(node)}|{expert_rows.context_key(node)}{in_place_key(node)}"
    node.meta[_SIGNATURE_KEY] = (stamp, signature)
    return signature


def _stamp(node: fx.Node) -> tuple:
    """What a strategy signature is computed from: the node's target, arguments and value, its inputs'
    values, and for an op that may write in place the readers of the value it writes (``in_place_key``).
    A pass that rewires or relabels a node replaces one of them; a copied graph has new argument tuples."""
    inputs = node.all_input_nodes
    stamp = (node.target, node.args, node.kwargs, node.meta.get("val"), *(a.meta.get("val") for a in inputs))
    written = node.args[0] if node.op == "call_function" and node.args else None
    if isinstance(written, fx.Node) and out_of_place_form(node.target) is not None:
        stamp += (written.meta.get("val"), *written.users)
    return stamp


def generate_strategies(graph, mesh_shape: tuple[int, int]) -> dict[str, list[Strategy]]:
    """Strategies for every node of ``graph.gm`` on ``mesh_shape`` (see module docstring)."""
    out: dict[str, list[Strategy]] = {}
    missing: set[str] = set()
    by_signature: dict[str, list[Strategy]] = {}  # identical layers share one list (and one object)
    for node in graph.gm.graph.nodes:
        sig = strategy_signature(node) if node.op != "output" else None
        if sig in by_signature:
            out[node.name] = by_signature[sig]
            continue
        if node.op == "placeholder":
            out[node.name] = placeholder_strategies(node, mesh_shape)
        elif node.op == "call_function":
            fn = rule_for(node.target)
            if fn is None:
                missing.add(str(node.target))
            out[node.name] = node_strategies(node, mesh_shape, fn)
        elif node.op == "output":
            out[node.name] = [output_strategy(node, len(mesh_shape))]
        if sig is not None:
            by_signature[sig] = out[node.name]
    for name in sorted(missing - _WARNED):
        _WARNED.add(name)
        warnings.warn(f"autopar: no sharding rule for {name}: it runs replicated, so every device holds its full "
                      f"inputs and output (extra memory), and the values around it are gathered to it and split "
                      f"again (extra communication). Results stay exact. If this op is large in your model, "
                      f"please report it with your model name and this op at the autopar issue tracker.",
                      stacklevel=2)
    return out


def node_strategies(node: fx.Node, mesh_shape: tuple[int, int], fn: RuleFn | None) -> list[Strategy]:
    view = OpView(node)
    base = all_replicated_rule(view)
    per_axis_rules = [base] + (fn(view) if fn is not None else []) + expert_rows.expert_rows_rules(view)
    kept = (expert_rows.one_axis_experts(view, s) for s in combine(view, per_axis_rules, mesh_shape))
    return list(dict.fromkeys(s for s in kept if s is not None and not attention.nested_context(s)
                              and moe_experts.consistent(view, s, mesh_shape)))


def combine(view: OpView, rules: list[AxisRule], mesh_shape: tuple[int, int]) -> list[Strategy]:
    """Product of 1-D rules over mesh axes, keeping only even shards; the all-R strategy comes first."""
    per_axis = [rules if size > 1 else rules[:1] for size in mesh_shape]
    seen, out = set(), []
    for choice in itertools.product(*per_axis):
        in_specs = tuple(tuple(r.inputs[i] for r in choice) for i in range(view.n_in))
        out_spec = tuple(r.output for r in choice)
        if not _even(view, in_specs, out_spec, mesh_shape):
            continue
        key = (in_specs, out_spec)
        if key in seen:
            continue
        seen.add(key)
        work = 1.0
        for axis, r in enumerate(choice):
            if r is not rules[0]:
                work /= mesh_shape[axis]
        kernels = tuple((axis, r.kernel) for axis, r in enumerate(choice) if r.kernel)
        out.append(Strategy(in_specs, out_spec, work, kernels))
    assert out and all(p.is_replicate() for p in out[0].out_spec), "replicated strategy must come first"
    return out


def _even(view: OpView, in_specs, out_spec, mesh_shape) -> bool:
    for spec, shape in zip(in_specs, view.in_shapes):
        if shape is not None and not divides(spec, shape, mesh_shape):
            return False
    return all(divides(out_spec, shape_of(v), mesh_shape) for v in view.out_vals)


def placeholder_strategies(node: fx.Node, mesh_shape: tuple[int, int]) -> list[Strategy]:
    """A graph input may take any even spec: Replicate, or Shard(d) of any dim, on each axis."""
    shape = shape_of(node.meta.get("val")) or ()
    options = [R] + [torch.distributed.tensor.Shard(d) for d in range(len(shape)) if shape[d] > 1]
    per_axis = [options if size > 1 else [R] for size in mesh_shape]
    out = []
    for spec in itertools.product(*per_axis):
        if divides(spec, shape, mesh_shape):
            frac = 1.0
            for axis, p in enumerate(spec):
                if not p.is_replicate():
                    frac /= mesh_shape[axis]
            out.append(Strategy((), tuple(spec), frac))
    return out


def output_strategy(node: fx.Node, n_axes: int) -> Strategy:
    """The graph output is returned whole on every rank: every tensor output is Replicate."""
    view = OpView(node)
    return Strategy(tuple((R,) * n_axes for _ in range(view.n_in)), (R,) * n_axes)


__all__ = ["generate_strategies", "register", "Strategy", "AxisRule", "OpView", "has_rule", "Spec"]
