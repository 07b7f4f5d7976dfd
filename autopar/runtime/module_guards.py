"""The ways of calling a ``ParallelModule`` that plain ``nn.Module`` allows but a plan cannot honour, each
turned into one clear error (or, for keyword inputs, handled).

Invariants:
  * the dtype and device of every tensor of a ParallelModule are the plan's (its master weights and
    buffers, on the cluster's device type): ``.to``/``.half``/``.cuda``/... that would change one raise
    ``UsageError`` and change nothing; the same call that changes nothing returns the module, as torch does;
  * inputs may be given by keyword (forward's argument names, as captured), and are bound to the positions
    the plan was made for; an unknown, repeated or missing name is an ``InputError`` listing the names;
  * ``train_step`` runs backward, so it refuses to run where autograd is off (``no_grad``,
    ``inference_mode``) rather than fail inside backward;
  * ``load_state_dict`` of the original model's keys (a full ``model.state_dict()``) is refused with the
    ways that do load one (the module's own ``state_dict`` holds this rank's shards).
"""
from __future__ import annotations

import torch

from autopar.errors import InputError, UsageError

_FIX_PRECISION = ("a ParallelModule's weights are fp32 master weights on the cluster's devices, fixed by its plan; "
                  "for bf16/fp16 compute use autopar.compile(..., precision='bf16' or 'fp16') (autocast, fp32 "
                  "master weights)")


def bind_inputs(names: list[str], args: tuple, kwargs: dict, call: str, missing_ok: bool = False) -> tuple:
    """``args`` and ``kwargs`` as the positional inputs ``names`` (forward's captured argument names).
    ``missing_ok`` (data="local", where a rank passes only the inputs its stages read): None for the rest."""
    if not kwargs:
        return args
    unknown = [k for k in kwargs if k not in names]
    twice = [k for k in kwargs if k in names[:len(args)]]
    if unknown or twice:
        what = f"unknown input name(s) {unknown}" if unknown else f"input(s) {twice} given both by position and by name"
        raise InputError(f"{call}: {what}; the plan's inputs are {names} (forward's arguments, in order)")
    bound = list(args) + [kwargs.get(name, _MISSING) for name in names[len(args):]]
    missing = [name for name, value in zip(names, bound) if value is _MISSING]
    if missing_ok:
        return tuple(None if value is _MISSING else value for value in bound)
    if missing:
        raise InputError(f"{call}: input(s) {missing} missing; the plan was made for inputs {names}, pass every "
                         f"one (by position or by name)")
    return tuple(bound)


_MISSING = object()


def check_autograd_on(call: str) -> None:
    if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
        where = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
        raise UsageError(f"{call} runs backward, which cannot run under {where}; call it outside that block, or "
                         f"call pm(*inputs) there for forward only (e.g. evaluation)")


class FixedPlacement:
    """Mixin of ``ParallelModule``: the nn.Module methods that move or cast every tensor (see the module
    docstring). Each returns ``self`` when it would change nothing."""

    def _placement(self) -> tuple[torch.device, torch.dtype]:
        """The device and floating dtype of this rank's parameters (or buffers)."""
        tensors = [t for t in list(self.parameters()) + list(self.buffers()) if t.is_floating_point()]
        if not tensors:
            return torch.device(self.plan.cluster.get("device_type", "cpu")), torch.float32
        return tensors[0].device, tensors[0].dtype

    def _refuse_change(self, call: str, device=None, dtype=None):
        here, kind = self._placement()
        if device is not None:
            device = torch.device(device)
            if device.type != here.type or (device.index is not None and device.index != here.index):
                raise UsageError(f"pm.{call}: this module lives on {here}, fixed by its plan; it cannot move to "
                                 f"{device}. Move the inputs instead (every rank passes its batch on {here.type}), "
                                 f"or compile for a cluster of {device.type} devices")
        if dtype is not None and dtype != kind:
            raise UsageError(f"pm.{call}: casting the module to {dtype} is not supported: {_FIX_PRECISION}")
        return self

    def to(self, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        return self._refuse_change("to(...)", device, dtype)

    def half(self):
        return self._refuse_change("half()", dtype=torch.float16)

    def bfloat16(self):
        return self._refuse_change("bfloat16()", dtype=torch.bfloat16)

    def double(self):
        return self._refuse_change("double()", dtype=torch.float64)

    def float(self):
        return self._refuse_change("float()", dtype=torch.float32)

    def cuda(self, device=None):
        return self._refuse_change("cuda()", device=torch.device("cuda", device) if isinstance(device, int)
                                   else device or "cuda")

    def cpu(self):
        return self._refuse_change("cpu()", device="cpu")

    def type(self, dst_type):
        raise UsageError(f"pm.type({dst_type!r}) is not supported: {_FIX_PRECISION}")

    def to_empty(self, *, device, recurse=True):
        raise UsageError(f"pm.to_empty(device={device!r}) would discard the trained weights; it is not supported")

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        own = set(torch.nn.Module.state_dict(self))
        if hasattr(state_dict, "keys") and state_dict and not set(state_dict) & own \
                and set(state_dict) <= set(self._state_keys):
            raise UsageError("pm.load_state_dict got the original model's keys (a full model.state_dict()), but a "
                             "ParallelModule's state_dict holds this rank's shards; to start from full weights, load "
                             "them into the model before autopar.compile; to resume, use pm.save(path) / "
                             "pm.load(path) (any plan, any world size)")
        return torch.nn.Module.load_state_dict(self, state_dict, strict, assign)
