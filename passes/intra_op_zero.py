"""Weight-update sharding (ZeRO) as ILP candidates: extra strategy columns for groups that hold parameters.

Invariants and formulas:
  * For a group whose members include parameters whose level the ILP chooses (``TrainingSpec.zero_searched``),
    every leader strategy i under which some such parameter is replicated on a mesh axis of size > 1 gets two
    twin columns: the same picks (so the same layouts, op times and resharding edges), with those parameters at
    ZeRO level 2 and at level 3 over their n = ∏(sizes of the axes they are replicated on) ways. With
    g = Σ_p Σ_{replicated axes a} bandwidth_time_a(all_gather, local bytes of p) and B microbatches:

        level 2: mem_param' = mem_param − Σ_p [param_bytes(p, 0) − param_bytes(p, 2)]
                 cost' = cost + g,  comm' = comm + g,  sync' = sync + g          (after-step all-gather)
        level 3: mem_param' = mem_param − Σ_p [param_bytes(p, 0) − param_bytes(p, 3)]
                 cost' = cost + B·e,  comm' = comm + B·e,  sync' = sync        (gathers in every forward
                 and backward, prefetched: e = max(0, g3 − c/3) + max(0, g3 − 2c/3), the part of them the
                 column's own compute c per microbatch does not hide, ``cost_models.zero3.group_exposed``)
                 units' = U = 2 · max(largest local elements of p, min(bucket_bytes / 4, Σ parameter elements))
                              · gather itemsize

    g3 is g at the gather dtype (the policy's compute dtype when it has one: half g for fp32 weights in
    bf16). Summed over groups, e bounds from above the stage's exposed gathers less the first unit's
    (``cost_models.zero3``: the sound per-group approximation; the plan charges the exact formula). The
    reduce-scatter both levels sync gradients with is priced as the all-reduce it replaces (the ILP charges
    the whole sync, hidden or not), so level 3 − level 2 = B·e − g: where compute hides the gathers level 3
    prices below level 2, and ``keep_needed_zero`` keeps it only where level 2's memory does not fit. U is
    the gathered units: the runtime gathers a whole sync bucket (``ir.buckets``, at least ``bucket_bytes``
    at 4 bytes an element unless the parameters are fewer, at most that plus its last parameter) and holds
    it from its prefetch to its last read, at most two at once. Units stay gathered across other groups'
    ops, so the ILP adds the largest chosen U to its memory row beside the largest transient
    (``ilp_model``: the U column), an upper bound; the tests measure the runtime's peak.
    ``plan_builder.charge_zero3`` replaces the estimate by the exact peak of the stage's buckets after the
    solve (``IntraOpSolution.zero3_unit`` is what it takes out), so the plan predicts what ranks hold and the
    ILP's budget errs on the safe side.
  * A forced level 3 (``zero=3`` or a glob) is charged the same U on every column where the parameter is
    replicated, so the memory row holds the gathered unit whether the level was chosen or forced.
  * Level 1 is not offered: it moves the same bytes as 2 and keeps more (the whole gradient), so level 2
    dominates it. A forced ``zero=1`` is honoured as before.
  * The optimizer step is in every parameter column's price (``price_optimizer_step``, after the twins):
    at levels 2 and 3 each rank steps 1/n of the state, so with memory loose a twin can be priced below its
    base (level 2: g − t_opt·(1 − 1/n) < 0 where the gather link is faster than memory_bandwidth / traffic
    per byte, e.g. NVLink beside HBM), and then it is kept. ``plan_builder`` predicts the step with the same
    function, so the two agree on which level is faster. A stage's first level-3 unit costs more than its
    per-group prices say (``plan_builder.charge_zero3`` charges at least one unit's gathers per microbatch
    and direction, however well compute hides the rest: once per stage, so no group's price can hold it),
    so ``keep_needed_zero`` gives level 3 up altogether where the stage fits without it and the prices gain
    less than F = 2·B·the largest chosen unit's all-gather (``zero3_first``).
  * The stage DP's per-layer latency leaves the optimizer step out (``layer_costs``), as before: stage
    boundaries do not change how many elements a stage steps in total, only which ILP shards them.
  * No new constraint family: a twin is one more strategy of the group's ILP class. Identical layers share
    a class (``intra_op._share_classes``), so they get one level. Column 0 stays level 0, so "the fully
    replicated plan" (``choice 0``) still means no ZeRO.
  * Groups with a single strategy are fixed (their edges were priced into their readers) and get no twins.
  * ``keep_needed_zero``: with a relative MIP gap the solver may return a twin whose price is within the gap;
    every twin whose base column also fits the budget and is priced no higher is reverted (same edges),
    smallest memory increase first, and a level-3 twin whose base does not fit falls back to its level-2
    sibling where that fits and is priced no higher; then every base column moves to its cheapest strictly
    cheaper twin that fits (a saving through the optimizer step is a small share of the objective, within
    the gap). So a plan shards weight updates as far as memory asks or the step gets faster, and between
    levels 2 and 3 takes the one the cost model prices faster: level 3 where compute hides its prefetched
    gathers better than level 2 hides nothing of its after-step all-gather.
  * The stage DP (``inter_op``) sees the twins only through its per-option memory points: the unconstrained
    solution, its ZeRO-2 variant, a lean solve, and the ZeRO-3 variant (``layer_costs.zero3_variant``: every
    base column moved to its level-3 twin, no solve), which ``choose_stages`` offers only where nothing fits
    without it. Why not always: the DP prices a level-3 layer's gathers at its small reference microbatch and
    scales them with the microbatch, and plans it prefers through them need not be faster once solved exactly
    (GPT-39B on 64 V100s: 53.8 s per step became 58.9 s, planning +35 % CPU). Where it is offered, the lean
    solve cannot stand in for it: its budget (1.25 × the least memory) counts activations that recompute later
    drops, so at long sequences it spends the margin on faster layouts with weights replicated (Llama-3-8B at
    128K tokens on 8 H100s had no plan at zero="auto"; the ZeRO-3 variant with full recompute fits). Each
    chosen stage's exact solve then picks levels 0, 2 or 3 per group as above.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from autopar.cost_models.communication import zero_gather_time
from autopar.cost_models.compute import optimizer_step_time, stepped_numel
from autopar.cost_models.offload import host_optimizer_seconds
from autopar.cost_models.zero3 import bucket_numel, group_exposed, unit_bytes
from autopar.passes.ilp import memory_of
from autopar.placement import local_shape


class _Effect(NamedTuple):
    saved2: float     # bytes a level-2 twin saves
    saved3: float     # bytes a level-3 twin saves
    gather: float     # seconds level 2 adds: the after-step all-gather (``communication.zero_gather_time``)
    gather3: float    # the same at the gather dtype (what a level-3 unit moves)
    numel: float      # local elements of the parameter (what a level-3 unit gathers of it)
    itemsize: int     # bytes per element a level-3 unit gathers


_NONE = _Effect(0.0, 0.0, 0.0, 0.0, 0.0, 0)


def add_zero_columns(b) -> None:
    """Append ZeRO twins to every eligible group of builder ``b`` (after ``price_groups``, before edges), and
    charge the gathered units of forced level-3 parameters to the columns that replicate them."""
    training, effects = b.env.training, {}
    unit_floor = _unit_floor(b)
    for group in b.groups:
        params = [m for m in group.members if m in b.params and m not in b.boundary]
        if params:
            _charge_forced_units(b, group, params, unit_floor, effects)
        if len(group.pick) < 2 or not params or not training.zero_search \
                or not all(training.zero_searched(p) for p in params):
            continue
        twins = []
        for i, pick in enumerate(group.pick):
            found = [_effect(b, name, pick[name], effects) for name in params]
            if sum(e.saved2 for e in found) > 0:
                twins.append((i, 2, sum(e.saved2 for e in found), sum(e.gather for e in found), 0.0, 0.0))
                twins.append((i, 3, sum(e.saved3 for e in found), sum(e.gather3 for e in found),
                              _units(found, unit_floor), _first_unit(found, unit_floor)))
        if twins:
            _append_twins(group, twins, b.env.microbatches)


def _unit_floor(b) -> float:
    """The fewest elements a gathered unit has: a bucket's, or every parameter in scope if fewer."""
    total = sum(float(b.nodes[n].meta["val"].numel()) for n in b.params if n not in b.boundary)
    return bucket_numel(float(b.env.training.bucket_bytes), total)


def _units(found: list[_Effect], unit_floor: float) -> float:
    """Bytes of the two units a level-3 column keeps gathered (module docstring)."""
    largest = max(found, key=lambda e: e.numel)
    return unit_bytes(largest.numel, unit_floor, largest.itemsize)


def _first_unit(found: list[_Effect], unit_floor: float) -> float:
    """Seconds of one all-gather of the largest unit a level-3 column gathers (its largest parameter's
    per-element gather time, over max(its elements, a bucket's))."""
    largest = max(found, key=lambda e: e.numel)
    return largest.gather3 * max(largest.numel, unit_floor) / largest.numel


def _charge_forced_units(b, group, params: list[str], unit_floor: float, effects: dict) -> None:
    forced = [p for p in params if not b.env.training.zero_searched(p) and b.env.training.zero_level(p) >= 3]
    if not forced:
        return
    units = np.zeros(len(group.pick))
    for i, pick in enumerate(group.pick):
        units[i] = _units([_effect(b, name, pick[name], effects) for name in forced],
                          unit_floor)
    group.zero3_unit = units


def _effect(b, name: str, index: int, cache: dict) -> _Effect:
    """What putting parameter ``name`` stored as its strategy ``index``'s spec at levels 2 and 3 changes
    (``_NONE`` when it is not replicated on any axis of size > 1). Cached by (name, index): ints, where a
    spec key would hash its Placements in Python on every probe."""
    key = (name, index)
    if key not in cache:
        val, spec = b.nodes[name].meta["val"], b.strategies[name][index].out_spec
        mesh = b.env.mesh_shape
        axes = [a for a, (size, p) in enumerate(zip(mesh, spec)) if size > 1 and not p.is_shard()]
        if not axes:
            cache[key] = _NONE
        else:
            numel = float(math.prod(local_shape(tuple(val.shape), spec, mesh)))
            ways = math.prod(mesh[a] for a in axes)
            price = b.env.training.param_bytes
            level0 = price(name, numel, val.dtype, ways, level=0)
            item = b.env.training.compute_itemsize or val.element_size()  # the gather dtype's
            after_step = sum(zero_gather_time(b.env.links[a], numel * val.element_size()) for a in axes)
            gather3 = sum(b.env.links[a].bandwidth_time("all_gather", numel * item) for a in axes)
            cache[key] = _Effect(level0 - price(name, numel, val.dtype, ways, level=2),
                                 level0 - price(name, numel, val.dtype, ways, level=3), after_step, gather3,
                                 numel, item)
    return cache[key]


def _append_twins(group, twins: list[tuple[int, int, float, float, float, float]], microbatches: int) -> None:
    """twins: (base column, level, bytes saved, all-gather seconds g, unit bytes, one unit's all-gather
    seconds) each; see module docstring."""
    n = len(group.pick)
    base = [t[0] for t in twins]
    level = np.array([t[1] for t in twins])
    gather = np.array([t[3] for t in twins])
    after_step = np.where(level == 2, gather, 0.0)
    compute = (group.cost[base] - group.comm[base]) / microbatches  # forward + backward per microbatch
    per_microbatch = np.where(level == 3, microbatches * group_exposed(gather, compute), 0.0)
    unit = np.array([t[4] for t in twins])
    prior_unit = group.zero3_unit if group.zero3_unit is not None else np.zeros(n)
    group.pick.extend(dict(group.pick[i]) for i in base)
    group.cost = np.concatenate([group.cost, group.cost[base] + after_step + per_microbatch])
    group.comm = np.concatenate([group.comm, group.comm[base] + after_step + per_microbatch])
    group.sync = np.concatenate([group.sync, group.sync[base] + after_step])
    group.mem_param = np.concatenate([group.mem_param, group.mem_param[base] - np.array([t[2] for t in twins])])
    group.mem_act = np.concatenate([group.mem_act, group.mem_act[base]])
    group.peak = np.concatenate([group.peak, group.peak[base]])
    group.zero3_unit = np.concatenate([prior_unit, prior_unit[base] + unit])
    group.zero_base = np.concatenate([np.arange(n), base]).astype(int)
    group.zero_level = np.concatenate([np.zeros(n), level]).astype(int)
    group.zero_gather = np.concatenate([np.zeros(n), after_step])
    group.zero3_gather = np.concatenate([np.zeros(n), per_microbatch])
    group.zero3_first = np.concatenate([np.zeros(n), 2 * microbatches * np.array([t[5] for t in twins])])


def keep_needed_zero(problem, choice: list[int], groups, class_of: list[int]) -> list[int]:
    """``choice`` with every ZeRO twin reverted to its base column (or a level-3 twin to its level-2 sibling)
    where that is priced no higher and keeps the memory within the budget (to the base, without a budget),
    every base column moved to its cheapest strictly cheaper twin that fits, and level 3 given up where the
    stage fits without it for less than its first unit's gathers; see the module docstring."""
    twins_of: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    first: dict[int, np.ndarray] = {}
    for g, group in enumerate(groups):
        if group.zero_base is not None:
            c = class_of[g]
            twins_of.setdefault(c, (group.zero_base, group.zero_level))
            first[c] = group.zero3_first if c not in first else np.maximum(first[c], group.zero3_first)
    choice = _revert_twins(problem, list(choice), twins_of)
    choice = _take_cheaper_twins(problem, choice, twins_of)
    return _without_level3_if_cheaper(problem, choice, twins_of, first)


def _fits(problem, trial: list[int]) -> bool:
    return problem.budget is None or memory_of(problem, trial) <= problem.budget


def _revert_twins(problem, choice: list[int], twins_of: dict) -> list[int]:
    chosen = [c for c, (base, _) in twins_of.items() if base[choice[c]] != choice[c]]
    chosen.sort(key=lambda c: problem.mem[c][twins_of[c][0][choice[c]]] - problem.mem[c][choice[c]])
    for c in chosen:
        base, level = twins_of[c]
        cost = problem.cost[c]
        fallbacks = [int(base[choice[c]])] if cost[base[choice[c]]] <= cost[choice[c]] else []
        if level[choice[c]] == 3:
            fallbacks += [j for j in range(len(base)) if base[j] == base[choice[c]] and level[j] == 2
                          and cost[j] <= cost[choice[c]]]
        choice = _first_that_fits(problem, choice, c, fallbacks)
    return choice


def _first_that_fits(problem, choice: list[int], c: int, columns) -> list[int]:
    for column in columns:
        trial = list(choice)
        trial[c] = int(column)
        if _fits(problem, trial):
            return trial
    return choice


def _take_cheaper_twins(problem, choice: list[int], twins_of: dict) -> list[int]:
    """Each class still at a base column moved to the cheapest of its twins priced strictly below it that
    fits, largest saving first. A twin keeps its base's picks and edges, so the objective falls by exactly
    the price difference: this only settles what a relative MIP gap leaves open (a twin cheaper through the
    optimizer step alone saves a small share of the step)."""
    gains = []
    for c, (base, _) in twins_of.items():
        if base[choice[c]] != choice[c]:
            continue
        cost = problem.cost[c]
        cheaper = sorted((float(cost[j]), int(j)) for j in np.flatnonzero(base == choice[c])
                         if cost[j] < cost[choice[c]])
        if cheaper:
            gains.append((cheaper[0][0] - float(cost[choice[c]]), c, [j for _, j in cheaper]))
    for _, c, columns in sorted(gains):
        choice = _first_that_fits(problem, choice, c, columns)
    return choice


def _without_level3_if_cheaper(problem, choice: list[int], twins_of: dict, first: dict) -> list[int]:
    """``choice`` with every level-3 class moved to the cheapest of its base and level-2 sibling, where all
    of them fit so and the objective grows by less than F = the largest first-unit charge among them
    (``zero3_first``: 2·B·one unit's all-gather, which ``plan_builder`` charges once per stage with any
    level 3, however well compute hides the rest, and the per-group prices leave out)."""
    at3 = [c for c, (_, level) in twins_of.items() if level[choice[c]] == 3]
    if not at3:
        return choice
    floor = max(float(first[c][choice[c]]) for c in at3)
    trial, grown = list(choice), 0.0
    for c in at3:
        base, level = twins_of[c]
        family = [j for j in range(len(base)) if base[j] == base[choice[c]] and level[j] < 3]
        moved = _first_that_fits(problem, trial, c, sorted(family, key=lambda j: (problem.cost[c][j], j)))
        if moved is trial:
            return choice  # memory needs level 3 here
        grown += float(problem.cost[c][moved[c]] - problem.cost[c][choice[c]])
        trial = moved
    return trial if grown < floor else choice


def price_optimizer_step(b) -> None:
    """Add to every column of a group that holds parameters the seconds of one optimizer step over them
    (``group.optimizer``, also in ``group.cost``; after ``add_zero_columns``), so the ILP weighs what
    ``plan_builder`` predicts: per parameter p stored as spec s at ZeRO level z,

        t_p = optimizer_step_time(local elements of p / (n_p if z >= 1 else 1), 1 tensor)

    (``host_optimizer_seconds`` when the stage steps on the host), n_p = ∏ sizes of the axes s replicates p
    on. A level-2 or -3 twin thus prices the shorter step beside its all-gather. ``CostEnv.price_optimizer``
    False leaves every price as it was."""
    if not b.env.price_optimizer:
        return
    cache: dict = {}
    for group in b.groups:
        params = [m for m in group.members if m in b.params and m not in b.boundary]
        if not params:
            continue
        levels = group.zero_level if group.zero_level is not None else np.zeros(len(group.pick), dtype=int)
        seconds = np.array([sum(_step_seconds(b, name, pick[name], int(level) or b.env.training.zero_level(name),
                                              cache)
                                for name in params) for pick, level in zip(group.pick, levels)])
        group.optimizer = seconds
        group.cost = group.cost + seconds


def _step_seconds(b, name: str, index: int, level: int, cache: dict) -> float:
    """Seconds of the optimizer step over parameter ``name``'s local shard stored as its strategy ``index``'s
    spec at ZeRO ``level`` (``plan_builder._optimizer_seconds``'s price of one tensor; cached as ``_effect``)."""
    key = (name, index, level >= 1)
    if key not in cache:
        val, spec = b.nodes[name].meta["val"], b.strategies[name][index].out_spec
        training = b.env.training
        numel = stepped_numel(val.shape, spec, b.env.mesh_shape, level)
        if training.host_optimizer:
            cache[key] = host_optimizer_seconds(numel, val.element_size(), training.optimizer, b.env.cluster, 1)
        else:
            cache[key] = optimizer_step_time(numel, 1, val.element_size(), training.optimizer, b.env.cluster)
    return cache[key]


def chosen_levels(b, group, column: int) -> dict[str, int]:
    """{parameter: level} that ``group``'s ``column`` puts at a ZeRO level (empty for a base column)."""
    if group.zero_level is None or group.zero_level[column] == 0:
        return {}
    pick = group.pick[column]
    out = {}
    for name in group.members:
        if name in b.params and name not in b.boundary:
            spec = b.strategies[name][pick[name]].out_spec
            if any(size > 1 and not p.is_shard() for size, p in zip(b.env.mesh_shape, spec)):
                out[name] = int(group.zero_level[column])
    return out
