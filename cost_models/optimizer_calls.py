"""Op calls per parameter tensor of one torch optimizer step on CPU tensors, counted, not assumed.

Invariant: ``optimizer_calls_per_tensor(name)`` = (ATen calls of ``step()`` over two tensors) − (over one),
counted under a ``TorchDispatchMode`` on tiny CPU tensors after a first step has built the optimizer's state.
torch steps CPU parameters one tensor at a time (``foreach`` and ``fused`` default to CUDA tensors only), so
every tensor pays that many eager op calls of host time, ``op_overhead`` each (``compute.optimizer_step_time``).
On torch 2.13 that is 10 for AdamW (add_, mul_ for the decay, lerp_, mul_, addcmul_, the step's item(), sqrt,
div, add_, addcdiv_), 9 for Adam, 3 for SGD with momentum and 1 for plain SGD. ``zero_grad(set_to_none=True)``
makes no ATen call; its per-tensor host work (a Python loop that drops each gradient) is charged as
ZERO_GRAD_CALLS_PER_TENSOR op call.

The count is taken with torch's defaults for each optimizer (AdamW's weight decay included), as a user
constructs it for the runtime's parameters; it is a property of the installed torch, cached per process.
"""
from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# optimizer name (cost_models.compute.OPTIMIZER_TRAFFIC's) -> (torch class, constructor options)
TORCH_OPTIMIZERS = {"adamw": ("AdamW", {}), "adam": ("Adam", {}), "sgd_momentum": ("SGD", {"momentum": 0.9}),
                    "sgd": ("SGD", {})}
ZERO_GRAD_CALLS_PER_TENSOR = 1


class _AtenCalls(TorchDispatchMode):
    """Counts the ATen operator calls made under it (the profiler's record_function markers are not ops)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += str(func).startswith("aten.")
        return func(*args, **(kwargs or {}))


def _step_calls(optimizer: str, tensors: int) -> int:
    name, options = TORCH_OPTIMIZERS[optimizer]
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(tensors)]
    opt = getattr(torch.optim, name)(params, lr=1e-3, **options)
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    opt.step()  # the first step builds the state (exp_avg, ...): count a steady one
    with _AtenCalls() as counter:
        opt.step()
    return counter.calls


@functools.lru_cache(maxsize=None)
def optimizer_calls_per_tensor(optimizer: str) -> int:
    """ATen calls one ``step()`` of ``optimizer`` makes per parameter tensor on CPU (module docstring)."""
    if optimizer not in TORCH_OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} has no torch counterpart to count; "
                         f"known: {sorted(TORCH_OPTIMIZERS)}")
    with _disable_current_modes():  # a planner's fake or meta mode must not see (or fake) these tensors
        return _step_calls(optimizer, 2) - _step_calls(optimizer, 1)
