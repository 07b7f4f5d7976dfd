"""Gradient clipping by the true global norm: ``pm.clip_grad_norm_(max_norm)`` and the plain torch call.

    ‖g‖_p = (Σ over every element of the model's gradient, counted once, of |g|^p)^(1/p)   (p = inf: max)

A rank holds several kinds of gradient (``runtime.gradsync``): a tensor-parallel shard (distinct on each
rank of its sharded axes), a replicated gradient (equal on every rank of its replicated axes, after the sync),
a ZeRO >= 1 shard of a bucket (distinct across the bucket's group) and a tied parameter's gradient (equal on
every stage that holds it). Each element is counted on exactly one rank: the rank whose mesh coordinate is 0
on every axis the tensor is replicated over (a ZeRO shard: but the bucket's own axes, over which shards
differ), and a tied parameter on the first stage holding it. The per-rank sums (float64) meet in one
all-reduce over every rank (pipeline stages hold different parameters), under the collective timeout, so
every rank gets the same norm and clips by the same factor. Under fp16 loss scaling the gradients are still
scaled (the optimizer step unscales them): the norm is divided by the scale; the factor applies unchanged.

What is clipped is what the optimizer steps: the gradients of parameters outside ZeRO buckets and the
gradient of each ZeRO shard (``plain_optim``). ``torch.nn.utils.clip_grad_norm_`` over ``pm.parameters()``
is routed here (``patch_torch``, when the first ParallelModule is built); torch's own norm or clipping of
this rank's tensors (a reference to the original function taken before that, ``get_total_norm``,
``clip_grads_with_norm_``) would use one rank's shards only, so it is a ``UsageError`` naming
``pm.clip_grad_norm_``.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.utils.clip_grad as torch_clip

from autopar.errors import UsageError
from autopar.placement import parse_spec
from autopar.runtime import devices, faults, groups

_ORIGINAL: dict = {}


def stage_runners(runner) -> list:
    """The per-stage runners of a ParallelModule's runner (an interleaved runner's chunks)."""
    return list(getattr(runner, "chunks", [runner]))


def _counted(stage, name: str, coord, skip_axes=()) -> bool:
    """Whether this rank counts ``name``'s local gradient: coordinate 0 on its replicated axes."""
    spec = parse_spec(stage.shardings[name].out)
    return all(coord[a] == 0 for a, s in enumerate(spec)
               if type(s).__name__ != "Shard" and stage.mesh_shape[a] > 1 and a not in skip_axes)


def _owned_gradients(runner, plan):
    """(gradient, counted) for every gradient this rank's optimizer steps, over each stage runner."""
    me = dist.get_rank()
    for r in stage_runners(runner):
        stage = r.stage
        coord = groups.coordinate(np.asarray(stage.ranks).reshape(stage.mesh_shape), me)
        shared = getattr(r, "shared", {})
        in_bucket = {}
        for bucket in r.gradsync.buckets:
            for name in bucket.names:
                in_bucket[name] = bucket
        for name, p in r.gm.named_parameters():
            if "." in name or not p.requires_grad or name not in stage.shardings:
                continue
            bucket = in_bucket.get(name)
            if bucket is not None and bucket.level >= 1:
                continue  # stepped through its bucket's shard, below
            first = min(s.index for s in plan.stages if name in s.shardings) == stage.index or name not in shared
            yield p, p.grad, first and _counted(stage, name, coord)
        for bucket in r.gradsync.buckets:
            if bucket.level < 1 or bucket.shard.grad is None:
                continue
            for name, (p, a, b) in zip(bucket.names, bucket.offsets()):
                lo, hi = max(a, bucket.lo), min(b, bucket.hi)
                if lo < hi:
                    piece = bucket.shard.grad[lo - bucket.lo:hi - bucket.lo]
                    yield None, piece, _counted(stage, name, coord, skip_axes=set(bucket.axes))
            yield bucket.shard, bucket.shard.grad, False  # clipped whole (its pieces were counted)


def global_norm(runner, plan, norm_type: float) -> torch.Tensor:
    """The norm of the whole model's gradient (a collective of every rank): see module docstring."""
    p = float(norm_type)
    local = torch.zeros((), dtype=torch.float64, device=devices.rank_device(getattr(runner, "device_type", "cpu")))
    for _, grad, counted in _owned_gradients(runner, plan):
        if grad is None or not counted or grad.numel() == 0:
            continue
        if math.isinf(p):
            local = torch.maximum(local, grad.detach().abs().max().double())
        else:
            local = local + torch.linalg.vector_norm(grad.detach(), p, dtype=torch.float64) ** p
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    local = devices.to_wire(local)
    faults.guard("all_reduce", None, dist.all_reduce, local, op=op)
    total = local if math.isinf(p) else local ** (1.0 / p)
    scaler = getattr(runner, "scaler", None)
    if scaler is not None:
        total = total / scaler.scale
    return total.float()


def clip_grad_norm_(runner, plan, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale every gradient this rank steps by min(1, max_norm / (‖g‖ + 1e-6)); returns ‖g‖ (see module doc)."""
    total = global_norm(runner, plan, norm_type)
    if not torch.isfinite(total):
        if error_if_nonfinite:
            raise UsageError(f"the total norm of order {norm_type} of the gradients is {float(total)}, so they "
                             f"cannot be clipped; pass error_if_nonfinite=False to skip clipping (under fp16 the "
                             f"optimizer step then skips the overflowed step)")
        return total
    coef = min(1.0, float(max_norm) / (float(total) + 1e-6))
    if coef < 1.0:
        with torch.no_grad():
            for param, grad, _ in _owned_gradients(runner, plan):
                if param is not None and grad is not None:
                    grad.mul_(coef)
    return total


def mark_gradients(runner) -> None:
    """Tag this rank's gradient tensors after a ``train_step`` (``_refusing_total_norm`` recognizes them)."""
    for r in stage_runners(runner):
        for p in r.gm.parameters():
            if p.grad is not None:
                p.grad._autopar_gradient = True
        for bucket in r.gradsync.buckets:
            if bucket.level >= 1 and bucket.shard.grad is not None:
                bucket.shard.grad._autopar_gradient = True


def patch_torch() -> None:
    """Route ``torch.nn.utils.clip_grad_norm_`` over autopar's parameters here; refuse torch's total norm of
    autopar gradients (see module docstring). Once per process, when the first ParallelModule is built."""
    if _ORIGINAL:
        return
    _ORIGINAL["clip"] = torch_clip.clip_grad_norm_
    _ORIGINAL["norm"] = torch_clip._get_total_norm
    _ORIGINAL["apply"] = torch_clip._clip_grads_with_norm_
    torch_clip.clip_grad_norm_ = torch.nn.utils.clip_grad_norm_ = _routed_clip_grad_norm_
    torch_clip._get_total_norm = torch.nn.utils.get_total_norm = _refusing_total_norm
    torch_clip._clip_grads_with_norm_ = torch.nn.utils.clip_grads_with_norm_ = _refusing_clip_with_norm


_REFUSAL = ("torch's gradient norm over an autopar module sees this rank's shards only (a reference to "
            "torch.nn.utils.clip_grad_norm_ taken before autopar.compile, get_total_norm or clip_grads_with_norm_); "
            "use pm.clip_grad_norm_(max_norm), which clips by the global norm and returns it")


def _routed_clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    runners = {id(r): r for p in params if (r := getattr(p, "_autopar_runner", None)) is not None}
    if not runners:
        return _ORIGINAL["clip"](params, max_norm, norm_type, error_if_nonfinite, foreach)
    if len(runners) > 1:
        raise UsageError("clip_grad_norm_ over the parameters of several autopar modules; clip each with "
                         "pm.clip_grad_norm_(max_norm)")
    runner = next(iter(runners.values()))
    owned = {id(p) for p in runner.gm.parameters() if p.requires_grad}
    given = {id(p) for p in params if p.requires_grad}
    if owned - given or given - owned - _shard_ids(runner):
        raise UsageError("torch.nn.utils.clip_grad_norm_ over part of pm.parameters() (or mixed with other "
                         "tensors) cannot be clipped by the global norm; clip them all with "
                         "pm.clip_grad_norm_(max_norm), or torch.nn.utils.clip_grad_norm_(pm.parameters(), max_norm)")
    return clip_grad_norm_(runner, runner.plan, max_norm, norm_type, error_if_nonfinite)


def _shard_ids(runner) -> set[int]:
    return {id(b.shard) for r in stage_runners(runner) for b in r.gradsync.buckets if b.level >= 1}


def _refusing_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    tensors = list(tensors)
    if any(getattr(t, "_autopar_gradient", False) for t in tensors):
        raise UsageError(_REFUSAL)
    return _ORIGINAL["norm"](tensors, norm_type, error_if_nonfinite, foreach)


def _refusing_clip_with_norm(parameters, max_norm, total_norm, foreach=None):
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if any(hasattr(p, "_autopar_runner") for p in params):
        raise UsageError(_REFUSAL)
    return _ORIGINAL["apply"](params, max_norm, total_norm, foreach)
