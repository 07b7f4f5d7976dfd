"""Collectives that generated code calls, each named by its forward/backward pair (Megatron's mappings).

Every function takes a local tensor and a group key (``autopar.runtime.groups``) and is correct under
autograd with the gradient convention of ``autopar.redistribute``: Replicate tensors carry full
gradients, Shard tensors their shard, Partial tensors the full gradient of the sum.

Why custom ``autograd.Function``s rather than ``torch.distributed._functional_collectives``' autograd
variants: those fix one backward per forward (all-gather always reduce-scatters its gradient), while a
plan needs both (a gathered input read by a replicated op has a full gradient: slicing is enough).
Bool tensors travel as uint8 (gloo has no bool reductions). Every result is contiguous: the original
program's views assume the layout its own ops produce, and a gathered shard must not break that.
Every torch.distributed call goes through ``faults.guard``, so a dead peer raises a ``CommunicationError``
naming it (no cost on the success path). Under ``torch.compile`` (``runtime.compiled``) the same wire
operations are traced as functional collectives instead (``runtime.traced_collectives``).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from autopar.redistribute import Step
from autopar.runtime import devices, faults, groups
from autopar.runtime import traced_collectives as traced
from autopar.runtime.flat_collectives import all_gather_flat, reduce_scatter_flat

_tracing = torch.compiler.is_compiling


def _comm_dtype(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.uint8) if t.dtype == torch.bool else t


def _gather(x: torch.Tensor, dim: int, key: str) -> torch.Tensor:
    if _tracing():
        return traced.gather(x, dim, key)
    n = groups.size(key)
    src = devices.to_wire(_comm_dtype(x).movedim(dim, 0).contiguous())
    out = torch.empty((n * src.shape[0],) + tuple(src.shape[1:]), dtype=src.dtype, device=src.device)
    faults.guard("all_gather", key, all_gather_flat, out, src, group=groups.get(key))
    return out.movedim(0, dim).to(device=x.device, dtype=x.dtype).contiguous()


def _chunk(x: torch.Tensor, dim: int, key: str) -> torch.Tensor:
    return x.chunk(groups.size(key), dim=dim)[groups.local_rank_in(key)].contiguous()


def _all_reduce(x: torch.Tensor, key: str) -> torch.Tensor:
    if _tracing():
        return traced.all_reduce(x, key)
    out = devices.to_wire(x.contiguous(), copy=True)
    faults.guard("all_reduce", key, dist.all_reduce, out, group=groups.get(key))
    return out.to(x.device)


def _reduce_scatter(x: torch.Tensor, dim: int, key: str) -> torch.Tensor:
    if _tracing():
        return traced.reduce_scatter(x, dim, key)
    n = groups.size(key)
    src = devices.to_wire(x.movedim(dim, 0).contiguous())
    out = torch.empty((src.shape[0] // n,) + tuple(src.shape[1:]), dtype=src.dtype, device=src.device)
    faults.guard("reduce_scatter", key, reduce_scatter_flat, out, src, group=groups.get(key))
    return out.movedim(0, dim).to(x.device).contiguous()


def _all_to_all(x: torch.Tensor, cat_dim: int, split_dim: int, key: str) -> torch.Tensor:
    if _tracing():
        return traced.all_to_all(x, cat_dim, split_dim, key)
    n = groups.size(key)
    src = _comm_dtype(x)
    send = devices.to_wire(torch.stack(src.chunk(n, dim=split_dim)).contiguous())
    recv = torch.empty_like(send)
    faults.guard("all_to_all", key, dist.all_to_all_single, recv, send, group=groups.get(key))
    return torch.cat(recv.unbind(0), dim=cat_dim).to(device=x.device, dtype=x.dtype)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, key, reduce_scatter_grad):
        ctx.dim, ctx.key, ctx.rs = dim, key, reduce_scatter_grad
        return _gather(x, dim, key)

    @staticmethod
    def backward(ctx, grad):
        g = _reduce_scatter(grad, ctx.dim, ctx.key) if ctx.rs else _chunk(grad, ctx.dim, ctx.key)
        return g, None, None, None


def all_gather_fwd_split_bwd(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """Shard(dim) -> Replicate; backward keeps this rank's slice of the (full) gradient."""
    return _AllGather.apply(x, dim, group, False)


def all_gather_fwd_reduce_scatter_bwd(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """Shard(dim) -> Replicate; backward reduce-scatters a Partial gradient (sequence-parallel style)."""
    return _AllGather.apply(x, dim, group, True)


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, key):
        ctx.dim, ctx.key = dim, key
        return _chunk(x, dim, key)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.key), None, None


def split_fwd_all_gather_bwd(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """Replicate -> Shard(dim) by a local slice; backward all-gathers the gradient."""
    return _Split.apply(x, dim, group)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key, reduce_grad):
        ctx.key, ctx.reduce_grad = key, reduce_grad
        return _all_reduce(x, key)

    @staticmethod
    def backward(ctx, grad):
        return (_all_reduce(grad, ctx.key) if ctx.reduce_grad else grad), None, None


def all_reduce_fwd_identity_bwd(x: torch.Tensor, group: str) -> torch.Tensor:
    """Partial -> Replicate (Megatron's g): sum over the group; the gradient passes through."""
    return _AllReduce.apply(x, group, False)


def all_reduce_fwd_all_reduce_bwd(x: torch.Tensor, group: str) -> torch.Tensor:
    """Partial -> Replicate read by an op whose output is not Replicate: both directions reduce."""
    return _AllReduce.apply(x, group, True)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, key):
        ctx.dim, ctx.key = dim, key
        return _reduce_scatter(x, dim, key)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.key), None, None


def reduce_scatter_fwd_all_gather_bwd(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """Partial -> Shard(dim): sum and keep this rank's slice; backward all-gathers."""
    return _ReduceScatter.apply(x, dim, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_dim, dst_dim, key):
        ctx.src_dim, ctx.dst_dim, ctx.key = src_dim, dst_dim, key
        return _all_to_all(x, src_dim, dst_dim, key)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.dst_dim, ctx.src_dim, ctx.key), None, None, None


def all_to_all_fwd_all_to_all_bwd(x: torch.Tensor, src_dim: int, dst_dim: int, group: str) -> torch.Tensor:
    """Shard(src_dim) -> Shard(dst_dim); backward is the reverse all-to-all."""
    return _AllToAll.apply(x, src_dim, dst_dim, group)


class _ToPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key):
        return x / groups.size(key)

    @staticmethod
    def backward(ctx, grad):
        return grad, None  # grad is replicated; the group's paths of weight 1/W sum to it


def scale_fwd_identity_bwd(x: torch.Tensor, group: str) -> torch.Tensor:
    """Replicate -> Partial: each rank holds x / W; the gradient passes through."""
    return _ToPartial.apply(x, group)


class _SyncGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key):
        ctx.key = key
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.key), None


def identity_fwd_all_reduce_bwd(x: torch.Tensor, group: str) -> torch.Tensor:
    """Megatron's f: a Replicate input read by a sharded op; its Partial gradient is summed."""
    return _SyncGrad.apply(x, group)


def gather_full(x: torch.Tensor, spec, mesh_index: int) -> torch.Tensor:
    """No-grad: the full tensor from this rank's shard (Partial axes summed), for checkpoints and outputs."""
    with torch.no_grad():
        for axis in reversed(range(len(spec))):
            key = groups.group_key(mesh_index, axis)
            if spec[axis].is_shard():
                x = _gather(x, spec[axis].dim, key)
            elif spec[axis].is_partial():
                x = _all_reduce(x, key)
    return x


def step_call(step: Step, group: str, value) -> tuple[Callable, tuple]:
    """The collective that carries out one redistribution step, as (function, arguments): ``value`` is a
    tensor (run it now) or an fx node (emit the call into generated code)."""
    if step.kind == "all_gather":
        fn = all_gather_fwd_reduce_scatter_bwd if step.rs_backward else all_gather_fwd_split_bwd
        return fn, (value, step.dim, group)
    if step.kind == "split":
        return split_fwd_all_gather_bwd, (value, step.dim, group)
    if step.kind == "all_reduce":
        fn = all_reduce_fwd_all_reduce_bwd if step.ar_backward else all_reduce_fwd_identity_bwd
        return fn, (value, group)
    if step.kind == "reduce_scatter":
        return reduce_scatter_fwd_all_gather_bwd, (value, step.dim, group)
    if step.kind == "all_to_all":
        return all_to_all_fwd_all_to_all_bwd, (value, step.dim, step.dim2, group)
    if step.kind == "to_partial":
        return scale_fwd_identity_bwd, (value, group)
    if step.kind == "sync_grad":
        return identity_fwd_all_reduce_bwd, (value, group)
    raise AssertionError(step.kind)
