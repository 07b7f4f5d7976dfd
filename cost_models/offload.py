"""CPU offload priced per stage: optimizer state in host memory (ZeRO-Offload) and activations swapped out.

Optimizer offload (Ren et al., "ZeRO-Offload", ATC'21): the optimizer state and the fp32 master weights live in
host memory and the step runs there. A rank stepping N local parameter elements of itemsize s then moves
the gradients out and the updated parameters back over its PCIe link, and steps on the host:

    t_step = 2 · N · s / pcie  +  N · 4 · OPTIMIZER_TRAFFIC / host_bw          (host figures: hardware.host)
             + optimizer_host_seconds(n_tensors, optimizer)           (0 on GPUs)

(the per-tensor host time as ``compute.optimizer_step_time`` charges it: the host copies are stepped by the
same torch optimizer, one tensor at a time) in place of the device step; device memory loses the state and
master bytes (``TrainingSpec.host_optimizer``). The transfers are not overlapped with backward here (ZeRO-Offload
overlaps the gradient copies with backward; an upper bound).

Per stage, as a lever of the stage DP (``passes.stage_offload``): offloading N stepped local elements of
itemsize s frees their state and master bytes on the device and adds the host step less the device step it
replaces (their memory traffic; the per-tensor host time is the same on both sides and cancels):

    freed = N · (state + master)                  (state: OPTIMIZER_STATE_BYTES; master: 4 for fp16/bf16)
    added = max(0, t_step − N · s · OPTIMIZER_TRAFFIC / optimizer_bandwidth)   seconds per step

Activation offload (``torch.autograd.graph.save_on_cpu``: every tensor saved for backward is copied to host
memory in forward and back in backward): with A bytes saved per microbatch and c seconds of compute,

    t_act = max(0, 2 · A / pcie − c)       per microbatch (copies on a side stream hide behind compute)

and the device keeps none of them between forward and backward.
"""
from __future__ import annotations

import torch

from autopar.cost_models.compute import OPTIMIZER_TRAFFIC, optimizer_bandwidth, optimizer_host_seconds
from autopar.cost_models.memory import OPTIMIZER_STATE_BYTES
from autopar.hardware.host import host_of


def host_optimizer_seconds(numel: float, itemsize: int, optimizer: str, cluster, n_tensors: int = 0) -> float:
    """Seconds of one offloaded optimizer step over ``numel`` local elements in ``n_tensors`` tensors (module
    docstring)."""
    host = host_of(cluster)
    seconds = 2 * numel * itemsize / host.pcie + numel * 4 * OPTIMIZER_TRAFFIC[optimizer] / host.host_bw
    return seconds + optimizer_host_seconds(n_tensors, optimizer, cluster)


def optimizer_offload_effect(numel: float, dtype: torch.dtype, optimizer: str, cluster) -> tuple[float, float]:
    """(device bytes freed, seconds added per step) by stepping ``numel`` local elements on the host (docstring)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    master = 4 if dtype in (torch.float16, torch.bfloat16) else 0
    device_step = numel * itemsize * OPTIMIZER_TRAFFIC[optimizer] / optimizer_bandwidth(cluster)
    added = max(0.0, host_optimizer_seconds(numel, itemsize, optimizer, cluster) - device_step)
    return numel * (OPTIMIZER_STATE_BYTES[optimizer] + master), added


def activation_swap_seconds(saved_bytes: float, compute_seconds: float, cluster) -> float:
    """Exposed seconds per microbatch of swapping ``saved_bytes`` out and back (module docstring)."""
    return max(0.0, 2 * saved_bytes / host_of(cluster).pcie - compute_seconds)
