"""Turn a Plan into this rank's ``ParallelModule``: weights, process groups, generated code, runner.

Steps, in order, on every rank (all are collective):
  1. the weights' source (``runtime.tensor_source``): the user's tensors (rank 0's values where a rank's
     differ, as DDP does), a meta model's own init, or files; it gives each shard, never the whole model;
  2. ``build_groups``: a process group per mesh axis of every stage;
  3. codegen for this rank's stage (or, interleaved, each of its model chunks) and mesh coordinate; the
     runner that executes it;
  4. with compile on, each generated module under torch.compile (``runtime.compiled``).
"""
from __future__ import annotations

import datetime

import numpy as np
import torch
import torch.distributed as dist

from autopar.errors import PlanError
from autopar.ir.ops import requires_grad_nodes
from autopar.ir.precision import check_device
from autopar.ir.precision import resolve as resolve_precision
from autopar.ir.recompute import region_keys
from autopar.placement import parse_spec
from autopar.runtime import compiled, devices, gradsync, groups, rng
from autopar.runtime.codegen import fill_pending, generate_stage_module
from autopar.runtime.interleaved import InterleavedRunner
from autopar.runtime.local_data import LocalData, make_group
from autopar.runtime.module import ParallelModule
from autopar.runtime.offload import offloaded
from autopar.runtime.optim import LossScaler, mark_needs_builder
from autopar.runtime.pipeline import PipelineRunner
from autopar.runtime.spmd import SpmdRunner
from autopar.runtime.tensor_source import UserTensors


def model_tensors(model: torch.nn.Module, graph) -> dict[str, torch.Tensor]:
    """fqn -> tensor for every parameter, buffer and lifted constant the graph reads."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(dict(model.named_buffers(remove_duplicate=False)))
    tensors.update(graph.constants)
    return tensors


def shards_needed(plan, graph, rank: int) -> dict[str, list[tuple]]:
    """{fqn: [(spec, mesh shape, coordinate)]}: every parameter/buffer/constant shard this rank places."""
    meshes = stage_meshes(plan)
    needs: dict[str, list[tuple]] = {}
    for stage in plan.stages_of_rank(rank):
        coord = groups.coordinate(meshes[stage.index], rank)
        for info in graph.placeholders:
            node = graph.gm.graph.find_nodes(op="placeholder", target=info.name)[0]
            if info.kind != "input" and info.name in stage.shardings and node.users:
                spec = parse_spec(stage.shardings[info.name].out)
                needs.setdefault(info.fqn, []).append((spec, tuple(stage.mesh_shape), coord))
    return needs


def unread_state_keys(model_state_keys: list[str], graph) -> list[str]:
    """State-dict keys the graph never reads (kept whole beside the module for ``full_state_dict``)."""
    read = {p.fqn for p in graph.placeholders if graph.gm.graph.find_nodes(op="placeholder", target=p.name)[0].users}
    return [k for k in model_state_keys if graph.param_aliases.get(k, k) not in read]


def stage_meshes(plan) -> list[np.ndarray]:
    return [np.asarray(s.ranks).reshape(s.mesh_shape) for s in plan.stages]


def shared_parameters(plan, graph) -> tuple[dict[str, str], dict[str, list[int]]]:
    """({parameter placeholder read by several stages: its group key}, {group key: all their ranks})."""
    keys, members = {}, {}
    for info in graph.placeholders:
        holders = [s for s in plan.stages if info.name in s.shardings]
        if info.kind == "parameter" and len(holders) > 1:
            key = keys[info.name] = "shared." + ".".join(str(s.index) for s in holders)
            members[key] = sorted({r for s in holders for r in s.ranks})
            if len(members[key]) < sum(len(s.ranks) for s in holders):
                raise PlanError(f"parameter {info.fqn} is tied between model chunks on the same devices (stages "
                                f"{[s.index for s in holders]}); interleaving cannot sync it: plan with "
                                f"schedule='1f1b', or place its readers in chunks on different devices")
    return keys, members


def _setup_training(runner, plan, graph, stage, mesh_index: int, timeout) -> None:
    """Precision policy, loss scaler and bucketed gradient sync of this rank's runner (``runtime.optim``)."""
    policy = resolve_precision(plan.precision)
    device_type = plan.cluster.get("device_type", "cpu")
    check_device(policy, device_type)
    sync = gradsync.GradSync(runner.gm, graph, stage, mesh_index, plan.microbatches, plan.bucket_bytes,
                             policy.reduce_dtype, timeout, gather_dtype=policy.compute_dtype)  # ZeRO-3's gathers
    runner.setup(policy, device_type, sync, LossScaler(policy) if policy.loss_scaling else None)
    offload = offloaded(plan, stage.index)
    runner.offload_optimizer, runner.offload_activations = offload["optimizer"], offload["activations"]
    if offload["optimizer"]:  # ZeRO and fp16 work through any optimizer's step hooks (``plain_optim``)
        mark_needs_builder(runner, "keeps optimizer state in host memory (offload)")


def build_parallel_module(model: torch.nn.Module, graph, plan, timeout: datetime.timedelta | None,
                          data: str = "global", source=None, compile_modules: bool = False) -> ParallelModule:
    """``graph``: the model captured at one microbatch (the global batch when there is one). ``data``:
    "global" (every rank passes the global batch) or "local" (its share: ``local_data``). ``source``: a
    ``runtime.tensor_source`` source (default: the user's real tensors, agreed with rank 0's).
    ``compile_modules``: run each generated module under torch.compile (``runtime.compiled``)."""
    rank = dist.get_rank()
    local = LocalData(plan, graph, rank, make_group(timeout)) if data == "local" else None
    state_keys = list(model.state_dict(keep_vars=True).keys())
    unread = unread_state_keys(state_keys, graph)
    if source is None:
        source = UserTensors(model_tensors(model, graph))
        source.agree_with_rank0(shards_needed(plan, graph, rank), set(unread))
    tensors = source
    device = devices.rank_device(plan.cluster.get("device_type", "cpu"))
    meshes = stage_meshes(plan)
    shared, shared_groups = shared_parameters(plan, graph)
    base = groups.build_groups(meshes, timeout, shared_groups)
    trainable = {p.name for p in graph.placeholders  # frozen parameters (requires_grad False) get no gradient
                 if p.kind == "parameter" and (p.fqn not in tensors.templates or tensors.requires_grad(p.fqn))}
    needs_grad = requires_grad_nodes(graph.gm, trainable)
    runners = []
    for stage in plan.stages_of_rank(rank):
        coord = groups.coordinate(meshes[stage.index], rank)
        regions = region_keys(graph, plan.node_layers, stage.recompute) if stage.recompute else None
        gm = generate_stage_module(graph, stage, coord, base + stage.index, tensors, needs_grad, recompute=regions,
                                   local_batch=local is not None, device=device)
        rng.own_draws(gm, stage.mesh_shape, coord)  # dropout on a sharded value: a mask per shard
        if len(plan.stages) == 1 and plan.microbatches == 1:
            runner = SpmdRunner(gm, stage, base + stage.index)
        else:
            mine = {name: f"m{base}.{key}" for name, key in shared.items() if name in stage.shardings}
            runner = PipelineRunner(gm, plan, stage, graph, coord, mine, base)
        _setup_training(runner, plan, graph, stage, base + stage.index, timeout)
        fill_pending(gm)
        runner.local_data = local
        runners.append(runner)
    if len(runners) > 1:
        runner = InterleavedRunner(runners, plan)
        runner.setup(runners[0].policy, runners[0].device_type, None, runners[0].scaler)
        runner.local_data = local
    if compile_modules:
        compiled.compile_runner(runner)
    unused = {k: source.full(k) for k in unread if k in source.templates}
    return ParallelModule(plan, graph, runner, state_keys, unused, local)
