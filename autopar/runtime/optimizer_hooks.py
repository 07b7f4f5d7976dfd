"""Step hooks on every torch optimizer, registered once a ParallelModule exists: ZeRO's and fp16's work around
``step()`` (``plain_optim``), and a warning for a common mistake.

Invariant: after ``watch_optimizers()`` each ``optimizer.step()`` runs ``plain_optim.before_step`` before and
``plain_optim.after_step`` after it; an optimizer none of whose tensors is autopar's finds nothing to do. An
optimizer's first step is also checked once (``check_raw``, and a warning when none of its parameters has
a gradient: it was built from ``model.parameters()``, which autopar never trains).
"""
from __future__ import annotations

import warnings
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from autopar.runtime import plain_optim

# ---- a common mistake: an optimizer over the original model's parameters --------------------------------
_CHECKED: weakref.WeakSet = weakref.WeakSet()  # optimizers whose first step was checked
_HOOK: list = []  # the handles of the two registered hooks, once a ParallelModule exists


def watch_optimizers() -> None:
    """Register the step hooks on torch optimizers, once per process, when the first ParallelModule is built
    (never at import: importing autopar leaves torch's optimizers untouched): ``_before_step`` (the
    no-gradient warning below; ZeRO and fp16's work, ``plain_optim``) and ``plain_optim.after_step``.
    torch offers the hooks globally only; an optimizer none of whose tensors is autopar's finds nothing to do."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_before_step))
        _HOOK.append(register_optimizer_step_post_hook(_after_step))


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    plain_optim.runners_of(optimizer)  # ZeRO: its bucket parameters become the shards, which have the gradients
    _warn_if_no_parameter_has_a_gradient(optimizer)
    plain_optim.before_step(optimizer)


def _after_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    plain_optim.after_step(optimizer)


def _warn_if_no_parameter_has_a_gradient(optimizer: torch.optim.Optimizer) -> None:
    """Checks each optimizer's first step only (then one set lookup per step): ``train_step`` leaves
    gradients on ``pm.parameters()``, so an optimizer none of whose parameters has one was almost surely
    built from ``model.parameters()``, which autopar never trains."""
    if optimizer in _CHECKED:
        return
    from autopar.runtime.optim import check_raw

    params = [p for group in optimizer.param_groups for p in group["params"]]
    check_raw(optimizer, params)
    _CHECKED.add(optimizer)
    if params and all(p.grad is None for p in params):
        warnings.warn(f"{type(optimizer).__name__}.step(): none of its {len(params)} parameters has a gradient, "
                      f"so nothing is updated. With autopar, build the optimizer from pm.parameters() (this "
                      f"rank's shards), not model.parameters(): the original model is copied, never trained",
                      stacklevel=3)

