"""Turn a Plan into this rank's ``ParallelModule``: weights, process groups, generated code, runner.

Steps, in order, on every rank (all are collective):
  1. ``broadcast_state``: rank 0's parameters and buffers go to every rank (as DDP does), so shards
     come from one set of weights even if ranks initialized differently;
  2. ``build_groups``: a process group per mesh axis of every stage;
  3. codegen for this rank's stage and mesh coordinate; the runner that executes it.
"""
from __future__ import annotations

import datetime

import numpy as np
import torch
import torch.distributed as dist

from autopar.cost_models.memory import requires_grad_nodes
from autopar.passes.codegen import generate_stage_module
from autopar.runtime import groups
from autopar.runtime.module import ParallelModule
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


def build_parallel_module(model: torch.nn.Module, graph, plan, timeout: datetime.timedelta | None) -> ParallelModule:
    rank = dist.get_rank()
    tensors = broadcast_state(model_tensors(model, graph))
    meshes = stage_meshes(plan)
    groups.build_groups(meshes, timeout)
    stage = plan.stage_of_rank(rank)
    coord = groups.coordinate(meshes[stage.index], rank)
    trainable = {p.name for p in graph.placeholders if p.kind == "parameter"}
    needs_grad = requires_grad_nodes(graph.gm, trainable)
    gm = generate_stage_module(graph, stage, coord, stage.index, tensors, needs_grad)
    runner = SpmdRunner(gm, stage, stage.index)
    state_keys = list(model.state_dict().keys())
    used = {p.fqn for p in graph.placeholders if hasattr(gm, p.name)}
    unused = {k: tensors[k] for k in state_keys if graph.param_aliases.get(k, k) not in used and k in tensors}
    return ParallelModule(plan, graph, runner, state_keys, unused)
