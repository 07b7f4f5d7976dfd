r"""Optimizer offload as a lever of the stage DP: per-layer prices of keeping a stage's optimizer state and fp32
master weights in host memory (ZeRO-Offload, ``cost_models.offload``), so each stage takes it or not.

Input: one whole-model solution of a mesh option (what ``layer_costs`` splits by layer). For each parameter
p its groups hold at their chosen layout (n_p: the ways p is replicated, z_p its ZeRO level; the stepped
local elements N_p = numel_p / (n_p if z_p ≥ 1 else 1), as ``plan_builder`` steps them),

    freed_l = Σ_{p in layer l} freed(N_p),      added_l = Σ_{p in layer l} added(N_p)

(``cost_models.offload.optimizer_offload_effect``: bytes of state and master weights, and seconds of the host
step less the device step). Layers are attributed as ``layer_costs`` attributes a group's parameter bytes (a
truncated block's group to each of instances 1..n-1), so freed_l never exceeds that layer's parameter state.

Output: a stage k..i that offloads is priced in the DP's table (``inter_op.StageCosts``) as

    memory' = memory − Σ_{l=k..i} freed_l,        latency' = latency + Σ_{l=k..i} added_l / B

(the step runs once per step; spread over the B microbatches as the gradient sync is). Its layouts are those
of the solution it came from; the chosen stage is then solved exactly with ``TrainingSpec.host_optimizer``.
Both terms are linear in the stepped elements, so the per-layer sums price any stage exactly as a whole-stage
sum would. Ties go to the stage without offload (it is entered first, and only a strictly cheaper entry
replaces it), and offload costs time whenever it runs, so a stage offloads only where that is what fits or
where it spares a dearer lever (recompute, ZeRO's gathers, a leaner layout).
"""
from __future__ import annotations

import math

import numpy as np

from autopar.cost_models.offload import optimizer_offload_effect
from autopar.passes.layer_costs import _instance_layers
from autopar.placement import local_shape


def offload_layers(solution, graph, layers, blocks, training, cluster) -> tuple[np.ndarray, np.ndarray]:
    """(freed bytes [L], added seconds per step [L]) of offloading the optimizer of each layer (docstring)."""
    params = {p.name: p for p in graph.placeholders if p.kind == "parameter"}
    freed, added = np.zeros(layers.count), np.zeros(layers.count)
    for group, i, weight in zip(solution.groups, solution.choice, solution.weights):
        held = [name for name in group.members if name in params and name in solution.strategies]
        if not held:
            continue
        effect = np.zeros(2)
        for name in held:
            numel = _stepped_numel(params[name], solution.strategies[name].out_spec, solution.mesh_shape,
                                   _level(group, i, name, training))
            effect += optimizer_offload_effect(numel, params[name].dtype, training.optimizer, cluster)
        for layer in _instance_layers(group.leader, layers, blocks, weight):
            freed[layer] += effect[0]
            added[layer] += effect[1]
    return freed, added


def _level(group, column: int, name: str, training) -> int:
    """The ZeRO level of parameter ``name`` in ``group``'s chosen column: the twin's when the ILP chose it."""
    if group.zero_level is not None and training.zero_searched(name):
        return int(group.zero_level[column])
    return training.zero_level(name)


def _stepped_numel(param, spec, mesh_shape, level: int) -> float:
    """Local elements of ``param`` under ``spec`` that one rank's optimizer steps (1/n of them at ZeRO ≥ 1)."""
    numel = math.prod(local_shape(tuple(param.shape), spec, mesh_shape))
    ways = math.prod(n for n, q in zip(mesh_shape, spec) if not q.is_shard())
    return numel / ways if level >= 1 else float(numel)


def offloaded_tables(host_state: tuple[np.ndarray, np.ndarray], latency: np.ndarray, memory: np.ndarray,
                     microbatches: int) -> tuple[np.ndarray, np.ndarray]:
    """(latency [k, i], memory [k, i, f]) of every stage k..i with its optimizer offloaded (docstring)."""
    freed, added = offload_spans(host_state)
    return latency + added / microbatches, memory - freed[:, :, None]


def offload_spans(host_state: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(Σ freed_l, Σ added_l) over layers k..i, as [k, i] matrices."""
    return tuple(_span(v) for v in host_state)


def _span(v: np.ndarray) -> np.ndarray:
    """[k, i] = Σ v[k..i] (any value below the diagonal: those entries are ∞ in the tables already)."""
    p = np.concatenate([[0.0], np.cumsum(v)])
    return p[None, 1:] - p[:-1, None]
