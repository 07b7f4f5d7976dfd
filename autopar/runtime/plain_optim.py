"""Any torch optimizer over ``pm.parameters()``, under every plan: what it steps is what this rank owns.

Invariant: an optimizer whose parameters are this rank's tensors of a ``ParallelModule`` steps exactly what
``runtime.gradsync`` leaves this rank to update, and every rank takes the same decision. Three things make a
plan need more than stepping the local tensors, and each hangs off torch's global optimizer step hooks
(registered once, when the first ParallelModule is built: ``optimizer_hooks.watch_optimizers``):
  * ZeRO >= 1: a rank steps only its shard of each gradient bucket, a flat slice no parameter is. On the
    optimizer's first step (or first checkpoint save/load, ``adopt``) each bucket's parameters in its
    param groups are replaced by the bucket's ``shard`` (state is empty then, so nothing is lost); after
    each step the shards are all-gathered back into the parameters (``GradSync.gather_params``), and before
    it a ZeRO-3 checkpoint load's writes are folded into the shards (``absorb_all``);
  * fp16 loss scaling: before the step the gradients it will read are divided by the scale and every rank
    agrees whether any overflowed (``optim.LossScaler``); on overflow the step is skipped by hiding every
    gradient from the optimizer (torch optimizers skip a parameter without one, as GradScaler's skipped
    step leaves state and step counts alone) and giving them back after it;
  * none of these change a plan without ZeRO and fp16: the hooks then only find nothing to do.
A bucket whose parameters sit in param groups with different hyperparameters cannot be stepped as one
shard: that is one ``UsageError`` naming the parameters and the fix.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from autopar.errors import UsageError

_ADOPTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> the runners it steps
_HIDDEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> grads hidden by a skipped step
_BARE: weakref.WeakSet = weakref.WeakSet()  # optimizers stepped without the hooks (``bare_step``)


def tag(runner) -> None:
    """Mark this rank's parameters as stepped under ``runner``'s plan (its gradient sync and loss scaler)."""
    for p in runner.gm.parameters():
        p._autopar_runner = runner
    for bucket in runner.gradsync.buckets:
        if bucket.level >= 1:
            bucket.shard._autopar_runner = runner


def _params(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def runners_of(optimizer) -> list:
    """The runners whose parameters ``optimizer`` steps (adopting it on first use), in a fixed order."""
    if getattr(optimizer, "_autopar_owned", False):
        return []  # a PlanOptimizer's inner optimizer (offload): it does this work itself
    if optimizer not in _ADOPTED:
        _ADOPTED[optimizer] = adopt(optimizer)
    return _ADOPTED[optimizer]


def adopt(optimizer) -> list:
    """Replace each ZeRO bucket's parameters in ``optimizer``'s param groups by the bucket's shard."""
    runners = {}
    for p in _params(optimizer):
        runner = getattr(p, "_autopar_runner", None)
        if runner is not None:
            runners.setdefault(id(runner), runner)
    for runner in runners.values():
        for bucket in runner.gradsync.buckets:
            if bucket.level >= 1:
                _swap_in_shard(optimizer, bucket)
    return list(runners.values())


def _swap_in_shard(optimizer, bucket) -> None:
    mine = {id(p) for p in bucket.params}
    where = [(k, p) for k, group in enumerate(optimizer.param_groups) for p in group["params"] if id(p) in mine]
    if not where or any(p is bucket.shard for group in optimizer.param_groups for p in group["params"]):
        return
    groups = sorted({k for k, _ in where})
    if len(groups) > 1 and not _same_hyperparameters([optimizer.param_groups[k] for k in groups]):
        names = [n for n, p in zip(bucket.names, bucket.params) if id(p) in mine]
        raise UsageError(f"parameters {names[:4]} share one ZeRO shard (they are updated as one flat slice) but "
                         f"sit in param groups {groups} with different settings; put them in one group, or "
                         f"plan them without sharded optimizer state: compile with zero=0 (or zero={{glob: 0}})")
    if len(where) < len(bucket.params):
        missing = [n for n, p in zip(bucket.names, bucket.params) if not any(q is p for _, q in where)]
        raise UsageError(f"the optimizer steps part of a ZeRO shard but not parameters {missing[:4]}, which are "
                         f"updated with it; build it over all of pm.parameters() (or use param groups), or "
                         f"plan without sharded optimizer state (zero=0)")
    if any(p in optimizer.state for _, p in where):
        raise UsageError("this optimizer already holds state for parameters that ZeRO shards; build it from "
                         "pm.parameters() before its first step, as pm.optimizer does")
    first = optimizer.param_groups[groups[0]]
    for k in groups:
        group = optimizer.param_groups[k]
        group["params"] = [p for p in group["params"] if id(p) not in mine]
    first["params"].append(bucket.shard)


def _same_hyperparameters(groups: list[dict]) -> bool:
    def settings(g):
        return {k: v for k, v in g.items() if k != "params"}
    return all(settings(g) == settings(groups[0]) for g in groups)


@contextlib.contextmanager
def bare_step(optimizer):
    """Steps of ``optimizer`` inside run without the hooks (a checkpoint load creating state with lr = 0:
    no unscaling, no loss-scale update, nothing to gather)."""
    _BARE.add(optimizer)
    try:
        yield
    finally:
        _BARE.discard(optimizer)


def before_step(optimizer) -> None:
    """Unscale and agree on overflow (fp16), hiding the gradients of a skipped step; fold in checkpoint
    writes (ZeRO-3). See module docstring."""
    if optimizer in _BARE:
        return
    for runner in runners_of(optimizer):
        runner.gradsync.units.absorb_all()
        scaler = runner.scaler
        if scaler is None:
            continue
        found = scaler.unscale_and_check([p.grad for p in _params(optimizer)
                                          if p.grad is not None and getattr(p, "_autopar_runner", None) is runner])
        scaler.update(found)
        if found:
            hidden = _HIDDEN.setdefault(optimizer, {})
            for p in _params(optimizer):
                if p.grad is not None:
                    hidden[p] = p.grad
                    p.grad = None


def after_step(optimizer) -> None:
    """Give back the gradients a skipped step hid; all-gather the updated ZeRO shards."""
    if optimizer in _BARE:
        return
    for p, grad in _HIDDEN.pop(optimizer, {}).items():
        p.grad = grad
    for runner in runners_of(optimizer):
        runner.gradsync.gather_params()


def skipped(optimizer) -> bool:
    """Whether ``optimizer``'s last step was skipped for an overflow (fp16): true between the pre- and
    post-hook only; use ``pm.runner.scaler.skipped`` to count skipped steps."""
    return optimizer in _HIDDEN
