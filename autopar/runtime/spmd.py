"""Single-stage runtime: every rank runs its generated module on its shards (SPMD); no pipelining.

Gradient synchronization needs no separate step: the generated graph already carries it (a replicated
parameter read by a sharded op goes through ``identity_fwd_all_reduce_bwd``), so gradients are complete
when ``backward`` returns.
"""
from __future__ import annotations

import torch
import torch.fx as fx


class SpmdRunner(torch.nn.Module):
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
        return loss.detach()

    @property
    def code(self) -> str:
        return self.gm.code

    def local_state(self, name: str):
        """(this rank's shard, its spec text, mesh index) of a parameter/buffer placeholder."""
        if name not in self.stage.shardings or not hasattr(self.gm, name):
            return None, None, None
        return getattr(self.gm, name), self.stage.shardings[name].out, self.mesh_index

    def remote_state(self, have: dict) -> dict:
        return {}
