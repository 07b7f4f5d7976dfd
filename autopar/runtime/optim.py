"""fp16's dynamic loss scaling, and ``pm.optimizer``'s param groups by the model's parameter names.

Any torch optimizer over ``pm.parameters()`` steps what this rank owns under every plan (ZeRO shards, fp16
unscaling and skipped steps: ``runtime.plain_optim``); ``pm.optimizer(cls, param_groups=..., **kw)`` builds
one, with param groups named by the model's parameter names or globs (``named_groups``).

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
from autopar.runtime import faults


class LossScaler:
    """Dynamic loss scale shared by the runner (scales the loss) and the optimizer step hooks
    (``plain_optim``: unscale, decide)."""

    def __init__(self, policy):
        self.scale = float(policy.init_scale)
        self.policy = policy
        self.clean_steps = 0
        self.skipped = 0

    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Divide ``grads`` by the scale in place; True when any rank found an inf/NaN (a collective)."""
        found = torch.zeros(1)
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
