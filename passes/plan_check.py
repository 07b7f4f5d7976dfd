"""Check a plan's shardings against the ops' strategies: the pass ``autopar.compile`` runs on any plan.

``Plan.validate`` checks what the plan's own data can tell (spec ranks, even splits, stage tiling); a
hand-edited plan can still pair inputs and output in a way no rule of the op allows (e.g. a matmul
reading both operands split on the contracted dim, but claiming a Replicate output), which codegen
would turn into wrong values or a shape error deep inside the first step. Invariant enforced here:
every node's (input specs, output spec, kernels) is one of the strategies ``generate_strategies``
gives that node on its stage's mesh, so it is something codegen knows how to run.
"""
from __future__ import annotations

from autopar.errors import PlanError
from autopar.ir.graph import ModelGraph
from autopar.passes.strategies import node_strategies, output_strategy, placeholder_strategies, rule_for
from autopar.placement import spec_str


def check_shardings(plan, graph: ModelGraph) -> None:
    """Raise PlanError naming the first node whose sharding is none of its op's strategies."""
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    cache: dict[tuple, set] = {}
    for stage in plan.stages:
        mesh = tuple(stage.mesh_shape)
        for name, sharding in stage.shardings.items():
            node = nodes.get(name)
            if node is None:
                continue  # Plan.validate names nodes missing from the graph
            allowed = _allowed(node, mesh, cache)
            chosen = (tuple(sharding.ins), sharding.out, tuple(tuple(k) for k in sharding.kernels))
            if chosen not in allowed and (chosen[0], chosen[1], ()) not in allowed:
                raise PlanError(_message(stage, node, sharding, allowed))


def _allowed(node, mesh: tuple, cache: dict) -> set:
    key = (node.name, mesh)
    if key not in cache:
        if node.op == "placeholder":
            strategies = placeholder_strategies(node, mesh)
        elif node.op == "output":
            strategies = [output_strategy(node, len(mesh))]
        else:
            strategies = node_strategies(node, mesh, rule_for(node.target))
        cache[key] = {(tuple(spec_str(s) for s in st.in_specs), spec_str(st.out_spec), tuple(st.kernels))
                      for st in strategies}
    return cache[key]


def _message(stage, node, sharding, allowed: set) -> str:
    shown = sorted(f"{out} <- ({', '.join(ins)})" for ins, out, _ in allowed)
    more = f" and {len(shown) - 6} more" if len(shown) > 6 else ""
    return (f"stage {stage.index}, node {node.name} ({node.target}): sharding {sharding.out} <- "
            f"({', '.join(sharding.ins)}) is not one the op supports on mesh {tuple(stage.mesh_shape)}; "
            f"it supports {'; '.join(shown[:6])}{more}. Re-plan, or pin the node with "
            f"pin={{{node.name!r}: spec}} to one of these")
