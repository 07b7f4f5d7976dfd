"""Interleaved 1F1B runtime: a device runs v model chunks (virtual stages), in Megatron-LM's order.

Each chunk is a ``PipelineRunner`` (its own generated module, process groups, gradient sync and
transfers); this runner owns them and steps through ``autopar.ir.schedule.device_order``: the k-th
forward of the device runs microbatch (k div pp·v)·pp + k mod pp on chunk (k mod pp·v) div pp, and
backwards run the chunks in reverse. Every op of a chunk follows that chunk's own microbatch order, so
each chunk's gradients accumulate over the m microbatches exactly as in 1F1B (the last chunk scales each
microbatch's loss by 1/m). Values a chunk sends to a later chunk on this same device go through the
shared ``mailbox`` (``transfer``), in the order the schedule runs them.

The gradient syncs of the chunks (``ChunkSyncs``) start and finish together around the step; the
optimizer (``runtime.optim``) sees the parameters of every chunk through ``gm``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.ir.schedule import FORWARD, device_order
from autopar.runtime import faults, gradsync
from autopar.runtime.pipeline import PipelineRunner, _join
from autopar.runtime.spmd import StageModule


class ChunkSyncs:
    """The gradient syncs of a device's chunks, driven as one (``gradsync.GradSync``'s interface)."""

    def __init__(self, syncs: list):
        self.syncs = syncs
        self.buckets = [b for s in syncs for b in s.buckets]
        self.units = ChunkUnits([s.units for s in syncs])

    def begin(self) -> None:
        for s in self.syncs:
            s.begin()

    def finish(self) -> None:
        for s in self.syncs:
            s.finish()

    def gather_params(self) -> None:
        for s in self.syncs:
            s.gather_params()


class ChunkUnits:
    """The ZeRO-3 units of a device's chunks (``zero3.Units``' interface that the optimizer step and
    ``state_dict`` use); each chunk's module runs under its own chunk's saved-tensor hooks."""

    def __init__(self, parts: list):
        self.parts = parts
        self.units = [u for part in parts for u in part.units]

    def free_all(self) -> None:
        for part in self.parts:
            part.free_all()

    def absorb_all(self) -> None:
        for part in self.parts:
            part.absorb_all()


class InterleavedRunner(StageModule):
    def __init__(self, chunks: list[PipelineRunner], plan):
        super().__init__()
        self.chunks = sorted(chunks, key=lambda c: c.stage.index)
        self.plan, self.stage, self.mesh_index = plan, self.chunks[0].stage, self.chunks[0].mesh_index
        self.gm = torch.nn.ModuleList([c.gm for c in self.chunks])  # every chunk's parameters, for the optimizer
        mailbox: dict = {}
        for c in self.chunks:
            c.mailbox = mailbox
        self.pp = len(plan.stages) // plan.virtual_stages
        self.by_stage = {c.stage.index: c for c in self.chunks}

    def setup(self, policy, device_type: str, gradsync_, scaler) -> None:
        """The chunks are set up one by one (``runtime.build``); this joins their syncs."""
        super().setup(policy, device_type, ChunkSyncs([c.gradsync for c in self.chunks]), scaler)

    def train_step(self, inputs: tuple, loss_index: int) -> torch.Tensor:
        m = self.plan.microbatches
        pieces = {c.stage.index: c.microbatches(inputs, m) for c in self.chunks}
        pending, losses, live = [], [], {}
        held = [gradsync.take_shared(c.gm, c.shared) for c in self.chunks]
        self.gradsync.begin()
        for kind, s, mb in device_order(self.stage.index, self.pp, self.plan.virtual_stages, m):
            chunk = self.by_stage[s]
            if kind == FORWARD:
                live[s, mb] = chunk._forward(pieces[s][mb], mb, pending, loss_index)
                if chunk.last:
                    losses.append(live[s, mb][2].detach())
            else:
                chunk._backward(live.pop((s, mb)), mb, pending)
        for work, _ in pending:
            work.wait()
        self.gradsync.finish()
        for c, kept in zip(self.chunks, held):
            gradsync.sync_shared(c.gm, c.stage, c.shared, c.coord, c.mesh_index, kept)
        return self._last_or_first()._broadcast_loss(losses)

    def forward(self, inputs: tuple) -> tuple:
        """Forward of every microbatch, chunk by chunk (no gradients); the last chunk's outputs on every rank."""
        pieces = {c.stage.index: c.microbatches(inputs, self.plan.microbatches) for c in self.chunks}
        pending, outputs = [], []
        with torch.no_grad():
            for mb in range(self.plan.microbatches):
                for c in self.chunks:
                    results = c._forward(pieces[c.stage.index][mb], mb, pending, None)[3]
                    if c.last:
                        outputs.append(results)
        for work, _ in pending:
            work.wait()
        joined = [self.chunks[0].in_order(_join([o[i] for o in outputs])) for i in range(len(outputs[0]))] \
            if outputs else None
        box = [joined]
        faults.guard("broadcast", None, dist.broadcast_object_list, box, src=self.plan.stages[-1].ranks[0])
        return tuple(box[0])

    def _last_or_first(self) -> PipelineRunner:
        return next((c for c in self.chunks if c.last), self.chunks[0])

    # ---- what ParallelModule and checkpoints ask of a runner ----------------------------------------
    def holds(self, stage_index: int) -> bool:
        return stage_index in self.by_stage

    def local_state(self, name: str):
        """(this rank's shard, its spec text, mesh index) from the first chunk that holds ``name``."""
        for c in self.chunks:
            local = c.local_state(name)
            if local[0] is not None:
                return local
        return None, None, None

    @property
    def code(self) -> str:
        return "\n".join(f"# ---- model chunk: stage {c.stage.index}\n{c.gm.code}" for c in self.chunks)
