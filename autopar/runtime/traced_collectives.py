"""The collectives of ``runtime.collectives`` as torch.compile traces them: functional collectives.

Invariant: each function returns what its eager twin in ``runtime.collectives`` returns (same values, dtype,
layout: contiguous), by the same wire operation on the same group, so a compiled rank and an eager rank
exchange the same messages in the same order.

Inside ``torch.compile`` the eager path (``torch.distributed`` calls writing into preallocated tensors,
wrapped in ``faults.guard``'s try/except) would break the graph at every collective. These use
``torch.ops._c10d_functional`` (the ops ``torch.distributed._functional_collectives`` and DTensor lower to):
pure ops whose arguments are the tensor, the group's size and its c10d name (plain constants), followed by
``wait_tensor``. Dynamo records them in the graph and inductor emits them as collective kernels, so a
tensor-parallel layer compiles to one graph. They are called only while tracing
(``torch.compiler.is_compiling()``); the autograd.Functions of ``runtime.collectives`` stay the
differentiation rule in both modes (dynamo traces their forward and backward).

Failure reporting: a compiled module's collectives are not wrapped one by one; ``runtime.compiled`` wraps
each call of the compiled module in ``faults.guard``, so a dead peer is still named, and every group
carries the collective timeout it was created with (``groups.build_groups``), so nothing waits forever.
"""
from __future__ import annotations

import torch

from autopar.runtime import groups

_F = torch.ops._c10d_functional


def _wire(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.uint8) if x.dtype == torch.bool else x


def gather(x: torch.Tensor, dim: int, key: str) -> torch.Tensor:
    src = _wire(x).movedim(dim, 0).contiguous()
    out = _F.wait_tensor(_F.all_gather_into_tensor(src, groups.size(key), groups.name(key)))
    return out.movedim(0, dim).to(x.dtype).contiguous()


def all_reduce(x: torch.Tensor, key: str, op: str = "sum") -> torch.Tensor:
    return _F.wait_tensor(_F.all_reduce(x.contiguous(), op, groups.name(key)))


def reduce_scatter(x: torch.Tensor, dim: int, key: str) -> torch.Tensor:
    src = x.movedim(dim, 0).contiguous()
    out = _F.wait_tensor(_F.reduce_scatter_tensor(src, "sum", groups.size(key), groups.name(key)))
    return out.movedim(0, dim).contiguous()


def all_to_all(x: torch.Tensor, cat_dim: int, split_dim: int, key: str) -> torch.Tensor:
    n = groups.size(key)
    src = _wire(x)
    send = torch.stack(src.chunk(n, dim=split_dim)).contiguous()
    recv = _F.wait_tensor(_F.all_to_all_single(send, [1] * n, [1] * n, groups.name(key)))
    return torch.cat(recv.unbind(0), dim=cat_dim).to(x.dtype)
