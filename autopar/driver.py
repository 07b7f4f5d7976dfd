"""The planning pipeline, one line per pass: capture -> strategies -> layers -> intra-op ILP -> Plan.

``plan_graph`` is the table of contents; the helpers below it only assemble the Plan's data. With
``PlanOptions(debug=True)`` the invariants each pass promises are checked after it runs.
"""
from __future__ import annotations

import dataclasses
import json
import time

import torch

from autopar.cluster import Cluster
from autopar.cost_models.communication import redistribute_messages
from autopar.cost_models.memory import TrainingSpec
from autopar.passes.capture import ModelGraph, capture
from autopar.passes.cluster_layers import find_repeated_blocks
from autopar.passes.ilp import solver
from autopar.passes.intra_op import CostEnv, IntraOpSolution, solve_intra_op
from autopar.passes.strategies import generate_strategies
from autopar.passes.strategies.base import OpView
from autopar.placement import R, spec_str
from autopar.plan import Collective, NodeSharding, Plan, Stage
from autopar.redistribute import grad_partial_axes


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """Planner settings.

    optimizer: training optimizer, for memory (see cost_models.memory.OPTIMIZER_STATE_BYTES).
    time_limit: seconds each ILP may take; the best solution found by then is used.
    pin: {node-name glob: spec text}: fix those nodes' output specs (e.g. {"idx": "S(0)R", "p_*": "RR"}
      forces data parallelism); the planner fills in everything else. See ``apply_pins``.
    debug: check every pass's output invariants (slower).
    """

    optimizer: str = "adamw"
    time_limit: float = 60.0
    pin: dict[str, str] | None = None
    debug: bool = False


def plan_model(model: torch.nn.Module, cluster: Cluster, example_inputs, options: PlanOptions) -> Plan:
    graph = capture(model, example_inputs)
    return plan_graph(graph, cluster, options, model_name=type(model).__name__)


def plan_graph(graph: ModelGraph, cluster: Cluster, options: PlanOptions, model_name: str = "model") -> Plan:
    start = time.perf_counter()
    mesh = tuple(cluster.mesh_shape)
    blocks = find_repeated_blocks(graph)
    strategies = apply_pins(graph, generate_strategies(graph, mesh), options.pin or {})
    _check(options, lambda: _check_strategies(graph, strategies))
    env = CostEnv(cluster, mesh, TrainingSpec(optimizer=options.optimizer))
    solution = solve_intra_op(graph, strategies, blocks, env, cluster.memory_per_device, options.time_limit)
    stage = make_stage(graph, solution, env, index=0, ranks=list(range(cluster.num_devices)),
                       submesh=(cluster.nodes, cluster.devices_per_node))
    plan = assemble_plan(graph, cluster, [stage], options, model_name, blocks)
    plan.predicted = {"step_time": solution.step_time, "compute": solution.compute_time,
                      "comm": solution.comm_time, "bubble": 0.0, "peak_memory": stage.predicted["peak_memory"]}
    plan.planner = {"ilp_variables": solution.ilp.n_variables, "ilp_status": solution.ilp.status,
                    "solver": type(solver(1)).__name__, "seconds": time.perf_counter() - start}
    _check(options, lambda: plan.validate(graph))
    return plan


def apply_pins(graph: ModelGraph, strategies: dict, pin: dict[str, str]) -> dict:
    """Keep only strategies whose output spec is the pinned one; a placeholder read by one node also
    restricts that node to strategies reading it in the pinned spec (it is stored as it is read)."""
    import fnmatch

    from autopar.errors import PlanError
    from autopar.placement import parse_spec

    out = dict(strategies)
    for node in graph.gm.graph.nodes:
        specs = [parse_spec(v) for k, v in pin.items() if fnmatch.fnmatchcase(node.name, k)]
        if not specs:
            continue
        want = specs[-1]
        kept = [s for s in out[node.name] if s.out_spec == want]
        if not kept:
            raise PlanError(f"pin {spec_str(want)} for {node.name} is not a valid sharding of it (valid: "
                            f"{sorted({spec_str(s.out_spec) for s in out[node.name]})}); fix the pin")
        out[node.name] = kept
        users = list(node.users)
        if node.op == "placeholder" and len(users) == 1 and users[0].op == "call_function":
            user = users[0]
            idx = OpView(user).tensor_args.index(node)
            stored = lambda spec: tuple(R if p.is_partial() else p for p in spec)  # noqa: E731
            fits = [s for s in out[user.name] if stored(s.in_specs[idx]) == want]
            if not fits:
                raise PlanError(f"pin {spec_str(want)} for {node.name} leaves its reader {user.name} no strategy")
            out[user.name] = fits
    return out


def memory_bounds(graph: ModelGraph, cluster: Cluster, options: PlanOptions) -> tuple[float, float]:
    """(least memory any plan needs, memory of the fully replicated plan) per device, in bytes."""
    from autopar.passes.ilp import memory_of, min_memory
    from autopar.passes.intra_op import build_problem

    mesh = tuple(cluster.mesh_shape)
    strategies = apply_pins(graph, generate_strategies(graph, mesh), options.pin or {})
    env = CostEnv(cluster, mesh, TrainingSpec(optimizer=options.optimizer))
    _, problem, _ = build_problem(graph, strategies, find_repeated_blocks(graph), env, None)
    return min_memory(problem), memory_of(problem, [0] * problem.n_classes)


def _check(options: PlanOptions, fn) -> None:
    if options.debug:
        fn()


def _check_strategies(graph: ModelGraph, strategies) -> None:
    for node in graph.gm.graph.nodes:
        assert strategies[node.name], f"{node.name} has no strategy"
        first = strategies[node.name][0]
        assert all(p.is_replicate() for p in first.out_spec), f"{node.name}: first strategy is not replicated"


def make_stage(graph: ModelGraph, solution: IntraOpSolution, env: CostEnv, *, index: int, ranks: list[int],
               submesh: tuple[int, int], nodes: list[str] | None = None, layers=None) -> Stage:
    """A Stage from an intra-op solution: specs as text, the collectives inserted, predicted costs."""
    names = nodes if nodes is not None else [n.name for n in graph.gm.graph.nodes]
    shardings = {}
    for name in names:
        s = solution.strategies[name]
        shardings[name] = NodeSharding(spec_str(s.out_spec), tuple(spec_str(x) for x in s.in_specs),
                                       tuple((int(a), str(t)) for a, t in s.kernels))
    stage = Stage(index=index, ranks=list(ranks), mesh_shape=tuple(env.mesh_shape), submesh=tuple(submesh),
                  nodes=names, shardings=shardings, layers=layers)
    stage.collectives = _collectives(graph, solution, env, set(names))
    stage.predicted = {"latency": solution.step_time, "compute": solution.compute_time,
                       "comm": solution.comm_time, "memory": solution.memory, "peak_memory": solution.memory}
    return stage


def _collectives(graph: ModelGraph, solution: IntraOpSolution, env: CostEnv, names: set[str]) -> list[Collective]:
    from autopar.cost_models.memory import requires_grad_nodes

    trainable = {p.name for p in graph.placeholders if p.kind == "parameter"}
    needs = requires_grad_nodes(graph.gm, trainable)
    out = []
    for node in graph.gm.graph.nodes:
        if node.name not in names or node.op == "placeholder":
            continue
        view = OpView(node)
        strat = solution.strategies[node.name]
        for idx, arg in enumerate(view.tensor_args):
            if arg.name not in solution.strategies:
                continue
            src, dst = solution.strategies[arg.name].out_spec, strat.in_specs[idx]
            val = view.in_vals[idx]
            grad = arg.name in needs and node.name in needs
            axes = grad_partial_axes(dst, strat.out_spec) if grad and node.op != "output" else ()
            for kind, axis, nbytes, phase in redistribute_messages(tuple(val.shape), val.element_size(), src, dst,
                                                                  env.mesh_shape, axes, grad):
                out.append(Collective(arg.name, node.name, kind, axis, float(nbytes), phase))
    return out


def assemble_plan(graph: ModelGraph, cluster: Cluster, stages: list[Stage], options: PlanOptions,
                  model_name: str, blocks, microbatches: int = 1, schedule: str = "none") -> Plan:
    return Plan(model=model_name, graph_fingerprint=graph.fingerprint(), input_signature=graph.input_signature,
                cluster=json.loads(cluster.to_json()), stages=stages, microbatches=microbatches, schedule=schedule,
                optimizer=options.optimizer, repeated_blocks=blocks.instances,
                node_ops={n.name: str(n.target) for n in graph.gm.graph.nodes if n.op == "call_function"})
