"""Weight-update sharding (ZeRO) as ILP candidates: extra strategy columns for groups that hold parameters.

Invariants and formulas:
  * For a group whose members include parameters whose level the ILP chooses (``TrainingSpec.zero_searched``),
    every leader strategy i under which some such parameter is replicated on a mesh axis of size > 1 gets a
    twin column: the same picks (so the same layouts, op times and resharding edges), with those parameters at
    ZeRO level ``SEARCHED_LEVEL`` over their n = ∏(sizes of the axes they are replicated on) ways:

        mem_param' = mem_param − Σ_p [param_bytes(p, level 0) − param_bytes(p, level 2)]
        cost' = cost + gather,   sync' = sync + gather,   comm' = comm + gather
        gather = Σ_p Σ_{replicated axes a} bandwidth_time_a(all_gather, local bytes of p)

    Gradients are reduce-scattered instead of all-reduced: the same bytes on a ring, so the sync price is
    unchanged; the all-gather of the updated shards after the optimizer step is what ZeRO adds, and nothing
    hides it (``plan_builder.exposed_sync`` charges it the same way).
  * Only level 2 is offered: in this model level 1 moves the same bytes and keeps more (the whole gradient),
    so level 2 dominates it. A forced ``zero=1`` (or a glob) is honoured as before.
  * No new constraint family: a twin is one more strategy of the group's ILP class. Identical layers share
    a class (``intra_op._share_classes``), so they get one level. Column 0 stays level 0, so "the fully
    replicated plan" (``choice 0``) still means no ZeRO.
  * Groups with a single strategy are fixed (their edges were priced into their readers) and get no twins.
  * ``keep_needed_zero``: with a relative MIP gap the solver may return a twin whose gather is within the gap;
    every twin whose base column also fits the budget is reverted (cheaper, same edges), smallest memory
    increase first, so a plan shards weight updates only where memory asks for it.
"""
from __future__ import annotations

import math

import numpy as np

from autopar.passes.ilp import memory_of
from autopar.placement import local_shape

SEARCHED_LEVEL = 2


def add_zero_columns(b) -> None:
    """Append ZeRO twins to every eligible group of builder ``b`` (after ``price_groups``, before edges)."""
    training = b.env.training
    if not training.zero_search:
        return
    effects: dict[tuple, tuple[float, float]] = {}
    for group in b.groups:
        params = [m for m in group.members if m in b.params and m not in b.boundary]
        if len(group.pick) < 2 or not params or not all(training.zero_searched(p) for p in params):
            continue
        twins = []
        for i, pick in enumerate(group.pick):
            saved = gather = 0.0
            for name in params:
                s, g = _effect(b, name, b.strategies[name][pick[name]].out_spec, effects)
                saved, gather = saved + s, gather + g
            if saved > 0:
                twins.append((i, saved, gather))
        if twins:
            _append_twins(group, twins)


def _effect(b, name: str, spec, cache: dict) -> tuple[float, float]:
    """(bytes saved, seconds of all-gather added) by putting parameter ``name`` stored as ``spec`` at
    ``SEARCHED_LEVEL``; (0, 0) when it is not replicated on any axis of size > 1."""
    val = b.nodes[name].meta["val"]
    key = (tuple(val.shape), val.dtype, spec)
    if key not in cache:
        mesh = b.env.mesh_shape
        axes = [a for a, (size, p) in enumerate(zip(mesh, spec)) if size > 1 and not p.is_shard()]
        if not axes:
            cache[key] = (0.0, 0.0)
        else:
            numel = float(math.prod(local_shape(tuple(val.shape), spec, mesh)))
            ways = math.prod(mesh[a] for a in axes)
            price = b.env.training.param_bytes
            saved = price(name, numel, val.dtype, ways, level=0) - price(name, numel, val.dtype, ways,
                                                                           level=SEARCHED_LEVEL)
            nbytes = numel * val.element_size()
            cache[key] = (saved, sum(b.env.links[a].bandwidth_time("all_gather", nbytes) for a in axes))
    return cache[key]


def _append_twins(group, twins: list[tuple[int, float, float]]) -> None:
    n = len(group.pick)
    base = [i for i, _, _ in twins]
    group.pick.extend(dict(group.pick[i]) for i in base)
    gather = np.array([g for _, _, g in twins])
    group.cost = np.concatenate([group.cost, group.cost[base] + gather])
    group.comm = np.concatenate([group.comm, group.comm[base] + gather])
    group.sync = np.concatenate([group.sync, group.sync[base] + gather])
    group.mem_param = np.concatenate([group.mem_param, group.mem_param[base] - np.array([s for _, s, _ in twins])])
    group.mem_act = np.concatenate([group.mem_act, group.mem_act[base]])
    group.peak = np.concatenate([group.peak, group.peak[base]])
    group.zero_base = np.concatenate([np.arange(n), base]).astype(int)
    group.zero_gather = np.concatenate([np.zeros(n), gather])


def keep_needed_zero(problem, choice: list[int], groups, class_of: list[int]) -> list[int]:
    """``choice`` with every ZeRO twin reverted to its base column whose reversal keeps the memory within
    the budget (all of them without a budget); see the module docstring."""
    base_of: dict[int, np.ndarray] = {}
    for g, group in enumerate(groups):
        if group.zero_base is not None:
            base_of.setdefault(class_of[g], group.zero_base)
    choice = list(choice)
    chosen = [c for c, base in base_of.items() if base[choice[c]] != choice[c]]
    chosen.sort(key=lambda c: problem.mem[c][base_of[c][choice[c]]] - problem.mem[c][choice[c]])
    for c in chosen:
        trial = list(choice)
        trial[c] = int(base_of[c][choice[c]])
        if problem.budget is None or memory_of(problem, trial) <= problem.budget:
            choice = trial
    return choice


def chosen_levels(b, group, column: int) -> dict[str, int]:
    """{parameter: level} that ``group``'s ``column`` puts at a ZeRO level (empty for a base column)."""
    if group.zero_base is None or group.zero_base[column] == column:
        return {}
    pick = group.pick[column]
    out = {}
    for name in group.members:
        if name in b.params and name not in b.boundary:
            spec = b.strategies[name][pick[name]].out_spec
            if any(size > 1 and not p.is_shard() for size, p in zip(b.env.mesh_shape, spec)):
                out[name] = SEARCHED_LEVEL
    return out
