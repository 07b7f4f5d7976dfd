"""Pass 4, intra_op: choose one sharding strategy per node with the ILP of ``passes/ilp.py``.

Input:  ``ModelGraph``, strategies per node (``passes/strategies``), ``RepeatedBlocks``, a ``CostEnv``,
        optionally a ``subset`` of node names (one pipeline stage; its inputs from other stages are free).
Output: ``IntraOpSolution``: a ``Strategy`` per node in scope, the predicted per-step time split into
        compute, communication and gradient sync, the per-device peak memory, and the chosen group
        prices (``inter_op`` reads per-layer costs from them).

How the ILP stays small (invariants):
  * decisions are made per group (see ``intra_op_groups``): light ops follow their producer, single-use
    placeholders follow their reader;
  * groups at the same position in instances of one repeated-block class form one ILP *class*: costs
    and edges add up over instances, and identical layers get one shared solution;
  * groups with a single strategy (factories, the output) are fixed and get no variables.

Objective (seconds per training step, B = microbatches): B · (compute + activation communication) +
gradient synchronization of parameters (once per step, as the runtime does it after backward) + the
optimizer step over each parameter's local shard at its ZeRO level (``intra_op_zero.price_optimizer_step``;
kept out of ``step_time``, which ``plan_builder`` adds the stage's optimizer step to itself).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import torch

from autopar.cost_models.communication import axis_links, redistribute_cost, spec_number
from autopar.cost_models.memory import TrainingSpec
from autopar.hardware.cluster import Cluster
from autopar.passes.ilp import IlpProblem, IlpResult, evaluate, memory_of, solve_ilp, units_of
from autopar.passes.ilp_reuse import SolutionMemo
from autopar.passes.intra_op_groups import Group, GroupBuilder
from autopar.passes.intra_op_prices import edge_matrices, price_groups, shared_sync_rebates
from autopar.passes.intra_op_zero import add_zero_columns, chosen_levels, keep_needed_zero, price_optimizer_step
from autopar.passes.strategies.base import Strategy


@dataclasses.dataclass
class CostEnv:
    """Everything that prices strategies on one logical mesh.

    microbatches: B, the number of microbatches per step (1 without pipelining);
    inflight: how many microbatches' activations are alive at once (1F1B stage s of S: S - s).
    devices_per_node: width of the physical submesh (defaults to the cluster's node width).
    recomputed: {op name: region key} of the ops whose activations backward recomputes (they save
    nothing, ``intra_op_groups.recompute_saved``; each region's replay is a row of the ILP's memory,
    ``_class_replay``).
    """

    cluster: Cluster
    mesh_shape: tuple[int, int]
    training: TrainingSpec = dataclasses.field(default_factory=TrainingSpec)
    microbatches: int = 1
    inflight: int = 1
    devices_per_node: int | None = None
    recomputed: dict[str, object] = dataclasses.field(default_factory=dict)
    price_optimizer: bool = True  # the optimizer step in the objective (``intra_op_zero.price_optimizer_step``)

    def __post_init__(self):
        self.links = axis_links(self.cluster, self.mesh_shape, self.devices_per_node)
        self._reshard_cache = _reshard_cache(self.mesh_shape, self.links)

    def reshard(self, val: torch.Tensor, src, dst, grad_axes, needs_grad: bool,
                bucketed_sync: bool = False, numbers: tuple[int, int] | None = None) -> tuple[float, float]:
        """(forward, backward) seconds of one redistribution; ``bucketed_sync`` for a parameter, whose
        gradient all-reduce the runtime flattens with the others (``redistribute_cost``). Cached by the specs'
        ``spec_number``s (``numbers``: the caller's, when it has them), never by hashing the specs."""
        src_id, dst_id = numbers if numbers is not None else (spec_number(src), spec_number(dst))
        key = (tuple(val.shape), val.dtype, src_id, dst_id, grad_axes, needs_grad, bucketed_sync)
        hit = self._reshard_cache.get(key)
        if hit is None:
            hit = redistribute_cost(tuple(val.shape), val.element_size(), src, dst, self.mesh_shape, self.links,
                                    grad_axes, needs_grad, bucketed_sync=bucketed_sync, numbers=(src_id, dst_id))
            self._reshard_cache[key] = hit
        return hit


_RESHARD_CACHES: dict[tuple, tuple[tuple, dict]] = {}
_RESHARD_ENTRIES_KEPT = 400_000  # past this many prices in all (~120 MB), the caches start again


def _reshard_cache(mesh_shape: tuple[int, int], links: tuple) -> dict:
    """The redistribution prices of every ``CostEnv`` whose axes price alike (same mesh, same links), shared:
    a price depends only on the shapes, specs and flags in its key and on the axis links, and the planner
    prices the same mesh at many microbatch counts and stage scopes. Links are told apart by their numbers
    and by the identity of their (frozen) ``Link``, which the entry keeps alive so the identity stays unique."""
    key = (tuple(mesh_shape), tuple((a.size, a.latency, a.bandwidth, a.mesh, id(a.link)) for a in links))
    hit = _RESHARD_CACHES.get(key)
    if hit is None:
        if sum(len(cache) for _, cache in _RESHARD_CACHES.values()) > _RESHARD_ENTRIES_KEPT:
            _RESHARD_CACHES.clear()
        hit = _RESHARD_CACHES[key] = (links, {})
    return hit[1]


@dataclasses.dataclass
class IntraOpSolution:
    """The chosen strategy per node and what the cost model predicts for it (per training step).

    groups/choice/edge_costs expose the priced decision groups: ``choice[g]`` is group g's leader
    strategy, ``edge_costs[(g, h)]`` the chosen entry of their resharding matrix (seconds per step).
    """

    mesh_shape: tuple[int, int]
    strategies: dict[str, Strategy]
    step_time: float
    compute_time: float
    comm_time: float
    sync_time: float
    memory: float
    ilp: IlpResult
    groups: list[Group] = dataclasses.field(default_factory=list)
    choice: list[int] = dataclasses.field(default_factory=list)
    edge_costs: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)
    inputs: dict[str, tuple] = dataclasses.field(default_factory=dict)  # boundary value -> spec it arrives in
    sends: set[str] = dataclasses.field(default_factory=set)            # values later stages read
    weights: list[float] = dataclasses.field(default_factory=list)      # per group: instances it stands for
    zero: dict[str, int] = dataclasses.field(default_factory=dict)      # parameter -> ZeRO level the ILP chose
    zero_gather: float = 0.0                                            # seconds of level 2's after-step gathers
    zero3_gather: float = 0.0       # seconds per step of level 3's gathers compute does not hide (in comm_time)
    zero3_unit: float = 0.0         # bytes of gathered level-3 units the ILP's memory row estimated (in memory)
    optimizer_time: float = 0.0     # seconds of the optimizer step the objective priced (not in step_time)


class BuiltProblem(NamedTuple):
    """The ILP of one stage and how to read its solution back: ``builder`` holds the groups (and their
    weights: instances of a repeated block they stand for), ``class_of[g]`` the ILP class of group g,
    ``edges[(g, h)]`` the group-level resharding matrices the class edges were summed from."""

    builder: GroupBuilder
    problem: IlpProblem
    class_of: list[int]
    edges: dict[tuple[int, int], np.ndarray]


def build_problem(graph, strategies, blocks, env: CostEnv, budget: float | None, subset: set[str] | None = None,
                  truncate: bool = False):
    """Group, price and collapse repeated blocks into a ``BuiltProblem``.

    truncate: build only the first two instances of each repeated block (see ``intra_op_groups``); the
    problem is the same, weighted, and the solution is expanded to every instance."""
    b = GroupBuilder(graph, strategies, env, subset, blocks if truncate else None)
    b.build_groups()
    price_groups(b)
    add_zero_columns(b)
    price_optimizer_step(b)
    edges = edge_matrices(b)
    for key, m in shared_sync_rebates(b).items():
        edges[key] = edges.get(key, 0) + m
    class_of = _share_classes(b, blocks)
    n_classes = max(class_of) + 1
    cost, mem, peak = [None] * n_classes, [None] * n_classes, [None] * n_classes
    for g, group in enumerate(b.groups):
        c, w = class_of[g], b.weight(g)
        cost[c] = w * group.cost if cost[c] is None else cost[c] + w * group.cost
        mem[c] = w * group.mem if mem[c] is None else mem[c] + w * group.mem
        peak[c] = group.peak if peak[c] is None else np.maximum(peak[c], group.peak)
    class_edges: dict[tuple[int, int], np.ndarray] = {}
    for (gu, gv), m in edges.items():
        cu, cv = class_of[gu], class_of[gv]
        m = b.weight(gv) * m
        if cu == cv:
            cost[cu] = cost[cu] + np.diag(m)
        else:
            class_edges[(cu, cv)] = class_edges.get((cu, cv), 0) + m
    replay = _class_replay(b, class_of, n_classes) if env.recomputed else None
    return BuiltProblem(b, IlpProblem(cost, mem, class_edges, budget, peak, _class_units(b.groups, class_of), replay),
                        class_of, edges)


def _class_replay(b, class_of: list[int], n_classes: int) -> list[list[np.ndarray | None]] | None:
    """One row per recomputed region (``ilp_model.replay_rows``), per class the bytes a strategy adds:

        w_{r,c} = Σ_{ops of c in r} saved bytes without recompute   −   Σ_{groups of c after r} act / inflight

    Backward re-creates what the region's ops would have saved while it replays them, and by then every
    group after the region has freed what it keeps of this microbatch (``passes.recompute``'s replay, per
    op). A region of a truncated block's instance 1 stands for its later instances: the groups after it
    are those after the whole block, as for the last instance (whose replay is the largest)."""
    position = {n.name: i for i, n in enumerate(b.graph.gm.graph.nodes)}
    regions: dict[object, list[tuple[int, str]]] = {}
    for g, group in enumerate(b.groups):
        for name in group.members:
            if name in b.env.recomputed and name not in b.boundary:
                regions.setdefault(b.env.recomputed[name], []).append((g, name))
    rows = []
    for members in regions.values():
        row: list[np.ndarray | None] = [None] * n_classes
        for g, name in members:
            vec = np.array([b.replay_bytes(name, b.strategies[name][pick[name]]) for pick in b.groups[g].pick])
            row[class_of[g]] = vec if row[class_of[g]] is None else row[class_of[g]] + vec
        last = max(position[name] for _, name in members)
        for g, group in enumerate(b.groups):
            if position[group.leader] > last and group.mem_act.any():
                vec = -b.weight(g) * group.mem_act / b.env.inflight
                row[class_of[g]] = vec if row[class_of[g]] is None else row[class_of[g]] + vec
        rows.append(row)
    return rows or None


def _class_units(groups, class_of: list[int]) -> list[np.ndarray] | None:
    """Per class, the ZeRO-3 units its columns keep gathered (``intra_op_zero``); None when there are none."""
    if not any(g.zero3_unit is not None and g.zero3_unit.any() for g in groups):
        return None
    units = [None] * (max(class_of) + 1)
    for c, group in zip(class_of, groups):
        mine = group.zero3_unit if group.zero3_unit is not None else np.zeros(len(group.pick))
        units[c] = mine if units[c] is None else np.maximum(units[c], mine)
    return units


def _bucket_startup(env: CostEnv) -> float:
    """The α of the flattened gradient all-reduces (``runtime.gradsync.reduce_deferred``: one per synced
    mesh axis per step), which per-parameter prices leave out (``redistribute_cost(bucketed_sync=True)``).
    Charged for every axis of size > 1 when any gradient is synced: an upper bound, and a constant the ILP
    does not need, since it differs between layouts by at most a few α."""
    return sum(link.startup_time("all_reduce") for link in env.links if link.size > 1)


def _share_classes(b: GroupBuilder, blocks) -> list[int]:
    """Map each group to an ILP class; groups at the same place in identical blocks share one."""
    key_to_class: dict[tuple, int] = {}
    class_of = []
    for g, group in enumerate(b.groups):
        key = _group_key(b, group, blocks) if blocks is not None else None
        if key is None:
            key = ("unique", g)
        class_of.append(key_to_class.setdefault(key, len(key_to_class)))
    return class_of


def _group_key(b: GroupBuilder, group: Group, blocks) -> tuple | None:
    """("block", class, member positions, picks) when the whole group sits in one block instance.

    The picks (each member's strategy index per leader strategy) are part of the key, so two groups
    share a class only when index i means the same layout in both.
    """
    calls = [m for m in group.members if b.nodes[m].op == "call_function"]
    if any(m in b.boundary for m in calls):
        return None
    where = [blocks.where.get(m) for m in calls]
    if not where or any(w is None for w in where):
        return None
    if len({w[0] for w in where}) != 1 or len({w[1] for w in where}) != 1:
        return None
    picks = tuple(tuple(p[m] for m in group.members) for p in group.pick)
    return ("block", where[0][0], tuple(w[2] for w in where), picks)


def solve_intra_op(graph, strategies, blocks, env: CostEnv, budget: float | None = None,
                   time_limit: float = 60.0, subset: set[str] | None = None, truncate: bool = False,
                   memo: SolutionMemo | None = None) -> IntraOpSolution:
    """Build and solve the ILP, then read back one strategy per node and the predicted costs."""
    built = build_problem(graph, strategies, blocks, env, budget, subset, truncate)
    return solve_built(built, env, time_limit, memo=memo)


def solve_built(built: BuiltProblem, env: CostEnv, time_limit: float, budget: float | None = None,
                memo: SolutionMemo | None = None, presolve: bool = True,
                result: IlpResult | None = None) -> IntraOpSolution:
    """Solve an already built problem (with ``budget`` replacing its memory bound when given); ``memo``
    answers it from an earlier, provably equivalent solve when it can (``ilp_reuse``); ``presolve``: see
    ``ilp.solve_ilp``; ``result``: the problem's solution, found already (``ilp_reuse.solve_walks``)."""
    b, problem, class_of, edges = built
    if budget is not None:
        problem = dataclasses.replace(problem, budget=budget)
    if result is None and memo is not None:
        result = memo.lookup(problem)
    if result is None:
        result = solve_ilp(problem, time_limit, presolve=presolve)
        if memo is not None:
            memo.store(problem, result)
    kept = keep_needed_zero(problem, result.choice, b.groups, class_of)
    if kept != list(result.choice):
        result = dataclasses.replace(result, choice=kept, objective=evaluate(problem, kept))
    choice = [result.choice[class_of[g]] for g in range(len(b.groups))]
    chosen: dict[str, Strategy] = {}
    inputs: dict[str, tuple] = {}
    compute = comm = sync = gather = gather3 = optimizer = 0.0
    zero: dict[str, int] = {}
    picked: dict[str, int] = {}  # each member's index in its strategy list
    for g, (group, i) in enumerate(zip(b.groups, choice)):
        for name in group.members:
            picked[name] = group.pick[i][name]
            strategy = b.strategies[name][picked[name]]
            if name in b.boundary:
                inputs[name] = strategy.out_spec
            else:
                chosen[name] = strategy
        w = b.weight(g)
        step = w * group.optimizer[i] if group.optimizer is not None else 0.0
        optimizer += step
        compute += w * (group.cost[i] - group.comm[i]) - step
        comm += w * group.comm[i]
        sync += w * group.sync[i]
        zero.update(chosen_levels(b, group, i))
        gather += w * group.zero_gather[i] if group.zero_gather is not None else 0.0
        gather3 += w * group.zero3_gather[i] if group.zero3_gather is not None else 0.0
    # Truncated instances take their instance-1 twin's layout and level: the same index in their own list (the
    # lists hold no duplicates, so this is the twin's first equal strategy, found without comparing specs).
    for dropped, twin in b.alias.items():
        chosen[dropped] = b.strategies[dropped][picked[twin]]
        if twin in zero:
            zero[dropped] = zero[twin]
    edge_costs = {key: b.weight(key[1]) * float(m[choice[key[0]], choice[key[1]]]) for key, m in edges.items()}
    comm += sum(edge_costs.values())
    assert abs(compute + comm + optimizer - evaluate(problem, result.choice)) <= 1e-6 * max(1.0, compute + comm)
    bucket = _bucket_startup(env) if sync > 0 else 0.0
    comm, sync = comm + bucket, sync + bucket
    return IntraOpSolution(env.mesh_shape, chosen, compute + comm, compute, comm, sync,
                           memory_of(problem, result.choice), result, b.groups, choice, edge_costs, inputs,
                           set(b.sends_real), [b.weight(g) for g in range(len(b.groups))], zero, gather, gather3,
                           units_of(problem, result.choice), optimizer)
