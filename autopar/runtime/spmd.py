"""Single-stage runtime: every rank runs its generated module on its shards (SPMD); no pipelining.

Gradient synchronization: a replicated parameter read by a sharded op needs its gradient all-reduced.
Where every read of a parameter needs only that, the all-reduce is bucketed and started while backward
runs (``gradsync.GradSync``); elsewhere the generated graph carries it (``identity_fwd_all_reduce_bwd``).

Precision: every call of the generated module runs under the policy's autocast (``autopar.ir.precision``);
with loss scaling the loss is multiplied by ``scaler.scale`` before backward (``runtime.optim``).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.runtime import gradsync
from autopar.runtime.offload import saved_on_host


class StageModule(torch.nn.Module):
    """What both runners share: ``gm`` (this rank's generated module), ``stage`` (its plan stage) and
    ``mesh_index`` (its mesh in the group registry), set by the subclass; ``setup`` adds the precision
    policy, the loss scaler and the gradient sync."""

    gm: fx.GraphModule
    compiled = None  # ``runtime.compiled.CompiledModule`` of ``gm`` under compile=True, else None
    local_data = None  # ``local_data.LocalData`` under data="local": this rank passes its share only
    offload_optimizer = offload_activations = False  # CPU offload of this stage (``runtime.offload``)

    def setup(self, policy, device_type: str, gradsync_: "gradsync.GradSync", scaler) -> None:
        self.policy, self.device_type, self.gradsync, self.scaler = policy, device_type, gradsync_, scaler

    def run_module(self, *args):
        """One call of the generated module, under the precision policy's autocast and ZeRO-3's saved-tensor
        hooks (``runtime.zero3``), activations saved on the host under activation offload (``runtime.offload``);
        compiled (``runtime.compiled``) when the module was built with compile on."""
        with saved_on_host(self.offload_activations, self.device_type), self.policy.autocast(self.device_type), \
                self.gradsync.units.hooks():
            return (self.compiled or self.gm)(*args)

    def microbatches(self, inputs: tuple, count: int) -> list[tuple]:
        """The inputs of each of ``count`` microbatches for this stage: chunks of the global batch along dim 0,
        or under data="local" this rank's blocks of its share (``local_data``)."""
        if self.local_data is not None:
            return self.local_data.microbatches(inputs, self.stage.index)
        if count == 1:
            return [tuple(inputs)]
        pieces = [t.chunk(count, dim=0) for t in inputs]
        return [tuple(p[i] for p in pieces) for i in range(count)]

    def in_order(self, value):
        """A joined output with its rows in global order (``local_data.restore_order``)."""
        return value if self.local_data is None else self.local_data.restore_order(value)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else loss * self.scaler.scale

    @property
    def code(self) -> str:
        return self.gm.code

    def holds(self, stage_index: int) -> bool:
        """Whether this rank runs stage ``stage_index`` (an interleaved runner holds several)."""
        return self.stage.index == stage_index

    def local_state(self, name: str):
        """(this rank's shard, its spec text, mesh index) of a parameter/buffer placeholder. A ZeRO-3
        parameter is gathered first (a collective of its data-parallel group; writes to it are kept)."""
        if name not in self.stage.shardings or not hasattr(self.gm, name):
            return None, None, None
        unit = self.gradsync.units.of_param.get(name)
        if unit is not None:
            unit.materialize()
        return getattr(self.gm, name), self.stage.shardings[name].out, self.mesh_index


class SpmdRunner(StageModule):
    def __init__(self, gm: fx.GraphModule, stage, mesh_index: int = 0):
        super().__init__()
        self.gm = gm
        self.stage = stage
        self.mesh_index = mesh_index

    def forward(self, inputs: tuple) -> tuple:
        return tuple(self.run_module(*self.microbatches(inputs, 1)[0]))

    def train_step(self, inputs: tuple, loss_index: int) -> torch.Tensor:
        loss = self.run_module(*self.microbatches(inputs, 1)[0])[loss_index]
        self.gradsync.begin()
        self.scaled(loss).backward()
        self.gradsync.finish()
        return loss.detach().float()
