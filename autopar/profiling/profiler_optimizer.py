"""The optimizer step on CPU ranks, measured (profiler item 9): host seconds per call, bytes per second.

Invariant: with h = ``Cluster.optimizer_call_overhead`` and W = ``Cluster.optimizer_bandwidth``,
``cost_models.compute.optimizer_step_time`` on a CPU rank is

    t = n_tensors · calls(optimizer) · h  +  numel · itemsize · OPTIMIZER_TRAFFIC[optimizer] / W

and the two probes below are priced by that very formula, so each measurement fixes one unknown:

    TINY:  AdamW.step() over TINY_TENSORS tensors of 4 elements (traffic ~0):  h = t_tiny / (TINY_TENSORS · c)
    LARGE: AdamW.step() over LARGE_TENSORS tensors of LARGE_NUMEL fp32 elements:
           W = LARGE_TENSORS · LARGE_NUMEL · 4 · OPTIMIZER_TRAFFIC["adamw"] / (t_large − LARGE_TENSORS · c · h)

c = ``optimizer_calls_per_tensor("adamw")`` (counted ATen calls). Both timed as every compute probe is: all
ranks at once, in reference-mm units, turned into seconds at the profile's level.

Why not op_overhead and memory_bandwidth: torch steps CPU parameters one tensor at a time with in-place
ops under no_grad, which skip autograd's bookkeeping: on the 2-core development VM (torch 2.13, one
thread) an AdamW call took 2.8-3.2 µs of host time where a graph op took 12-14 µs per pass (op_overhead);
and its ~10 passes per element ran at 1.7-3.9 ns per fp32 element on tensors of 16 K-1 M elements, 2-4×
the 7 DRAM passes that OPTIMIZER_TRAFFIC counts at the streaming bandwidth (0.97 ns). The two errors
cancelled on a GPT of 3.3 M parameters in 65 tensors and not elsewhere: 64 tiny tensors were priced 5.7×
their measured step, 2 tensors of 4 M elements 0.56× (one process; the new price: 1.9× and 1.0×). GPUs
step with foreach or fused kernels beside which the host is hidden; they keep the streaming bandwidth (fields
left 0).
"""
from __future__ import annotations

import statistics

import torch

from autopar.cost_models.compute import OPTIMIZER_TRAFFIC
from autopar.cost_models.optimizer_calls import optimizer_calls_per_tensor

TINY_TENSORS = 64
LARGE_TENSORS = 4
LARGE_NUMEL = 1 << 20  # 4 MB per fp32 tensor: a CPU-sized model's layer, its optimizer state out of L2


def _adamw_step(tensors: int, numel: int):
    """A zero-argument call: one AdamW step (torch's defaults) over ``tensors`` fp32 CPU tensors of ``numel``
    elements, gradients in place and state built by a first step."""
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    optimizer.step()
    return optimizer.step


def measure_optimizer(relative, kind: str) -> list[float] | None:
    """[TINY, LARGE] probe seconds in reference units via ``relative`` (``profiler_training.measure_rank``'s),
    or None on GPU ranks."""
    if kind == "cuda":
        return None
    return [relative(_adamw_step(TINY_TENSORS, 4), "optimizer calls"),
            relative(_adamw_step(LARGE_TENSORS, LARGE_NUMEL), "optimizer bytes")]


def optimizer_figures(per_rank: list[dict]) -> tuple[float, float]:
    """(h, W) of the module docstring from the ranks' probe seconds (medians over ranks); (0, 0) when the
    probes did not run, or when the large probe leaves no time beyond its host part."""
    timed = [r["optimizer"] for r in per_rank if r.get("optimizer")]
    if not timed:
        return 0.0, 0.0
    tiny, large = (statistics.median(t[i] for t in timed) for i in range(2))
    calls = optimizer_calls_per_tensor("adamw")
    per_call = tiny / (TINY_TENSORS * calls)
    traffic_s = large - LARGE_TENSORS * calls * per_call
    if traffic_s <= 0:
        return per_call, 0.0
    return per_call, LARGE_TENSORS * LARGE_NUMEL * 4 * OPTIMIZER_TRAFFIC["adamw"] / traffic_s


def optimizer_note(per_call: float, bandwidth: float) -> str:
    if not per_call:
        return ""
    rate = f", its element passes at {bandwidth / 1e9:.1f} GB/s as OPTIMIZER_TRAFFIC counts them" if bandwidth else ""
    return f"optimizer step: {per_call * 1e6:.1f} µs of host time per ATen call{rate}"
