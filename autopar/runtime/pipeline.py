"""Pipelined runtime: each rank runs its stage's generated module over B microbatches, GPipe or 1F1B.

One ``train_step``:
  1. split every input along dim 0 into B microbatches (the planner checked they divide);
  2. run this stage's ops in the order ``autopar.ir.schedule.stage_order`` gives (the order the plan's
     picture shows): a forward receives the stage's inputs from earlier stages, runs the module, reduces
     the Partial axes of each value a later stage reads and sends each receiver the pieces of its shard
     this rank holds (shard to shard, ``transfer``); a backward receives the gradient pieces of what was
     sent (or starts from loss / B on the last stage), runs backward, and returns the gradients of what
     was received;
  3. the bucketed gradient sync starts during the last microbatch's backward (``gradsync.GradSync``), is
     waited on at the end of the step, then the tied-parameter sync runs (``gradsync.sync_shared``);
  4. the loss, the mean of the microbatch losses, goes from the last stage to every rank.

Gradients therefore accumulate over microbatches exactly as one big batch's would (for a loss that is a
mean over equal-size microbatches). Interleaved plans run several of these, one per model chunk, under
``interleaved.InterleavedRunner``. Why not torch.distributed.pipelining: its PipelineStage runs one stage
per rank group of equal size and sends whole tensors; autopar's stages live on submeshes of different
sizes and shapes, each intra-op sharded, with shard-to-shard transfers between them (``transfer``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.ir.schedule import BACKWARD, FORWARD, stage_order
from autopar.placement import parse_spec
from autopar.redistribute import redistribute_steps
from autopar.runtime import devices, faults, gradsync
from autopar.runtime.collectives import step_call
from autopar.runtime.groups import group_key
from autopar.runtime.spmd import StageModule
from autopar.runtime.transfer import Route, recv_backward, recv_forward, send_backward, send_forward


class PipelineRunner(StageModule):
    def __init__(self, gm, plan, stage, graph, coord, shared: dict[str, str], mesh_base: int = 0):
        super().__init__()
        self.gm, self.plan, self.stage, self.coord, self.shared = gm, plan, stage, coord, shared
        self.mesh_index = mesh_base + stage.index  # this stage's mesh id in the group registry
        self.me = dist.get_rank()
        self.last = stage.index == len(plan.stages) - 1
        routes = _routes(plan, graph)
        self.routes_in = [r for r in routes if r.dst.index == stage.index]
        self.routes_out = {v: [r for r in routes if r.src.index == stage.index and r.value == v] for v in stage.outputs}
        self.grads_needed = {r.value for r in self.routes_in if r.dtype.is_floating_point}
        self.mailbox: dict = {}  # pieces this rank sends to itself (``transfer``)

    # ---- steps ---------------------------------------------------------------------------------
    def train_step(self, inputs: tuple, loss_index: int) -> torch.Tensor:
        chunks = self.microbatches(inputs, self.plan.microbatches)
        pending, live, losses = [], {}, []
        S = len(self.plan.stages)
        held = gradsync.take_shared(self.gm, self.shared)
        self.gradsync.begin()
        for kind, mb in stage_order(self.plan.schedule, self.stage.index, S, self.plan.microbatches):
            if kind == FORWARD:
                live[mb] = self._forward(chunks[mb], mb, pending, loss_index)
                if self.last:
                    losses.append(live[mb][2].detach())
            elif kind == BACKWARD:
                self._backward(live.pop(mb), mb, pending)
        for work, _ in pending:
            work.wait()
        self.gradsync.finish()
        gradsync.sync_shared(self.gm, self.stage, self.shared, self.coord, self.mesh_index, held)
        return self._broadcast_loss(losses)

    def forward(self, inputs: tuple) -> tuple:
        """Forward of every microbatch (no gradients); the last stage's outputs, joined, on every rank."""
        chunks = self.microbatches(inputs, self.plan.microbatches)
        pending, outputs = [], []
        with torch.no_grad():
            for mb in range(self.plan.microbatches):
                outputs.append(self._forward(chunks[mb], mb, pending, None)[3])
        for work, _ in pending:
            work.wait()
        joined = [self.in_order(_join([o[i] for o in outputs])) for i in range(len(outputs[0]))] if self.last else None
        box = [joined]
        faults.guard("broadcast", None, dist.broadcast_object_list, box, src=self.plan.stages[-1].ranks[0])
        return tuple(box[0])

    # ---- one microbatch --------------------------------------------------------------------------
    def _forward(self, inputs, mb: int, pending: list, loss_index):
        received, values = [], []
        for route in sorted(self.routes_in, key=lambda r: r.value):
            t = recv_forward(route, mb, self.me, self.mailbox, devices.rank_device(self.device_type))
            if route.value in self.grads_needed and torch.is_grad_enabled():
                t.requires_grad_(True)
            received.append((route, t))
            values.append(self._redistribute(t, route.wire, route.dst_spec))
        outs = self.run_module(*inputs, *values)
        n_sent = len(self.stage.outputs)
        wholes = []
        for name, local in zip(self.stage.outputs, outs[:n_sent]):
            value = self._resolve(local, name)
            for route in self.routes_out[name]:
                send_forward(value.detach(), route, mb, self.me, pending, self.mailbox)
            wholes.append(value)
        results = list(outs[n_sent:])
        loss = results[loss_index] if self.last and loss_index is not None else None
        return received, wholes, loss, results

    def _backward(self, state, mb: int, pending: list) -> None:
        received, wholes, loss, _ = state
        if self.last:
            self.scaled(loss / self.plan.microbatches).backward()
        else:
            grads = [self._sent_grad(name, whole, mb) for name, whole in zip(self.stage.outputs, wholes)]
            pairs = [(w, g) for w, g in zip(wholes, grads) if w.requires_grad]
            if pairs:
                torch.autograd.backward([w for w, _ in pairs], [g for _, g in pairs])
        for route, t in received:
            if route.value in self.grads_needed:
                send_backward(t.grad, route, mb, self.me, pending, self.mailbox)

    def _resolve(self, local: torch.Tensor, name: str) -> torch.Tensor:
        """The value with its Partial axes reduced and its Replicate axes split (``shard_boxes.send_spec``),
        shards kept, differentiably: what the shard-to-shard transfer sends from (every route of a value
        sends from the same spec)."""
        src = parse_spec(self.stage.shardings[name].out)
        return self._redistribute(local, src, self.routes_out[name][0].src_spec)

    def _redistribute(self, value: torch.Tensor, src, dst) -> torch.Tensor:
        """``value`` from ``src`` to ``dst`` on this stage's mesh, differentiably (the collectives codegen
        emits): reduces a sent value's Partial axes, all-gathers a received one's wire slices."""
        for step in redistribute_steps(src, dst):
            fn, args = step_call(step, group_key(self.mesh_index, step.axis), value)
            value = fn(*args)
        return value

    def _sent_grad(self, name: str, value: torch.Tensor, mb: int) -> torch.Tensor | None:
        """The gradient of this rank's box of a sent value: every route's receivers return their pieces."""
        if not value.dtype.is_floating_point:
            return None
        grad = torch.zeros_like(value)
        for route in self.routes_out[name]:
            recv_backward(route, mb, self.me, grad, self.mailbox)
        return grad

    def _broadcast_loss(self, losses: list) -> torch.Tensor:
        wire = devices.wire_device()
        value = torch.stack(losses).mean() if self.last else torch.zeros((), dtype=torch.float32, device=wire)
        value = value.to(device=wire, dtype=torch.float32).clone()
        faults.guard("broadcast", None, dist.broadcast, value, src=self.plan.stages[-1].ranks[0])
        return value


def _routes(plan, graph) -> list[Route]:
    vals = {n.name: n.meta.get("val") for n in graph.gm.graph.nodes}
    owner = {name: s for s in plan.stages for name in s.shardings if name not in s.inputs}
    routes = []
    for stage in plan.stages:
        for value in sorted(stage.inputs):
            val = vals[value]
            routes.append(Route(len(routes), value, owner[value], stage, tuple(val.shape), val.dtype))
    return routes


def _join(values: list):
    first = values[0]
    if not isinstance(first, torch.Tensor):
        return first
    if first.dim() == 0:
        return torch.stack(values).mean()
    return torch.cat(values, dim=0)
