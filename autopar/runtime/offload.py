"""CPU offload at run time: what ``plan.planner["offload"]`` moves to host memory for a stage.

Optimizer (ZeRO-Offload): ``HostCopies`` keeps an fp32 master copy of every tensor the optimizer steps in
host memory; the optimizer is built over those copies, so its state lives on the host too. A step copies
the gradients out (fp32), steps on the host, and copies the updated values back into the device tensors.
On CPU ranks the "host" copies are separate tensors in the same memory: the same path runs, and in fp32 it
computes exactly what a step on the tensors themselves computes.

Activations: the stage's forward runs under ``torch.autograd.graph.save_on_cpu`` (PyTorch's saved-tensor
hooks: each tensor saved for backward is copied to host memory when saved and back when backward unpacks
it; pinned host memory on GPUs, so the copies can overlap compute). Under ZeRO-3's own saved-tensor hooks
(entered inside it) those take precedence: the gathered units are not offloaded.
"""
from __future__ import annotations

import contextlib

import torch


def offloaded(plan, stage_index: int) -> dict[str, bool]:
    """{"optimizer": bool, "activations": bool} for ``stage_index`` of ``plan``."""
    chosen = plan.planner.get("offload") or {}
    return {kind: stage_index in chosen.get(kind, ()) for kind in ("optimizer", "activations")}


def saved_on_host(active: bool, device_type: str):
    """The context a forward runs in: ``save_on_cpu`` (pinned on GPUs) when ``active``, else nothing."""
    if not active:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device_type == "cuda")


class HostCopies:
    """fp32 host copies of ``targets`` that an optimizer steps in their place (module docstring)."""

    def __init__(self, targets: list[torch.Tensor]):
        self.targets = targets
        self.masters = [t.detach().to("cpu", torch.float32, copy=True) for t in targets]

    def pull_grads(self) -> None:
        """Each master's gradient: its device tensor's, in fp32 on the host (None where it has none)."""
        for t, m in zip(self.targets, self.masters):
            m.grad = None if t.grad is None else t.grad.detach().to("cpu", torch.float32, copy=True)

    @torch.no_grad()
    def push_params(self) -> None:
        """The stepped masters back into the device tensors (cast to their dtype)."""
        for t, m in zip(self.targets, self.masters):
            t.copy_(m.to(t.device, t.dtype))

    def clear_grads(self) -> None:
        for m in self.masters:
            m.grad = None
