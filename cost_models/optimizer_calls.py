"""Op calls per parameter tensor of one torch optimizer step on CPU tensors, counted, not assumed.

Invariant: ``optimizer_calls_per_tensor(name)`` = (ATen calls of ``step()`` over two tensors) − (over one),
counted under a ``TorchDispatchMode`` on tiny CPU tensors after a first step has built the optimizer's state.
torch steps CPU parameters one tensor at a time (``foreach`` and ``fused`` default to CUDA tensors only), so
every tensor pays that many eager op calls of host time, each at the profile's measured rate for an optimizer's
calls (``compute.optimizer_call_seconds``: ``optimizer_call_overhead``, else ``op_overhead``).
On torch 2.13 that is 10 for AdamW (add_, mul_ for the decay, lerp_, mul_, addcmul_, the step's item(), sqrt,
div, add_, addcdiv_), 9 for Adam, 3 for SGD with momentum and 1 for plain SGD. ``zero_grad(set_to_none=True)``
makes no ATen call; its per-tensor host work (a Python loop that drops each gradient) is charged as
ZERO_GRAD_CALLS_PER_TENSOR op call.

The same loop moves more bytes than a fused update's minimum (``compute.OPTIMIZER_TRAFFIC``: AdamW reads p, g,
m, v and writes p, m, v, 7 passes): each call reads and writes whole tensors, and the loop materializes its
temporaries (sqrt, div). ``optimizer_passes_per_element(name)`` counts them the same way, as the bytes of
every tensor each ATen call reads (its tensor arguments) and writes (its outputs, an in-place op's too) per
element of the parameter, in units of its itemsize: 21 for AdamW on torch 2.13, 19 for Adam, 8 for SGD
with momentum, 3 for SGD.

The counts are taken with torch's defaults for each optimizer (AdamW's weight decay included), as a user
constructs it for the runtime's parameters; it is a property of the installed torch, cached per process.
"""
from __future__ import annotations

import functools

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# optimizer name (cost_models.compute.OPTIMIZER_TRAFFIC's) -> (torch class, constructor options)
TORCH_OPTIMIZERS = {"adamw": ("AdamW", {}), "adam": ("Adam", {}), "sgd_momentum": ("SGD", {"momentum": 0.9}),
                    "sgd": ("SGD", {})}
ZERO_GRAD_CALLS_PER_TENSOR = 1


PASS_PROBE_ELEMENTS = 4096  # elements per tensor when counting bytes: the step counter's scalars are noise


class _AtenCalls(TorchDispatchMode):
    """Counts the ATen operator calls made under it (the profiler's record_function markers are not ops) and
    the bytes of the tensors they read and write."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func).startswith("aten."):
            self.calls += 1
            self.bytes += sum(t.numel() * t.element_size() for t in pytree.tree_leaves((args, kwargs, out))
                              if isinstance(t, torch.Tensor))
        return out


def _counted_step(optimizer: str, tensors: int, elements: int = 4) -> _AtenCalls:
    name, options = TORCH_OPTIMIZERS[optimizer]
    params = [torch.nn.Parameter(torch.ones(elements)) for _ in range(tensors)]
    opt = getattr(torch.optim, name)(params, lr=1e-3, **options)
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    opt.step()  # the first step builds the state (exp_avg, ...): count a steady one
    with _AtenCalls() as counter:
        opt.step()
    return counter


def _step_calls(optimizer: str, tensors: int) -> int:
    return _counted_step(optimizer, tensors).calls


@functools.lru_cache(maxsize=None)
def optimizer_calls_per_tensor(optimizer: str) -> int:
    """ATen calls one ``step()`` of ``optimizer`` makes per parameter tensor on CPU (module docstring)."""
    if optimizer not in TORCH_OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} has no torch counterpart to count; "
                         f"known: {sorted(TORCH_OPTIMIZERS)}")
    with _disable_current_modes():  # a planner's fake or meta mode must not see (or fake) these tensors
        return _step_calls(optimizer, 2) - _step_calls(optimizer, 1)


@functools.lru_cache(maxsize=None)
def optimizer_passes_per_element(optimizer: str) -> int:
    """Bytes one ``step()`` of ``optimizer`` reads and writes per parameter element on CPU, in units of the
    parameter's itemsize (module docstring): counted on fp32 tensors of ``PASS_PROBE_ELEMENTS`` elements."""
    if optimizer not in TORCH_OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} has no torch counterpart to count; "
                         f"known: {sorted(TORCH_OPTIMIZERS)}")
    with _disable_current_modes():
        two, one = (_counted_step(optimizer, n, PASS_PROBE_ELEMENTS).bytes for n in (2, 1))
    return round((two - one) / (PASS_PROBE_ELEMENTS * 4))
