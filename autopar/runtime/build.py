"""Turn a Plan into this rank's ``ParallelModule``: weights, process groups, generated code, runner.

Steps, in order, on every rank (all are collective):
  1. ``broadcast_state``: rank 0's parameters and buffers go to every rank (as DDP does), so shards
     come from one set of weights even if ranks initialized differently;
  2. ``build_groups``: a process group per mesh axis of every stage;
  3. codegen for this rank's stage (or, interleaved, each of its model chunks) and mesh coordinate; the
     runner that executes it.
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
from autopar.runtime import gradsync, groups
from autopar.runtime.codegen import generate_stage_module
from autopar.runtime.interleaved import InterleavedRunner
from autopar.runtime.local_data import LocalData, make_group
from autopar.runtime.module import ParallelModule
from autopar.runtime.optim import LossScaler
from autopar.runtime.pipeline import PipelineRunner
from autopar.runtime.spmd import SpmdRunner


def model_tensors(model: torch.nn.Module, graph) -> dict[str, torch.Tensor]:
    """fqn -> tensor for every parameter, buffer and lifted constant the graph reads."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(dict(model.named_buffers(remove_duplicate=False)))
    tensors.update(graph.constants)
    return tensors


def broadcast_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of ``tensors`` holding rank 0's values (the user's model is left untouched)."""
    out = {}
    for name in sorted(tensors):
        t = tensors[name].detach().clone()
        dist.broadcast(t, src=0)
        out[name] = t.requires_grad_(tensors[name].requires_grad)
    return out


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


def build_parallel_module(model: torch.nn.Module, graph, plan, timeout: datetime.timedelta | None,
                          data: str = "global") -> ParallelModule:
    """``graph``: the model captured at one microbatch (the global batch when there is one). ``data``:
    "global" (every rank passes the global batch) or "local" (its share: ``local_data``)."""
    rank = dist.get_rank()
    local = LocalData(plan, graph, rank, make_group(timeout)) if data == "local" else None
    tensors = broadcast_state(model_tensors(model, graph))
    meshes = stage_meshes(plan)
    shared, shared_groups = shared_parameters(plan, graph)
    base = groups.build_groups(meshes, timeout, shared_groups)
    trainable = {p.name for p in graph.placeholders  # frozen parameters (requires_grad False) get no gradient
                 if p.kind == "parameter" and getattr(tensors.get(p.fqn), "requires_grad", True)}
    needs_grad = requires_grad_nodes(graph.gm, trainable)
    runners = []
    for stage in plan.stages_of_rank(rank):
        coord = groups.coordinate(meshes[stage.index], rank)
        regions = region_keys(graph, plan.node_layers, stage.recompute) if stage.recompute else None
        gm = generate_stage_module(graph, stage, coord, base + stage.index, tensors, needs_grad, recompute=regions,
                                   local_batch=local is not None)
        if len(plan.stages) == 1 and plan.microbatches == 1:
            runner = SpmdRunner(gm, stage, base + stage.index)
        else:
            mine = {name: f"m{base}.{key}" for name, key in shared.items() if name in stage.shardings}
            runner = PipelineRunner(gm, plan, stage, graph, coord, mine, base)
        _setup_training(runner, plan, graph, stage, base + stage.index, timeout)
        runner.local_data = local
        runners.append(runner)
    if len(runners) > 1:
        runner = InterleavedRunner(runners, plan)
        runner.setup(runners[0].policy, runners[0].device_type, None, runners[0].scaler)
        runner.local_data = local
    state_keys = list(model.state_dict().keys())
    read = {p.fqn for p in graph.placeholders if graph.gm.graph.find_nodes(op="placeholder", target=p.name)[0].users}
    unused = {k: tensors[k] for k in state_keys if graph.param_aliases.get(k, k) not in read and k in tensors}
    return ParallelModule(plan, graph, runner, state_keys, unused, local)
