"""The public API: ``plan`` (inspect without running) and ``compile`` (run on every rank)."""
from __future__ import annotations

import datetime
import os
import pickle

import torch
import torch.distributed as dist

from autopar.errors import ClusterError, OptionError, PlanError, UsageError
from autopar.hardware.cluster import Cluster
from autopar.ir.precision import apply_to_graph
from autopar.ir.precision import resolve as resolve_precision
from autopar.passes.capture import capture, normalize_inputs
from autopar.passes.plan_check import check_shardings
from autopar.plan import Plan
from autopar.planner.driver import plan_model
from autopar.planner.options import first_microbatch, plan_options
from autopar.runtime import compiled, faults
from autopar.runtime.build import build_parallel_module
from autopar.runtime.module import ParallelModule
from autopar.runtime.pretrained_files import hf_config_of, open_weights, tied_targets, weights_source
from autopar.runtime.tensor_source import on_meta_for, retarget_meta_device

# How long other ranks wait for a rank 0 that is still planning (a large model may plan for minutes). A
# rank 0 whose planning fails broadcasts the error at once, so no rank waits this out on a failure.
_PLAN_EXCHANGE_TIMEOUT = datetime.timedelta(minutes=30)


def plan(model: torch.nn.Module, cluster: Cluster, example_inputs, *, compile="auto", **options) -> Plan:
    """Plan ``model`` for ``cluster`` without running it (works on the meta device). See PlanOptions.
    compile: price the plan for modules run under torch.compile, as ``autopar.compile`` with the same value
    runs them (``Cluster.compiled_view``: only a cluster whose profile measured it prices them otherwise)."""
    _check_cluster(cluster)
    cluster = _priced_for(cluster, compiled.resolve(compile, cluster.device_type))
    return plan_model(model, cluster, example_inputs, plan_options(options))


def _priced_for(cluster: Cluster, compile_modules: bool) -> Cluster:
    return cluster.compiled_view() if compile_modules else cluster


@faults.collective_call("autopar.compile")
def compile(model: torch.nn.Module, cluster: Cluster, example_inputs, plan: Plan | None = None, *,
            timeout: float | None = None, share_with: ParallelModule | None = None, data: str = "global",
            weights=None, prefix: str = "", init_seed: int = 0, compile="auto", **options) -> ParallelModule:
    """Plan (on rank 0, unless ``plan`` is given), share the plan, and build this rank's module.

    Call on every rank of an initialized process group whose world size is the cluster's device count.
    timeout: seconds any collective of the compiled module may wait (default: the ``timeout`` given to
    ``autopar.launch``, else 300 s); a dead peer then raises instead of hanging.
    share_with: a module compiled earlier for other inputs (e.g. the full batch, when these are an epoch's
    smaller last batch): the plan keeps its stages and parameter/buffer layouts (pins), and the new
    module uses its very tensors, so training either trains both and one optimizer serves them.
    data: "global" (every rank passes the global batch) or "local" (each rank passes only its share,
    ``pm.data_shard``; ``example_inputs`` stay the global batch, whose shapes the plan is made for).
    weights: a Hugging Face safetensors file, a directory of them (``model.safetensors.index.json``), or a
    checkpoint written by ``pm.save`` under any plan; each rank reads only the slices it holds. ``prefix``:
    the part of the model's state-dict keys the files lack (e.g. ``"model."`` for a wrapper module).
    init_seed: a model on the meta device without ``weights`` is initialized by its own init code, one
    tensor at a time, to the same weights whatever the plan (``autopar.init_weights`` gives them on one device).
    compile: True runs every rank's generated module under torch.compile (inductor), False eagerly; "auto"
    (default) compiles on CUDA clusters only (``autopar.runtime.compiled``).
    """
    _check_cluster(cluster)
    compile_modules = compiled.resolve(compile, cluster.device_type)
    _check_compile_arguments(model, plan, timeout, share_with, options)
    if data not in ("global", "local"):
        raise UsageError(f"data={data!r}: pass data='global' (every rank passes the whole batch) or "
                         f"data='local' (each rank passes its share, pm.data_shard)")
    if not dist.is_initialized():
        raise ClusterError("autopar.compile needs an initialized process group; run it under autopar.launch(fn, n) "
                           "or torchrun, or use autopar.plan to plan without running")
    world = dist.get_world_size()
    if world != cluster.num_devices:
        raise ClusterError(f"cluster {cluster.name!r} has {cluster.num_devices} devices but the process group has "
                           f"{world} ranks; launch {cluster.num_devices} processes or describe the cluster you run "
                           f"on (e.g. Cluster.local({world}))")
    opened = open_weights(model, weights, prefix)  # bad files fail here, before planning
    example_inputs = on_meta_for(model, normalize_inputs(example_inputs))
    if share_with is not None:
        options = _keep_layout_of(share_with.plan, options)
    chosen = _agree_on_plan(model, _priced_for(cluster, compile_modules), example_inputs, plan, options, data)
    graph = apply_to_graph(capture(model, first_microbatch(example_inputs, chosen.microbatches)),
                           resolve_precision(chosen.precision))
    chosen.validate(graph, world_size=world, cluster=cluster)
    check_shardings(chosen, graph)
    retarget_meta_device(graph.gm, chosen.cluster.get("device_type", "cpu"))
    source, checkpoint_dir = weights_source(model, graph, opened, init_seed)
    built = build_parallel_module(model, graph, chosen, _collective_timeout(timeout), data, source,
                                  compile_modules)
    if checkpoint_dir is not None:
        built.load(checkpoint_dir)
    built.hf_config = hf_config_of(model)
    built.tied_targets = tied_targets(model)
    if share_with is not None:
        built.share_state_of(share_with)
    return built


def _keep_layout_of(plan: Plan, options: dict) -> dict:
    """Plan options that keep ``plan``'s stages and the specs of its parameters and buffers."""
    pins = dict(options.get("pin") or {})
    for stage in reversed(plan.stages):  # a parameter held by several stages: the first stage's spec
        pins.update({name: sh.out for name, sh in stage.shardings.items() if name.startswith(("p_", "b_"))})
    if len(plan.stages) == 1:
        stages = 1
    else:
        stages = [{"layers": list(s.layers), "submesh": list(s.submesh), "mesh": list(s.mesh_shape)}
                  for s in plan.stages]
    return {**options, "pin": pins, "stages": stages, "layers": options.get("layers", plan.planner.get("layers"))}


def _check_cluster(cluster) -> None:
    if not isinstance(cluster, Cluster):
        raise ClusterError(f"cluster must be an autopar.Cluster (Cluster.local(n), Cluster.preset(name), "
                           f"Cluster.from_json(path)), got {type(cluster).__name__}")


def _check_compile_arguments(model, given, timeout, share_with, options: dict) -> None:
    """Every rank checks the arguments before any collective, so a mistake raises alike on each."""
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"autopar.compile expects a torch.nn.Module instance, got {_what(model)}; build the model "
                         f"first (model = MyModel(...)) and pass it")
    if given is not None and not isinstance(given, Plan):
        raise UsageError(f"plan= must be an autopar.Plan, got {_what(given)}; read a saved one with "
                         f"autopar.Plan.from_json(path)")
    if given is not None and options:
        raise UsageError(f"plan= is given, so the planner options {sorted(options)} would be ignored; drop them "
                         f"(the plan already fixes them), or drop plan= to plan with them")
    if timeout is not None and not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                                    and timeout > 0):
        raise OptionError(f"timeout={timeout!r} is not a valid value of option 'timeout'; use a positive number "
                          f"of seconds (or None: autopar.launch's timeout, else 300)")
    if share_with is not None and not isinstance(share_with, ParallelModule):
        raise UsageError(f"share_with= must be a module returned by autopar.compile, got {_what(share_with)}")
    plan_options(options, also=("plan", "timeout", "share_with", "data", "weights", "prefix", "init_seed",
                                  "compile"))


def _what(value) -> str:
    return f"the class {value.__name__}" if isinstance(value, type) else f"a {type(value).__name__}"


def _agree_on_plan(model, cluster, example_inputs, given: Plan | None, options: dict, data: str = "global") -> Plan:
    """Rank 0 plans (or takes ``given``) and broadcasts the JSON, or its planning error, which every rank
    then raises (the same type and message); every rank checks the same digest."""
    control = dist.new_group(backend="gloo", timeout=_PLAN_EXCHANGE_TIMEOUT)
    box = [None]
    if dist.get_rank() == 0:
        box[0] = _plan_or_error(model, cluster, example_inputs, given, options)
    dist.broadcast_object_list(box, src=0, group=control)
    kind, payload = box[0]
    if kind == "error":
        dist.destroy_process_group(control)
        if dist.get_rank() != 0 and hasattr(payload, "add_note"):
            payload.add_note("(raised on rank 0 while planning, and sent to every rank)")
        raise payload
    chosen = Plan.from_json(payload)
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, (chosen.digest(), None if given is None else given.digest(), data),
                           group=control)
    if len({d for *_, d in digests}) != 1:
        raise UsageError(f"ranks passed different data= options to autopar.compile ({[d for *_, d in digests]} "
                         f"by rank); pass the same on every rank")
    digests = [(held, g) for held, g, _ in digests]
    if len({held for held, _ in digests}) != 1:
        raise PlanError(f"ranks hold different plans (digests {sorted({d for d, _ in digests})}); every rank "
                        f"must run the same autopar version on the same model")
    differing = [r for r, (_, g) in enumerate(digests) if g is not None and g != chosen.digest()]
    if differing:  # every rank raises, not only the one given another plan
        raise PlanError(f"rank(s) {differing} were given a plan that differs from rank 0's; pass the same plan "
                        f"on every rank")
    dist.destroy_process_group(control)
    return chosen


def _plan_or_error(model, cluster, example_inputs, given: Plan | None, options: dict) -> tuple:
    """("plan", JSON) or ("error", the exception, or a PlanError with its text when it cannot be pickled)."""
    try:
        chosen = given if given is not None else plan_model(model, cluster, example_inputs, plan_options(options))
        return "plan", chosen.to_json()
    except Exception as e:  # noqa: BLE001 - every rank must learn of any failure, not only rank 0
        try:
            pickle.loads(pickle.dumps(e))
            return "error", e
        except Exception:
            return "error", PlanError(f"planning failed on rank 0: {type(e).__name__}: {e}")


def _collective_timeout(seconds: float | None) -> datetime.timedelta:
    if seconds is None:
        seconds = float(os.environ.get("AUTOPAR_TIMEOUT", 300))
    return datetime.timedelta(seconds=seconds)
