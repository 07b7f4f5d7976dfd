"""Gradient synchronization done once per step, after every microbatch's backward.

``reduce_deferred``: parameters whose every read only all-reduces the gradient over some mesh axes (see
``runtime.codegen._Emitter._deferrable_syncs``) are reduced here instead, in one flat buffer per axis group
(like DDP's buckets), so B microbatches cost one all-reduce, not B.

``sync_shared``: a parameter read by several stages (tied embeddings: GPT-2's token embedding is also
its output projection) lives on every stage that reads it, each with its own layout. Each stage first
gathers its whole gradient (a collective inside the stage); every rank of every holding stage then
contributes G_s / n_s to one all-reduce over all holding ranks, so the sum is Σ_s G_s, and each rank keeps
its shard. Identical gradients and identical optimizers keep the copies identical.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.placement import local_slice, parse_spec
from autopar.runtime import faults, groups
from autopar.runtime.collectives import gather_full


def reduce_deferred(gm, mesh_index: int) -> None:
    by_axes: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
    for name, axes in gm.meta.get("deferred_syncs", {}).items():
        param = getattr(gm, name)
        if param.grad is not None:
            by_axes.setdefault(tuple(axes), []).append(param)
    for axes, params in sorted(by_axes.items()):
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        for axis in axes:
            key = groups.group_key(mesh_index, axis)
            faults.guard("all_reduce", key, dist.all_reduce, flat, group=groups.get(key))
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n


def sync_shared(gm, stage, shared: dict[str, str], coord, mesh_index: int) -> None:
    """``shared``: {parameter placeholder held by this stage and others: its group key}; ``mesh_index``:
    this stage's mesh id in the group registry."""
    for name in sorted(shared):
        param = getattr(gm, name, None)
        if param is None:
            continue
        spec = parse_spec(stage.shardings[name].out)
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        full = gather_full(grad, spec, mesh_index) / len(stage.ranks)
        faults.guard("all_reduce", shared[name], dist.all_reduce, full, group=groups.get(shared[name]))
        param.grad = local_slice(full, spec, tuple(stage.mesh_shape), coord).clone()
