"""The planning pipeline. ``plan_model`` and ``plan_graph`` are the table of contents, one line per pass:

    capture             passes/capture          model -> ModelGraph
    microbatches        microbatch_candidates   the B values to try
    repeated blocks     passes/cluster_layers   identical layers, solved once
    strategies          passes/strategies, pins candidate shardings per node (called by every solve)
    layers              passes/cluster_layers   ops -> L layers
    stage costs         passes/inter_op         per-layer costs on every submesh (intra-op ILPs inside)
    stage DP            passes/inter_op         layer ranges x submeshes x B (or the user's stages)
    stage ILPs          passes/intra_op         each chosen stage solved exactly at the chosen B
    plan                autopar/planner/plan_builder    specs as text, collectives, ranks, predicted step time

``plan_builder`` only assembles data; nothing here computes a cost. With ``PlanOptions(debug=True)`` the
invariants each pass promises are checked after it runs (``autopar.planner.invariants``).
"""
from __future__ import annotations

import functools
import time

import torch

from autopar.errors import InfeasibleError, PlanError, budget_unit_hint
from autopar.hardware.cluster import Cluster
from autopar.ir.buffer_writes import written_buffers
from autopar.ir.graph import ModelGraph
from autopar.ir.precision import apply_to_graph
from autopar.ir.precision import resolve as resolve_precision
from autopar.passes.batch_dims import batch_dims, rescale, rescale_is_exact
from autopar.passes.capture import capture
from autopar.passes.chunk_reuse import ChunkBuilds, renamed
from autopar.passes.cluster_layers import cluster_layers, find_repeated_blocks
from autopar.passes.forked import Beside
from autopar.passes.ilp import backend
from autopar.passes.ilp_reuse import solve_walks
from autopar.passes.inter_op import (
    StageChoice,
    StageCosts,
    choose_stages,
    restaged,
)
from autopar.passes.interleave import choose_virtual, dp_schedule, keep_uninterleaved, recorded_schedule
from autopar.passes.intra_op import CostEnv, build_problem, solve_built
from autopar.passes.intra_op_groups import is_light
from autopar.passes.recompute import layer_modes, recomputed_ops, stage_modes
from autopar.passes.stage_owners import subsets_on
from autopar.plan import Plan
from autopar.planner import invariants
from autopar.planner.ahead import cancel, half_ahead, twice_ahead
from autopar.planner.exact_checks import (
    feasible,
    fewer_microbatches,
    more_microbatches,
    or_even_split,
    or_single_stage,
    same_stages_at,
)
from autopar.planner.manual_stages import manual_stages
from autopar.planner.offload_choice import (
    choose_offload,
    offloaded_stages,
    record_offload,
    stage_training,
)
from autopar.planner.options import (
    PlanOptions,
    check_against_graph,
    check_expert_routing,
    first_microbatch,
    microbatch_candidates,
    training_spec,
)
from autopar.planner.plan_builder import assemble_plan, make_stage, place_chunks, transfers_between
from autopar.planner.single_stage import (  # noqa: F401 - memory_bounds: callers import it from here
    floor_hint,
    memory_bounds,
    record_recompute,
    single_stage,
    strategies_for,
    uniform_recompute,
)


def plan_model(model: torch.nn.Module, cluster: Cluster, example_inputs, options: PlanOptions) -> Plan:
    start = time.perf_counter()
    policy = resolve_precision(options.precision)
    graph = apply_to_graph(capture(model, example_inputs), policy)
    _check(options, lambda: invariants.check_capture(graph))
    recapture = lambda b: apply_to_graph(capture(model, first_microbatch(example_inputs, b)), policy)  # noqa: E731
    plan = plan_graph(graph, cluster, options, model_name=type(model).__name__, recapture=recapture)
    plan.timings["capture"] = round(time.perf_counter() - start - plan.timings["seconds"], 3)
    return plan


def plan_graph(graph: ModelGraph, cluster: Cluster, options: PlanOptions, model_name: str = "model",
               recapture=None, per_stage_offload: bool = False, at_microbatch=None) -> Plan:
    """``recapture(B)``: the model captured at one of B microbatches, used when rescaling the graph's
    shapes is not exact (see ``batch_dims.rescale_is_exact``). ``per_stage_offload``: offload="auto" is
    this plan's, stage by stage in the stage DP (``offload_choice``). ``at_microbatch(B)``: the graph at one
    of B microbatches, shared across plans of ``graph`` (a grid search's cache: ``shared_microbatch_graphs``);
    default, one cache per plan."""
    if options.offload == "auto" and not per_stage_offload:
        return choose_offload(lambda o, per_stage: plan_graph(graph, cluster, o, model_name, recapture, per_stage,
                                                              at_microbatch), options)
    clock = _Clock()
    check_against_graph(graph, cluster.num_devices, options)
    candidates = microbatch_candidates(graph, options)
    blocks = find_repeated_blocks(graph)
    if at_microbatch is None:
        at_microbatch = shared_microbatch_graphs(graph, recapture)
    if options.stages == 1:
        plan = single_stage(graph, blocks, cluster, options, model_name, candidates[0], at_microbatch)
    else:
        layers = _enough_layers(graph, blocks, options)
        _check(options, lambda: invariants.check_layers(graph, layers))
        costs = StageCosts(lambda: _reference_graphs(graph, candidates), layers, blocks, cluster,
                           training_spec(graph, options), batch_dims(graph), options.time_limit,
                           strategies_for=lambda g, mesh: strategies_for(g, mesh, options),
                           recompute_modes=layer_modes(options.recompute, graph, layers),
                           offload=per_stage_offload,
                           rescaled=lambda b0: rescale(graph, graph.input_signature[0][0][0] // b0))
        clock.lap("layers")
        single = None
        if options.stages is None and candidates[0] == 1:  # independent of the DP: solved beside it, once the
            costs.prepare()  # pricing had every core, in the one-core phases after (DP, chunk builds) and beside
            single = Beside(lambda: feasible(lambda: single_stage(graph, blocks, cluster, options, model_name, 1,
                                                                    at_microbatch)))
        try:
            plan = _plan_stages(graph, layers, blocks, cluster, options, model_name, costs, candidates,
                                at_microbatch, clock)
        except BaseException:
            if single is not None:
                single.cancel()
            raise
        plan.planner["mesh_solves"] = costs.solves
        if single is not None:
            plan = or_single_stage(plan, single.result)
            clock.lap("single_stage_check")
    plan.planner["solver"] = backend()
    if options.expert_routing is not None:  # the measured histogram the MoE layers were priced with
        plan.planner["expert_routing"] = list(check_expert_routing(options.expert_routing))
    if written_buffers(graph):  # why the planner kept one microbatch (``options.microbatch_candidates``)
        plan.planner["buffers_written_in_forward"] = written_buffers(graph)
    record_offload(plan, options)
    plan.timings = {"seconds": round(clock.total(), 3), **clock.laps}
    _check(options, lambda: plan.validate(graph))
    return plan


def _enough_layers(graph, blocks, options: PlanOptions):
    """The layers the stage DP cuts: ``cluster_layers``, re-clustered into as many layers as the stages ask
    for (stages=N, or the last layer a manual stage names) when the default clustering has fewer (a model of 2
    repeated blocks clusters into 2 layers; stages=4 needs 4). PlanError when even that cannot give them."""
    layers = cluster_layers(graph, blocks, options.layers, is_light)
    needed = _layers_named(options.stages)
    if needed > layers.count and options.layers is None:
        layers = cluster_layers(graph, blocks, needed, is_light)
    if needed > layers.count:
        given = f"layers={options.layers}" if options.layers is not None else "the clustering"
        raise PlanError(f"{needed} pipeline stages need at least {needed} layers, but {given} cut the model into "
                        f"{layers.count} (it has no more cut points between heavy ops); pass layers={needed} or "
                        f"more, or plan at most {layers.count} stages")
    return layers


def _layers_named(stages) -> int:
    """How many layers ``stages`` asks for: N for stages=N, 1 + the last layer a manual stage list names
    (0 where the list is malformed: ``manual_stages`` says what is wrong with it)."""
    if not isinstance(stages, (list, tuple)):
        return stages if isinstance(stages, int) else 0
    try:
        return 1 + max(int(entry["layers"][1]) for entry in stages)
    except (KeyError, IndexError, TypeError, ValueError):
        return 0


MAX_STAGE_RETRIES = 8


class _StageInfeasible(InfeasibleError):
    """The exact solve of one chosen stage found no layout within memory (``entry``: its DP table cell)."""

    def __init__(self, message: str, entry: tuple):
        super().__init__(message)
        self.entry = entry


def _plan_stages(graph, layers, blocks, cluster: Cluster, options: PlanOptions, model_name: str,
                 costs: StageCosts, candidates: list[int], at_microbatch, clock) -> Plan:
    """Stage DP, then each chosen stage solved exactly. The DP prices stages from solutions at reference
    microbatches, so its estimate can admit a stage whose exact solve at the chosen microbatch does not
    fit. Such a cell (microbatches, first layer, last layer, mesh option, in-flight) is ruled out and the DP
    re-run, which moves to its next-best choice; only when ``MAX_STAGE_RETRIES`` choices failed, or the DP has
    nothing left, does planning report, naming what was tried. An interleaved chunk is no DP cell: when one
    that schedule="auto" chose does not fit, the same DP stages are solved again un-interleaved first."""
    excluded: set[tuple] = set()
    rejected: list[str] = []
    interleave = True
    while True:
        try:
            choice = _stage_dp(costs, graph, candidates, options, excluded, interleave)
        except InfeasibleError as e:
            if not rejected:
                raise
            raise InfeasibleError(f"{e}{_tried(rejected)}") from None
        clock.lap("stage_dp")
        solve_at = lambda b: feasible(lambda: _pipeline(  # noqa: E731
            graph, layers, blocks, cluster, options, model_name, same_stages_at(choice, b, dp_schedule(
                options.schedule)), at_microbatch, costs.modes))
        fewer = options.microbatches is None and choice.virtual == 1
        more = fewer and not isinstance(options.stages, (list, tuple))
        solve_twice = lambda b: _restaged_plan(  # noqa: E731
            graph, layers, blocks, cluster, options, model_name, costs, choice, b, at_microbatch)
        ahead = half_ahead(choice.microbatches, candidates, solve_at) if fewer else None
        twice = twice_ahead(choice, candidates, solve_twice) if more else None
        try:
            plan = _pipeline(graph, layers, blocks, cluster, options, model_name, choice, at_microbatch, costs.modes)
        except BaseException as e:
            cancel(ahead, twice)
            if not isinstance(e, _StageInfeasible):
                raise
            clock.lap("stage_ilps")
            interleave = not (choice.virtual > 1 and options.schedule == "auto")
            if interleave:
                excluded.add(e.entry)
            rejected.append(str(e))
            if len(rejected) >= MAX_STAGE_RETRIES:
                raise _infeasible(InfeasibleError("the stage DP's choices do not fit when solved exactly"), graph,
                                  cluster, options, rejected) from None
            continue
        try:  # each worker is joined when its plan is asked for, and stopped unread when it is not
            if fewer:
                half = choice.microbatches // 2
                plan = fewer_microbatches(plan, candidates, lambda b: ahead.result() if ahead is not None
                                          and b == half else solve_at(b))
            if more:
                plan = more_microbatches(plan, choice, candidates,
                                         (lambda b: twice.result()) if twice is not None else solve_twice)
        finally:
            cancel(ahead, twice)
        plan = or_even_split(plan, choice, layers, blocks, options, lambda even: _pipeline(
            graph, layers, blocks, cluster, options, model_name, even, at_microbatch, costs.modes))
        clock.lap("stage_ilps")
        plan.planner["dp_rejected_stages"] = len(rejected)
        return plan


def _restaged_plan(graph, layers, blocks, cluster: Cluster, options: PlanOptions, model_name: str,
                   costs: StageCosts, choice: StageChoice, microbatches: int, at_microbatch) -> Plan | None:
    """The DP's stages at ``microbatches``, each on its cheapest logical mesh there (``inter_op.restaged``),
    solved exactly; None where they do not fit."""
    staged = restaged(costs, choice, graph.input_signature[0][0][0], microbatches, dp_schedule(options.schedule))
    return feasible(lambda: _pipeline(graph, layers, blocks, cluster, options, model_name, staged, at_microbatch,
                                      costs.modes)) if staged is not None else None


def _tried(rejected: list[str]) -> str:
    return (f" The stage DP's {len(rejected)} earlier choice(s) were ruled out by their exact solve: "
            + "; ".join(rejected[:3]) + ".")


def _infeasible(e: InfeasibleError, graph, cluster: Cluster, options: PlanOptions, rejected: list[str]):
    tried = _tried(rejected) if rejected else ""
    return InfeasibleError(f"{e}.{tried}{floor_hint(graph, cluster, options)}"
                           + budget_unit_hint(cluster.memory_per_device))


class _Clock:
    """Seconds spent in each planning phase (recorded in ``plan.planner``)."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(self.laps.get(name, 0.0) + now - self.last, 3)  # retries add up
        self.last = now

    def total(self) -> float:
        return time.perf_counter() - self.start


def shared_microbatch_graphs(graph: ModelGraph, recapture=None):
    """``at_microbatch(B)``, cached: each B's graph made once. Planning only adds pure caches to a graph (node
    signatures, strategies per (mesh, pins), memory bounds), so plans of one graph may share these."""
    return functools.cache(lambda b: _at_microbatch(graph, b, recapture))


def _at_microbatch(graph: ModelGraph, microbatches: int, recapture) -> ModelGraph:
    """The graph at one microbatch: rescaled when that is exact, else re-captured (if possible)."""
    if microbatches == 1:
        return graph
    if recapture is not None and not rescale_is_exact(graph):
        return recapture(microbatches)
    return rescale(graph, microbatches)


def _reference_graphs(graph: ModelGraph, candidates: list[int]) -> dict:
    """{microbatch size: graph rescaled to it} for two references: the smallest candidate microbatch
    (where tensor parallelism and pipelines live) and batch / min(8, max B) (where data parallelism does).

    Their solutions price every B by scaling; batch splits they chose must divide the microbatch of a
    given B (checked per entry), and each chosen stage is re-solved exactly at its B."""
    batch = graph.input_signature[0][0][0]
    parts = {max(candidates), max((b for b in candidates if b <= 8), default=min(candidates))}
    return {batch // b: rescale(graph, b) for b in sorted(parts)}


def _stage_dp(costs: StageCosts, graph: ModelGraph, candidates: list[int], options: PlanOptions,
              excluded: set[tuple] = frozenset(), interleave: bool = True) -> StageChoice:
    """The DP's stages (or the user's); when nothing fits, the error says what single-stage budget would.
    ``excluded``: stage cells whose exact solve did not fit (see ``_plan_stages``); ``interleave``: False
    keeps the DP's stages as they are (schedule "auto" after its interleaved chunks did not fit)."""
    cluster = costs.cluster
    try:
        if isinstance(options.stages, (list, tuple)):
            if excluded:
                raise InfeasibleError("the manual stages do not fit when solved exactly")
            choice = manual_stages(costs, options, candidates)
        else:
            batch = graph.input_signature[0][0][0]
            choice = choose_stages(costs, batch, candidates, dp_schedule(options.schedule), options.stages,
                                   excluded=excluded)
            if interleave:
                choice = choose_virtual(choice, costs, batch, options.schedule, options.virtual_stages)
            else:
                choice = keep_uninterleaved(choice, "the interleaved chunks did not fit when solved exactly")
    except InfeasibleError as e:
        raise InfeasibleError(f"{e}.{floor_hint(graph, cluster, options)}"
                              + budget_unit_hint(cluster.memory_per_device)) from None
    _check(options, lambda: invariants.check_stage_choice(choice, costs.layers.count, cluster.num_devices))
    return choice


def _pipeline(graph, layers, blocks, cluster: Cluster, options: PlanOptions, model_name: str,
              choice: StageChoice, at_microbatch, costs_modes: list[str]) -> Plan:
    """Place the chosen stages on ranks and solve each exactly at the chosen microbatch.

    Stages are solved fewest in-flight microbatches first, so an identical stage further up the
    pipeline (same objective, more memory) can reuse a solution that still fits (``ilp_reuse``)."""
    B = choice.microbatches
    scaled = at_microbatch(B)
    ranks = place_chunks(cluster, [stage.option.physical for stage in choice.stages], choice.virtual)
    strategies = {}  # per logical mesh: stages on one share them
    subsets = [{name for layer in range(c.first, c.last + 1) for name in layers.nodes[layer]} for c in choice.stages]
    subsets[-1].add("output")
    subsets = subsets_on(graph.gm, scaled.gm, subsets)
    built = []  # (stage index, its choice, CostEnv, recompute, BuiltProblem or its InfeasibleError, names)
    builds = ChunkBuilds(bool(options.pin), build_problem)  # identical chunks read one build
    for s, chosen in sorted(enumerate(choice.stages), key=lambda item: (item[1].inflight, item[0])):
        recompute = stage_modes(costs_modes, chosen.recompute, chosen.first, chosen.last)
        env = CostEnv(cluster, chosen.option.logical, stage_training(training_spec(graph, options), chosen),
                      microbatches=B, inflight=chosen.inflight, devices_per_node=chosen.option.physical[1],
                      recomputed=recomputed_ops(layers, recompute, scaled))
        try:
            if chosen.option.logical not in strategies:
                strategies[chosen.option.logical] = strategies_for(scaled, chosen.option.logical, options)
            budget = cluster.memory_per_device if chosen.budget is None else chosen.budget
            built.append((s, chosen, env, recompute, *builds.build(
                scaled, strategies[chosen.option.logical], blocks, env, budget, subsets[s],
                uniform_recompute(recompute, layers, chosen.first, chosen.last))))
        except InfeasibleError as e:  # raised in turn, after the stages before it are solved
            built.append((s, chosen, env, recompute, e, None))
            break
    problems = [b[4] for b in built if not isinstance(b[4], InfeasibleError)]
    results, reused = solve_walks([b.problem for b in problems], options.time_limit)
    results = iter(results)
    solved = {}
    for s, chosen, env, recompute, problem, names in built:
        result = problem if isinstance(problem, InfeasibleError) else next(results)
        if isinstance(result, (str, InfeasibleError)):
            option = chosen.option
            where = (f"stage {s} (layers {chosen.first}..{chosen.last} on {option.physical[0]}×{option.physical[1]}, "
                     f"B={B}): {result}")
            raise _StageInfeasible(where, (B, chosen.first, chosen.last, option, chosen.inflight)) from None
        solution = solve_built(problem, env, options.time_limit, result=result)
        if names is not None:
            solution = renamed(solution, names)
        stage = make_stage(scaled, solution, env, index=s, ranks=ranks[s], submesh=chosen.option.physical,
                           layers=(chosen.first, chosen.last))
        record_recompute(stage, solution, scaled, layers, blocks, recompute, B)
        solved[s] = stage, solution.ilp.n_variables
    stages = [solved[s][0] for s in range(len(solved))]
    variables = sum(n for _, n in solved.values())
    transfers = transfers_between(graph, stages, scaled, cluster)
    schedule = recorded_schedule(options.schedule, choice.virtual) if len(stages) > 1 or B > 1 else "none"
    return assemble_plan(graph, cluster, stages, options, model_name, blocks, microbatches=B, schedule=schedule,
                         layers=layers, transfers=transfers, sharded_graph=scaled, virtual_stages=choice.virtual,
                         planner={"ilp_variables": variables, "ilp_status": "Optimal", "layers": layers.count,
                                  "dp_cost": choice.cost, "stage_solves_reused": reused, **choice.notes,
                                  **offloaded_stages(choice.stages)})


def _check(options: PlanOptions, fn) -> None:
    if options.debug:
        fn()
