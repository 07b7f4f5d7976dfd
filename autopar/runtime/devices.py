"""Where a rank's tensors live: every tensor the runtime creates names its device.

Invariant: a rank's parameters, buffers, gradients, flat sync buffers and pipeline messages live on
``rank_device`` (its GPU on a CUDA plan, else the CPU), and a collective's scratch tensors on ``wire_device``
(the device the default group's backend moves: NCCL moves GPU memory only; gloo moves CPU memory, and GPU
tensors by staging them). tests/test_device_discipline.py checks statically that every tensor factory call in
the runtime passes ``device=``, so nothing lands on the CPU of a GPU rank by default.

A rank's GPU is ``torch.cuda.current_device()``: ``autopar.launch`` sets it from the local rank before the
process group starts (one GPU per rank, as torchrun users do with ``torch.cuda.set_device(LOCAL_RANK)`` for
DDP and FSDP).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def rank_device(device_type: str) -> torch.device:
    """The device this rank computes on for a plan of ``device_type`` ("cuda" or "cpu")."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def wire_device(backend: str | None = None) -> torch.device:
    """The device a collective's tensors must be on for ``backend`` (default: the default group's)."""
    backend = backend if backend is not None else dist.get_backend()
    if "nccl" in str(backend).lower() and "gloo" not in str(backend).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_wire(t: torch.Tensor, copy: bool = False, backend: str | None = None) -> torch.Tensor:
    """``t`` on the wire device (a no-op when it is there already, unless ``copy``).

    gloo's point-to-point and most of its collectives read a GPU tensor's device pointer as host memory
    (``writev: Bad address``), so a GPU rank on gloo stages every message through host memory; callers move
    the result back with ``.to(original.device)``.
    """
    return t.to(wire_device(backend), copy=copy)


def local_gpu_index(rank: int) -> int:
    """The GPU of a process on a node: its local rank (``LOCAL_RANK``, else ``rank``) modulo the GPUs seen."""
    local = int(os.environ.get("LOCAL_RANK", rank))
    return local % max(1, torch.cuda.device_count())
