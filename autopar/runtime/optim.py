"""fp16's dynamic loss scaling, and ``pm.optimizer``'s param groups by the model's parameter names.

Any torch optimizer over ``pm.parameters()`` steps what this rank owns under every plan (ZeRO shards, fp16
unscaling and skipped steps: ``runtime.plain_optim``); ``pm.optimizer(cls, param_groups=..., **kw)`` builds
one, with param groups named by the model's parameter names or globs (``named_groups``). A plan that
offloads optimizer state to host memory still needs ``pm.optimizer`` (``PlanOptimizer`` steps host copies).

Loss scaling (``LossScaler``, the constants and update rule of ``torch.amp.GradScaler``): before each step
the gradients the optimizer steps are divided by the scale; a found-inf flag (1 if any of this rank's is
inf/NaN) is all-reduced with MAX over every rank of the job, under the collective timeout, so every rank
takes the same decision: skip the step and multiply the scale by ``backoff_factor``, or step and count a
clean step (``growth_interval`` of them in a row multiply the scale by ``growth_factor``).
"""
from __future__ import annotations

import fnmatch

import torch
import torch.distributed as dist

from autopar.errors import UsageError
from autopar.runtime import devices, faults
from autopar.runtime.offload import HostCopies


class LossScaler:
    """Dynamic loss scale shared by the runner (scales the loss) and ``PlanOptimizer`` (unscales, decides)."""

    def __init__(self, policy):
        self.scale = float(policy.init_scale)
        self.policy = policy
        self.clean_steps = 0
        self.skipped = 0

    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Divide ``grads`` by the scale in place; True when any rank found an inf/NaN (a collective)."""
        found = torch.zeros(1, device=devices.wire_device())
        inv = 1.0 / self.scale
        for g in grads:
            g.mul_(inv)
            if not torch.isfinite(g).all():
                found.fill_(1.0)
        faults.guard("all_reduce", None, dist.all_reduce, found, op=dist.ReduceOp.MAX)
        return bool(found.item())

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.policy.backoff_factor
            self.clean_steps = 0
            self.skipped += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.policy.growth_interval:
            self.scale *= self.policy.growth_factor
            self.clean_steps = 0


class PlanOptimizer:
    """A torch optimizer over what this rank steps: every parameter outside ZeRO buckets, and the shard of
    each ZeRO bucket. ``step`` = [unscale + agree on overflow] + inner step + all-gather of the shards."""

    def __init__(self, runner, cls, **kwargs):
        self.runner = runner
        sync = runner.gradsync
        zeroed = {id(p) for b in sync.buckets if b.level >= 1 for p in b.params}
        self.targets = [p for p in runner.gm.parameters() if id(p) not in zeroed and p.requires_grad]
        self.targets += [b.shard for b in sync.buckets if b.level >= 1]
        self.host = HostCopies(self.targets) if getattr(runner, "offload_optimizer", False) else None
        self.inner = cls(self.host.masters if self.host else self.targets, **kwargs)
        self.inner._autopar_owned = True

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def step(self) -> bool:
        """One optimizer step; False when skipped because some rank's gradients overflowed (fp16)."""
        scaler = self.runner.scaler
        if scaler is not None:
            found = scaler.unscale_and_check([p.grad for p in self.targets if p.grad is not None])
            scaler.update(found)
            if found:
                return False
        self.runner.gradsync.units.absorb_all()
        if self.host:  # ZeRO-Offload: step the host copies (runtime.offload)
            self.host.pull_grads()
        self.inner.step()
        if self.host:
            self.host.push_params()
        self.runner.gradsync.gather_params()
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``: gradients set to None (or zeroed in place with
        ``set_to_none=False``), except those that are views of the sync buckets' flat buffers (parameters
        of level-0/1 buckets, and every ZeRO shard), which are zeroed in place: their buffers persist
        between steps whatever happens to the views, and the inner optimizer steps a shard only while it
        has a gradient. What a rank holds between steps is then ``cost_models.memory.held_state_bytes``."""
        if self.host:
            self.host.clear_grads()
        in_place = {id(b.shard) for b in self.runner.gradsync.buckets if b.level >= 1}
        in_place |= {id(p) for b in self.runner.gradsync.buckets if b.level <= 1 for p in b.params}
        for p in {id(p): p for p in (*self.targets, *self.runner.gm.parameters())}.values():
            if p.grad is None:
                continue
            if set_to_none and id(p) not in in_place:
                p.grad = None
            else:
                p.grad.zero_()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def mark_needs_builder(runner, reason: str) -> None:
    """Tag this rank's parameters so a raw optimizer over them raises at its first step (``check_raw``)."""
    for p in runner.gm.parameters():
        p._autopar_needs_builder = reason


def check_raw(optimizer, params) -> None:
    if getattr(optimizer, "_autopar_owned", False):
        return
    reason = next((getattr(p, "_autopar_needs_builder") for p in params if hasattr(p, "_autopar_needs_builder")), None)
    if reason:
        raise UsageError(f"this plan {reason}, which an optimizer over pm.parameters() cannot do; build it with "
                         f"pm.optimizer(torch.optim.AdamW, lr=...) (any torch optimizer class and its arguments)")


def named_groups(named: dict[str, torch.Tensor | None], param_groups: list[dict]) -> list[dict]:
    """Torch param groups from groups naming parameters by the model's names or globs.

    ``named``: {model parameter name: this rank's tensor, or None where another pipeline stage holds it};
    ``param_groups``: [{"params": [name or glob, ...], **settings}]. A name is matched against every name
    of the model (a pattern this rank holds nothing of is fine: another stage does); each parameter in at
    most one group; parameters no group names form a last group with the optimizer's defaults."""
    if isinstance(param_groups, dict) or not isinstance(param_groups, (list, tuple)):
        raise UsageError("param_groups must be a list of dicts, e.g. [{'params': ['*.bias', '*ln*'], "
                         "'weight_decay': 0.0}]")
    owner: dict[str, int] = {}
    groups = []
    for k, spec in enumerate(param_groups):
        if not isinstance(spec, dict) or "params" not in spec:
            raise UsageError(f"param_groups[{k}] must be a dict with a 'params' list of parameter names or globs")
        patterns = [spec["params"]] if isinstance(spec["params"], str) else list(spec["params"])
        chosen = []
        for pattern in patterns:
            if not isinstance(pattern, str):
                raise UsageError(f"param_groups[{k}]['params'] holds a {type(pattern).__name__}; name parameters "
                                 f"by the model's parameter names or globs (e.g. 'fc1.weight', '*.bias'): the "
                                 f"model's own tensors are never trained, pm.parameters() are this rank's shards")
            hits = [n for n in named if fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise UsageError(f"param_groups[{k}]: {pattern!r} matches no parameter of the model (names look "
                                 f"like {list(named)[:3]})")
            for name in hits:
                if owner.setdefault(name, k) != k:
                    raise UsageError(f"parameter {name!r} is named by param_groups[{owner[name]}] and [{k}]; "
                                     f"name each parameter in one group")
                chosen.append(name)
        groups.append({**spec, "params": _tensors(named, chosen)})
    rest = _tensors(named, [n for n in named if n not in owner])
    if rest:
        groups.append({"params": rest})
    return groups


def _tensors(named: dict, names: list[str]) -> list[torch.Tensor]:
    """This rank's distinct trainable tensors of ``names``, in order (a tied parameter appears once)."""
    out = {}
    for name in names:
        t = named[name]
        if t is not None and t.requires_grad:
            out.setdefault(id(t), t)
    return list(out.values())
