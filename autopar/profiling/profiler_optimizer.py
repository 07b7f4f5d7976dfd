"""The host time of one op call of an optimizer step on CPU ranks, measured on torch's own optimizer.

    optimizer_call_overhead = median over ranks of  t_step / (K · optimizer_calls_per_tensor("adamw"))

t_step: one ``AdamW.step()`` over K parameter tensors of a few elements each (kernels cost ~nothing, so the
time is the host's), timed between reference mms like every compute probe (``probes.SpeedReference``) and
taken at the profile's level. ``cost_models.optimizer_calls`` counts the ATen calls torch's per-tensor loop
makes (AdamW 10 on torch 2.13); ``cost_models.compute.optimizer_step_time`` charges each tensor that many
calls (and zero_grad's one) at this rate.

Why not ``op_overhead``: that is one node's host time in forward + backward of a training block (Python,
dispatcher, an autograd node, its backward's calls), measured per graph node. An optimizer's calls run under
``no_grad`` from a plain loop, each one ATen call with no autograd bookkeeping; priced at op_overhead the
fidelity GPT's AdamW step read 1.2-2.2x its measured time on the development VM (benchmarks/fidelity/
step_parts.py, 2026-11-27). GPUs step with foreach kernels and are not charged per tensor: nothing is
measured there (0: ``optimizer_step_time`` then keeps ``op_overhead``).
"""
from __future__ import annotations

import statistics

import torch

from autopar.cost_models.optimizer_calls import optimizer_calls_per_tensor

PROBE_TENSORS = 64  # K: enough per-tensor iterations that the step's fixed Python work is a small share
PROBE_ELEMENTS = 8  # elements per tensor: the update's arithmetic is ~free beside its calls
PROBE_OPTIMIZER = "adamw"


def optimizer_step_call(device) -> object:
    """One ``AdamW.step()`` over ``PROBE_TENSORS`` tiny parameters with gradients, as a zero-argument call (its
    state built by a first step, so the timed steps are steady ones)."""
    params = [torch.nn.Parameter(torch.ones(PROBE_ELEMENTS, device=device)) for _ in range(PROBE_TENSORS)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-6)
    opt.step()
    return opt.step


def call_overhead(step_seconds: list[float]) -> float:
    """optimizer_call_overhead (module docstring) from each rank's seconds of one probe step; 0 for none."""
    if not step_seconds:
        return 0.0
    return statistics.median(step_seconds) / (PROBE_TENSORS * optimizer_calls_per_tensor(PROBE_OPTIMIZER))
