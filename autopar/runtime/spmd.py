"""Single-stage runtime: every rank runs its generated module on its shards (SPMD); no pipelining.

Gradient synchronization: a replicated parameter read by a sharded op needs its gradient all-reduced.
Where every read of a parameter needs only that, the all-reduce is deferred to after ``backward`` and
bucketed (``gradsync.reduce_deferred``); elsewhere the generated graph carries it
(``identity_fwd_all_reduce_bwd``).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.runtime import gradsync


class StageModule(torch.nn.Module):
    """What both runners share: ``gm`` (this rank's generated module), ``stage`` (its plan stage) and
    ``mesh_index`` (its mesh in the group registry), set by the subclass."""

    gm: fx.GraphModule

    @property
    def code(self) -> str:
        return self.gm.code

    def local_state(self, name: str):
        """(this rank's shard, its spec text, mesh index) of a parameter/buffer placeholder."""
        if name not in self.stage.shardings or not hasattr(self.gm, name):
            return None, None, None
        return getattr(self.gm, name), self.stage.shardings[name].out, self.mesh_index


class SpmdRunner(StageModule):
    def __init__(self, gm: fx.GraphModule, stage, mesh_index: int = 0):
        super().__init__()
        self.gm = gm
        self.stage = stage
        self.mesh_index = mesh_index

    def forward(self, inputs: tuple) -> tuple:
        return tuple(self.gm(*inputs))

    def train_step(self, inputs: tuple, loss_index: int) -> torch.Tensor:
        loss = self.gm(*inputs)[loss_index]
        loss.backward()
        gradsync.reduce_deferred(self.gm, self.mesh_index)
        return loss.detach()
