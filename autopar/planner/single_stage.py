"""One stage on the whole cluster mesh: its plan, and the memory any plan of the model needs.

    memory_bounds(graph, cluster, options) = (min over shardings of the per-device bytes, bytes replicated)

``single_stage`` solves the whole graph as one stage at a microbatch count (once more with the "auto"
recompute layers recomputing when the first solution holds over ``MEMORY_BINDS`` of the budget) and keeps the
faster; the driver compares it with the pipelined plan (``exact_checks.or_single_stage``). ``memory_bounds``
is what an infeasible plan's error quotes for scale. ``record_recompute`` and ``uniform_recompute`` are shared
with the driver's pipelined stages.
"""
from __future__ import annotations

import dataclasses

from autopar.errors import InfeasibleError, PlanError
from autopar.hardware.cluster import Cluster
from autopar.ir.graph import ModelGraph
from autopar.ir.units import fmt_bytes
from autopar.passes.cluster_layers import cluster_layers, find_repeated_blocks
from autopar.passes.ilp import memory_of, min_memory, raise_if_proven_over_budget
from autopar.passes.interleave import recorded_schedule
from autopar.passes.intra_op import CostEnv, build_problem, solve_built
from autopar.passes.intra_op_groups import is_light
from autopar.passes.pins import pinned_strategies
from autopar.passes.recompute import layer_modes, recompute_seconds, recomputed_ops
from autopar.plan import Plan
from autopar.planner import invariants
from autopar.planner.options import PlanOptions, training_spec
from autopar.planner.plan_builder import assemble_plan, make_stage

MEMORY_BINDS = 0.8  # a single-stage solution above this share of the budget also tries recompute="auto" layers


def strategies_for(graph: ModelGraph, mesh, options: PlanOptions) -> dict:
    """Every node's candidate shardings on ``mesh`` under the user's pins (checked in debug mode)."""
    check = (lambda generated: invariants.check_strategies(graph, generated)) if options.debug else None
    return pinned_strategies(graph, mesh, options.pin or {}, check)


def single_stage(graph, blocks, cluster: Cluster, options: PlanOptions, model_name: str, microbatches: int,
                 at_microbatch) -> Plan:
    """The whole graph as one stage on the cluster's mesh at ``microbatches`` (see the module doc)."""
    mesh = tuple(cluster.mesh_shape)
    scaled = at_microbatch(microbatches)
    strategies = strategies_for(scaled, mesh, options)
    layers = cluster_layers(graph, blocks, options.layers, is_light) if options.recompute != "none" else None
    modes = layer_modes(options.recompute, graph, layers) if layers is not None else []
    attempts = [{n: m for n, m in enumerate(modes) if m in ("full", "selective")}]
    if "auto" in modes:  # the "auto" layers all recompute, tried where memory binds without
        attempts.append({**attempts[0], **{n: "full" for n, m in enumerate(modes) if m == "auto"}})
    tried, error = [], None
    for attempt, recompute in enumerate(attempts):
        env = CostEnv(cluster, mesh, training_spec(graph, options), microbatches=microbatches,
                      recomputed=recomputed_ops(layers, recompute, scaled) if recompute else {})
        try:
            built = build_problem(scaled, strategies, blocks, env, cluster.memory_per_device)
            if attempt + 1 < len(attempts):  # a recompute attempt follows: skip a solve proven infeasible
                raise_if_proven_over_budget(built.problem)
            solution = solve_built(built, env, options.time_limit)
        except InfeasibleError as e:
            error = e
            continue
        stage = make_stage(scaled, solution, env, index=0, ranks=list(range(cluster.num_devices)),
                           submesh=(cluster.nodes, cluster.devices_per_node))
        record_recompute(stage, solution, scaled, layers, blocks, recompute, microbatches)
        step = stage.predicted["latency"] * microbatches + stage.predicted["grad_sync"]
        tried.append((step, stage, solution, recompute))
        if solution.memory <= MEMORY_BINDS * cluster.memory_per_device:
            break
    if not tried:
        raise error
    _, stage, solution, recompute = min(tried, key=lambda t: t[0])
    return assemble_plan(graph, cluster, [stage], options, model_name, blocks, microbatches=microbatches,
                         schedule=recorded_schedule(options.schedule, 1) if microbatches > 1 else "none",
                         sharded_graph=scaled,
                         layers=layers if recompute else None,
                         planner={"ilp_variables": solution.ilp.n_variables, "ilp_status": solution.ilp.status})


def floor_hint(graph: ModelGraph, cluster: Cluster, options: PlanOptions) -> str:
    """' For scale: the most sharded single-stage plan needs ...', or '' when the user's pins are written
    for their own stage meshes and are no sharding of the whole-cluster mesh (that plan does not exist).
    Under recompute="auto" that plan recomputes every layer (the planner may choose it), so the figure is
    the least any single-stage plan under these options needs, not the least without recompute."""
    relaxed = options.recompute == "auto"
    try:
        floor = memory_bounds(graph, cluster, dataclasses.replace(options, recompute="full") if relaxed
                              else options)[0]
    except PlanError:
        return ""
    levers = ["every layer recomputed"] if relaxed else []
    if training_spec(graph, options).host_optimizer:
        levers.append("the optimizer state on the host")
    how = " with " + " and ".join(levers) if levers else ""
    return (f" For scale: the most sharded single-stage plan{how} needs at least {fmt_bytes(floor)} per "
            f"device ({floor:.0f} bytes); plan for a memory_per_device a few percent above it.")


def uniform_recompute(recompute: dict[int, str], layers, k: int, i: int) -> bool:
    """Whether identical layers k..i all recompute alike, so the ILP may keep one instance for the rest
    (``intra_op_groups`` truncation); a mixed stage is solved whole."""
    return len({recompute.get(n) for n in range(k, i + 1)}) <= 1 if layers is not None else True


def record_recompute(stage, solution, graph, layers, blocks, recompute: dict[int, str], microbatches: int) -> None:
    """Stage.recompute and the predicted seconds of the extra forward (in backward, per microbatch)."""
    stage.recompute = dict(sorted(recompute.items()))
    if not recompute:
        return
    extra = recompute_seconds(solution, graph, layers, blocks, stage.mesh_shape, recompute) / microbatches
    p = stage.predicted
    p["recompute"] = extra
    p["latency"] += extra
    p["backward"] += extra


def memory_bounds(graph: ModelGraph, cluster: Cluster, options: PlanOptions) -> tuple[float, float]:
    """(least memory any plan needs, memory of the fully replicated plan) per device, in bytes, with the
    layers that ``options.recompute`` forces to recompute ("full", "selective") recomputing. Kept on the
    graph for its module per (cluster, pins, recompute, layers, training spec), all it depends on: an
    infeasible plan's error message quotes it, and a grid of plans on one graph fails that way often."""
    key = (cluster.to_json(), tuple((options.pin or {}).items()), repr(options.recompute), options.layers,
           training_spec(graph, options))
    owner, cache = getattr(graph, "_memory_bounds", (None, None))
    if owner is not graph.gm:
        cache = {}
        graph._memory_bounds = (graph.gm, cache)
    if key not in cache:
        cache[key] = _memory_bounds(graph, cluster, options)
    return cache[key]


def _memory_bounds(graph: ModelGraph, cluster: Cluster, options: PlanOptions) -> tuple[float, float]:
    mesh = tuple(cluster.mesh_shape)
    strategies = strategies_for(graph, mesh, options)
    blocks = find_repeated_blocks(graph)
    recomputed = {}
    if options.recompute not in ("auto", "none"):
        layers = cluster_layers(graph, blocks, options.layers, is_light)
        modes = layer_modes(options.recompute, graph, layers)
        forced = {n: m for n, m in enumerate(modes) if m in ("full", "selective")}
        recomputed = recomputed_ops(layers, forced, graph)
    env = CostEnv(cluster, mesh, training_spec(graph, options), recomputed=recomputed)
    problem = build_problem(graph, strategies, blocks, env, None).problem
    return min_memory(problem), memory_of(problem, [0] * problem.n_classes)
