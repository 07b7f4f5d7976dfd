"""Identical pipeline chunks built once: a stage whose intra-op problem equals an earlier stage's, node for node,
reads that stage's build instead of building its own.

Invariant: two scopes with equal ``scope_key`` build equal ILPs (``intra_op.build_problem``: every cost, memory,
peak, unit and replay vector and every resharding matrix equal, class for class) and read a solution back into
the same layouts, node for node along ``ScopeKey.names``. The key holds, per node of the scope in graph order
(the builder's boundary values first, then its nodes, then the truncated instances' dropped nodes), everything
the build reads about it by name: its op and strategy signature (target, argument shapes and values,
``strategies.strategy_signature``), its inputs and its readers in the scope as positions in the scope (an
input outside it as "outside"), whether a reader lies outside, its strategy count, whether it needs a
gradient, the bytes it saves and the casts autocast keeps for it, its recompute region, its repeated-block
class and position (instances numbered in the scope), its truncation twin and weight, its placeholder kind
and its ZeRO level; and of the stage everything else the build reads: the cluster, the logical mesh, B, the
in-flight count, the node width, the training spec less its per-parameter levels, whether the optimizer is
priced and whether repeated blocks are truncated. The budget is the problem's memory bound only (no price
reads it): a stage of another budget takes the build with its own. Pinned strategies are read by name: no
key is made under pins (``scope_key`` returns None).

An interleaved pipeline's middle chunks at one in-flight count are such scopes (Llama-2-70B on 64 H100s: 5 of
16 chunks); their solves were already shared (``ilp_reuse``), their builds were not. The stage's solution
is read back through the earlier build and renamed (``renamed``).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from autopar.passes.block_truncation import truncation
from autopar.passes.intra_op import BuiltProblem, IntraOpSolution, build_problem
from autopar.passes.strategies import strategy_signature


class ChunkBuilds:
    """One pipeline's stage builds: ``build`` answers a stage whose ``scope_key`` an earlier stage had with that
    stage's build and the names that map its nodes onto this stage's; ``pinned``: the user pinned strategies
    (then every stage is built); ``build``: how a stage is built (``intra_op.build_problem``'s signature)."""

    def __init__(self, pinned: bool, build=build_problem):
        self.pinned, self._build = pinned, build
        self.reused = 0
        self._built: dict[tuple, tuple[BuiltProblem, tuple[str, ...]]] = {}

    def build(self, graph, strategies: dict, blocks, env, budget: float | None, subset: set[str],
              truncate: bool) -> tuple[BuiltProblem, dict[str, str] | None]:
        """(the stage's problem, None) when built here; (an earlier stage's, its names -> this stage's) when
        the keys are equal. Raises what ``build_problem`` raises."""
        key = scope_key(graph, subset, strategies, blocks, env, truncate, self.pinned)
        hit = self._built.get(key.key) if key is not None else None
        if hit is not None:
            self.reused += 1
            built = hit[0]._replace(problem=dataclasses.replace(hit[0].problem, budget=budget))
            return built, dict(zip(hit[1], key.names))
        built = self._build(graph, strategies, blocks, env, budget, subset=subset, truncate=truncate)
        key = key or scope_key(graph, subset, strategies, blocks, env, truncate, self.pinned)
        if key is not None:
            self._built.setdefault(key.key, (built, key.names))
        return built, None


class ScopeKey(NamedTuple):
    """``key``: the hashable identity of the build (see the module docstring); ``names``: the scope's node
    names in the key's order, so position i of one scope is position i of another of the same key."""

    key: tuple
    names: tuple[str, ...]


def scope_key(graph, subset: set[str], strategies: dict, blocks, env, truncate: bool,
              pinned: bool) -> ScopeKey | None:
    """The key of ``build_problem(graph, strategies, blocks, env, budget, subset=subset, truncate=truncate)``
    whatever the budget (it is the problem's memory bound only, read by no price),
    or None where one cannot be made: strategies pinned by name, or the graph's gradient facts not computed
    yet for the env's device type (the first build computes them: ``intra_op_groups.GroupBuilder``)."""
    info = getattr(graph, "_grad_info", None)
    if pinned or info is None or info[0] != env.cluster.device_type:
        return None
    _, needs, saved, casts = info
    alias, stands_for = truncation(graph, blocks, subset) if truncate else ({}, {})
    names = _scope_names(graph, subset, alias)
    position = {name: i for i, name in enumerate(names)}
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    kinds = {p.name: p.kind for p in graph.placeholders}
    regions: dict[object, int] = {}
    instances: dict[tuple, int] = {}
    training, levels = env.training, dict(env.training.zero)
    rows = []
    for name in names:
        node = nodes[name]
        where = blocks.where.get(name) if blocks is not None else None
        block = (where[0], instances.setdefault(where[:2], len(instances)), where[2]) if where else None
        region = env.recomputed.get(name)
        rows.append((
            node.op, strategy_signature(node) if node.op != "output" else "output",
            tuple(position.get(a.name, -1) for a in node.all_input_nodes),
            tuple(position[u.name] for u in node.users if u.name in position),
            any(u.name not in position for u in node.users),
            len(strategies.get(name, ())), name in needs, saved.get(name), casts.get(name),
            None if region is None else regions.setdefault(region, len(regions)), block,
            position.get(alias.get(name), -1), stands_for.get(name), kinds.get(name),
            levels.get(name, 0), training.zero_search and name not in levels))
    stage = (id(strategies), id(env.cluster), tuple(env.mesh_shape), dataclasses.replace(training, zero=()),
             env.microbatches, env.inflight, env.devices_per_node, env.price_optimizer, truncate)
    return ScopeKey((stage, tuple(rows)), tuple(names))


def _scope_names(graph, subset: set[str], alias: dict[str, str]) -> list[str]:
    """The builder's scope (``GroupBuilder._scope``: values read from outside first, then the nodes in scope),
    then the dropped nodes of truncated instances, each list in graph order."""
    inside, dropped = [], []
    for node in graph.gm.graph.nodes:
        if node.name in alias:
            dropped.append(node)
        elif node.name in subset or (node.op == "placeholder" and any(u.name in subset for u in node.users)):
            inside.append(node)
    boundary = {a.name: None for n in inside if n.op != "placeholder" for a in graph.view(n).tensor_args
                if a.op == "call_function" and a.name not in subset}
    return [*boundary, *(n.name for n in inside), *(n.name for n in dropped)]


def renamed(solution: IntraOpSolution, names: dict[str, str]) -> IntraOpSolution:
    """``solution`` of one scope as the solution of another of the same key: every node name mapped by
    ``names`` (position for position of their ``ScopeKey.names``). Strategies are the same objects: nodes of
    equal strategy signatures have the same strategy list, index for index."""
    groups = [dataclasses.replace(g, leader=names[g.leader], members=[names[m] for m in g.members],
                                  pick=[{names[m]: i for m, i in p.items()} for p in g.pick])
              for g in solution.groups]
    return dataclasses.replace(
        solution, strategies={names[n]: s for n, s in solution.strategies.items()}, groups=groups,
        inputs={names[n]: s for n, s in solution.inputs.items()}, sends={names[n] for n in solution.sends},
        zero={names[n]: level for n, level in solution.zero.items()})
