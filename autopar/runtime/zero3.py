"""ZeRO-3: parameters sharded between uses (FSDP's scheme), over the data-parallel group of a sync bucket.

A unit is one level-3 gradient-sync bucket (``ir.buckets.sync_buckets``: consecutive parameters of one
stage synced over the same mesh axes, at most ``bucket_bytes``; FSDP's unit is a module's parameters). Each
rank keeps only its 1/n shard of the unit's flat, padded buffer (the optimizer steps it, in fp32: it is the
master copy). The generated module's parameters keep their shapes and stay views of the flat master buffer,
whose storage is resized to zero bytes between uses (as FSDP1's FlatParameter), so at rest a rank holds:

    parameters: padded / n elements per unit      gradients: padded / n (as ZeRO-2)      state: on the shard

Gather dtype. Under a precision policy with a compute dtype (bf16, fp16: FSDP2's ``param_dtype``) the
all-gather moves the shard cast to that dtype, into a second flat buffer of that dtype, and the generated
ops read leaf tensors that are views of it (``Unit.leaves``, read through ``ComputeRead`` nodes in place of
the parameters' get_attr): half the bytes on the wire and gathered. Numerics are FSDP2's, not autocast's
over fp32 weights: an op autocast keeps in fp32 (layer_norm, the losses) sees the rounded weight upcast,
and an op outside autocast's lists (embedding, a bias add) computes in the compute dtype. A leaf's gradient
(compute dtype, one microbatch) is added into its fp32 parameter's ``.grad`` by a post-accumulate-grad
hook, so microbatches accumulate in fp32 and gradients are reduce-scattered in the policy's reduce dtype
into the fp32 shard, as at level 2. The fp32 master buffer is gathered only for readers outside training
(``materialize``: state dicts, checkpoints). Without a compute dtype both buffers are one.

  * forward: a ``gather`` node waits for the unit's all-gather (issuing it first when it was not
    prefetched) before the first op that reads any of its parameters, a ``free`` node follows the last;
    a ``prefetch`` node issues the next unit's all-gather (``async_op=True``) at the point
    ``ir.buckets.prefetch_spans`` gives: the previous unit's first read, or later, so that at most two
    units are gathered or in flight at once (the ILP's memory row reserves two);
  * backward: an op that saved a parameter (or a view of one) for backward holds it through a saved-tensor
    hook (``torch.autograd.graph.saved_tensors_hooks``, active while the generated module runs); unpacking
    it gathers the unit again when it is freed, and then issues the all-gather of the unit whose backward
    comes next (``backward_order``: the reverse order of last forward reads) if at most one other unit is
    gathered and the bytes stay within the forward's peak (``cap``, what the plan charges); else when a
    unit is freed. Once every parameter of the unit has accumulated this microbatch's gradient
    (post-accumulate-grad hook) no backward op reads it any more, and it is freed;
  * gradients: reduce-scattered once per step by ``gradsync.Bucket`` exactly as at level 2;
  * recompute: the body of a checkpointed region that reads a unit starts with an ``ensure`` node (nothing
    in forward, where the unit is gathered; a gather when backward replays the region, which then holds
    all its units at once as its forward call did: no prefetch beyond them, which would add to that);
  * after the optimizer step the units are left freed (the next forward gathers the updated shards);
  * at rest (freed, with no backward to come) each parameter is a 1-D view of its piece of this rank's shard
    (empty where the shard holds none of it), as FSDP1's original parameters are: ``pm.parameters()`` read
    or written between steps reach this rank's share, never the freed buffer (which has no bytes: a read
    of it crashed the process); gathering points them back at the buffer, with their shapes.
Every issue and every wait is a collective of the unit's group under ``faults.guard`` (its timeout); a unit
is never released while its all-gather is in flight. The graph rewrite is ``runtime.zero3_graph``.

Why not torch's FSDP2 (``fully_shard``): it makes nn.Module parameters DTensors and hooks the forward of
submodules; the generated per-rank module is one fx GraphModule of plain aten calls on local (already
tensor-parallel) shards, without submodules to wrap, and DTensor parameters would send every generated op
through DTensor dispatch with placements the plan did not choose. Re-using gradsync's buckets also keeps
the planner's prediction (``held_state_bytes``) and the runtime on one layout.
"""
from __future__ import annotations

import contextlib
import datetime

import torch
import torch.fx as fx

from autopar.runtime import faults
from autopar.runtime.flat_collectives import all_gather_flat
from autopar.runtime.zero3_graph import insert_unit_calls


class _Flat:
    """A flat buffer whose storage is allocated only while it holds the unit."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.nbytes, self.held = tensor, tensor.untyped_storage().nbytes(), True

    def allocate(self) -> None:
        self.tensor.untyped_storage().resize_(self.nbytes)
        self.held = True

    def release(self) -> None:
        self.tensor.untyped_storage().resize_(0)
        self.held = False


class Unit:
    """The gathered/freed state of one level-3 bucket's flat parameter buffer(s) (see module docstring)."""

    def __init__(self, bucket, registry: "Units", index: int, dtype: torch.dtype | None):
        self.bucket, self.registry, self.index = bucket, registry, index
        self.master = _Flat(bucket.param_flat)
        same = dtype is None or dtype == bucket.param_flat.dtype
        self.flat = self.master if same else _Flat(torch.empty(bucket.padded, dtype=dtype, device=bucket.device))
        self.leaves = list(bucket.params) if same else self._compute_leaves()
        self.work = self.sent = None  # the all-gather in flight, and the tensor it sends
        self.dirty = False  # the master buffer may have been written outside a step (``materialize``)
        self.backward_seen = self.pending_backward = 0
        self.gathers = 0  # all-gathers issued
        self.whole = [p.data for p in bucket.params]  # views of the master buffer, whose storage comes and goes
        registry.note(self.master.nbytes + (0 if same else self.flat.nbytes))
        self.free()  # built gathered (gradsync filled the master buffer): free it at once

    def _compute_leaves(self) -> list[torch.Tensor]:
        """Leaf tensors of the compute dtype, views of ``flat``: what the generated ops read. A leaf's
        gradient goes into its fp32 parameter's ``.grad`` (fp32 accumulation over microbatches)."""
        leaves = []
        for p, a, b in self.bucket.offsets():
            leaf = torch.nn.Parameter(self.flat.tensor[a:b].view_as(p), requires_grad=p.requires_grad)
            leaf.register_post_accumulate_grad_hook(lambda t, p=p: _into_master_grad(t, p))
            leaves.append(leaf)
        return leaves

    @property
    def ready(self) -> bool:
        return self.flat.held and self.work is None

    def prefetch(self) -> None:
        """Issue the all-gather ahead of the unit's use (``prefetch`` nodes, the backward prefetch)."""
        self._issue()

    def _issue(self) -> None:
        """Issue the all-gather of this rank's shard, cast to the gather dtype, into the flat buffer; returns
        at once (``wait`` completes it). Nothing when the unit is gathered or in flight already."""
        if self.flat.held:
            return
        self.absorb()
        self.flat.allocate()
        self._point_params(whole=True)
        self.sent = self.bucket.shard.detach().to(self.flat.tensor.dtype)
        self.work = faults.guard("all_gather", self.bucket.key, all_gather_flat, self.flat.tensor, self.sent,
                                 group=self.bucket.group, async_op=True)
        self.gathers += 1
        self.registry.by_storage[self.flat.tensor.untyped_storage().data_ptr()] = self
        self.registry.note(self.flat.nbytes)

    def wait(self) -> None:
        """Complete the all-gather in flight, if any, under the group's timeout."""
        if self.work is None:
            return
        work, self.work = self.work, None
        faults.guard("wait", self.bucket.key, work.wait, self.registry.timeout)
        self.sent = None

    def gather(self) -> bool:
        """The flat buffer holds the whole unit when this returns; True when its all-gather had been issued
        before (prefetched), False when it was issued here or was not needed."""
        if self.ready:
            return False
        prefetched = self.flat.held
        self._issue()
        self.wait()
        return prefetched

    def free(self) -> None:
        """Keep only the shard: wait for a gather in flight, fold in writes made to the master buffer, then
        release the storage."""
        self.wait()
        self.absorb()
        if self.flat.held:
            self.registry.by_storage.pop(self.flat.tensor.untyped_storage().data_ptr(), None)
            self.flat.release()
            self.registry.note(-self.flat.nbytes)
        if self.master.held:  # a separate fp32 master, gathered for a reader outside training
            self.master.release()
            self.registry.note(-self.master.nbytes)
        self.backward_seen = 0
        if self.pending_backward <= 0:  # no backward of a forward already run reads the parameters
            self._point_params(whole=False)
        self.registry.released()

    def _point_params(self, whole: bool) -> None:
        """Point the parameters at the master buffer (``whole``: their own shapes, for the generated ops and
        readers that gathered it) or, at rest, at their pieces of this rank's shard (1-D, empty where the
        shard holds none of a parameter): reading ``pm.parameters()`` between steps then reads this rank's
        share of each, and an in-place write to one writes the shard, as FSDP's original parameters do;
        never the freed buffer, which has no bytes."""
        bucket = self.bucket
        shard = bucket.shard.detach()
        for (p, a, b), view in zip(bucket.offsets(), self.whole):
            if whole:
                p.data = view
            else:
                lo, hi = max(a, bucket.lo), min(b, bucket.hi)
                p.data = shard[lo - bucket.lo:hi - bucket.lo] if lo < hi else shard[:0]

    def absorb(self) -> None:
        """After ``materialize`` (a checkpoint load writes the full buffer): copy this rank's slice into the shard."""
        if self.dirty and self.master.held:
            with torch.no_grad():
                self.bucket.shard.copy_(self.master.tensor[self.bucket.lo:self.bucket.hi])
        self.dirty = False

    def materialize(self, writes: bool = True) -> None:
        """Gather the fp32 master buffer for a reader outside ``train_step`` (state dicts, checkpoints), which
        may also write it (``writes``: fold the writes into the shard at the next use or free)."""
        self._point_params(whole=True)
        if self.master is self.flat:
            self.gather()
        elif not self.master.held:
            self.master.allocate()
            self.registry.note(self.master.nbytes)
            faults.guard("all_gather", self.bucket.key, all_gather_flat, self.master.tensor, self.bucket.shard.detach(),
                         group=self.bucket.group)
        self.dirty = self.dirty or writes

    def accumulated(self) -> None:
        """One parameter's gradient of this microbatch is in; free when all are (no backward op reads it after)."""
        self.backward_seen += 1
        if self.backward_seen >= len(self.bucket.params):
            self.pending_backward = max(0, self.pending_backward - 1)
            self.free()


def _into_master_grad(leaf: torch.Tensor, param: torch.Tensor) -> None:
    """A compute-dtype leaf's gradient of one microbatch, added into the fp32 parameter's ``.grad``."""
    grad, leaf.grad = leaf.grad, None
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


class Units:
    """Every unit of one stage module, the graph rewrite that drives them, the saved-tensor hooks, and the
    backward prefetch (see module docstring). ``dtype``: the gather dtype (None: the parameters' own)."""

    def __init__(self, gm: fx.GraphModule, buckets: list, dtype: torch.dtype | None = None, timeout=None):
        self.by_storage: dict[int, Unit] = {}
        self.gathered_bytes = self.peak_bytes = 0  # bytes of units gathered now / at most since reset
        self.timeout = timeout or datetime.timedelta(seconds=300)
        self.deferred: Unit | None = None  # the backward prefetch waiting for room
        self.prefetched = {"forward": 0, "backward": 0}  # uses whose all-gather was issued ahead
        self.units = [Unit(b, self, k, dtype) for k, b in enumerate(b for b in buckets if b.level == 3)]
        self.peak_bytes = 0
        self.of_param = {name: u for u in self.units for name in u.bucket.names}
        for unit in self.units:
            for leaf in unit.leaves:
                leaf.register_post_accumulate_grad_hook(lambda _, u=unit: u.accumulated())
        self.backward_order, self.cap = list(self.units), 0.0
        if self.units:
            order, self.cap = insert_unit_calls(gm, self)
            self.backward_order = [self.units[k] for k in order]
        self.after = {u.index: v for u, v in zip(self.backward_order, self.backward_order[1:])}

    def note(self, delta: int) -> None:
        self.gathered_bytes += delta
        self.peak_bytes = max(self.peak_bytes, self.gathered_bytes)

    def leaves_of(self, bucket) -> list[torch.Tensor]:
        """The tensors whose gradients a bucket's hooks count: a compute-dtype unit's leaves, else its parameters."""
        unit = self.of_param.get(bucket.names[0])
        return unit.leaves if unit is not None and unit.bucket is bucket else list(bucket.params)

    def forward_use(self, unit: Unit) -> None:
        """A ``gather`` node: the forward reads ``unit`` next; a backward prefetch still waiting is dropped."""
        self.deferred = None
        if torch.is_grad_enabled():
            unit.pending_backward += 1
        self.prefetched["forward"] += unit.gather()

    def backward_use(self, unit: Unit, prefetch_next: bool = True) -> None:
        """Backward needs ``unit`` (a saved weight unpacked, a recomputed region replayed): gather it, then
        (``prefetch_next``) prefetch the unit whose backward comes next."""
        if unit.ready:
            return
        self.prefetched["backward"] += unit.gather()
        if not prefetch_next:
            return
        successor = self.after.get(unit.index)
        while successor is not None and successor.pending_backward <= 0:
            successor = self.after.get(successor.index)
        if successor is not None and not successor.flat.held:
            self.deferred = successor
            self.released()

    def released(self) -> None:
        """Issue the deferred backward prefetch if it fits: at most two units held, within ``cap`` bytes."""
        unit = self.deferred
        if unit is None or unit.flat.held or unit.pending_backward <= 0:
            self.deferred = None
            return
        held = sum(1 for u in self.units if u.flat.held)
        if held <= 1 and self.gathered_bytes + unit.flat.nbytes <= self.cap:
            self.deferred = None
            unit.prefetch()

    def hooks(self):
        """The saved-tensor hooks the generated module runs under (see module docstring); none without units."""
        if not self.units:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor):
        if self.by_storage and t.layout == torch.strided:
            unit = self.by_storage.get(t.untyped_storage().data_ptr())
            if unit is not None:
                return _Held(unit, t)
        return t

    def free_all(self) -> None:
        """End of a step: nothing is pending; every unit (and any gather in flight) is released."""
        self.deferred = None
        for unit in self.units:
            unit.pending_backward = 0
            unit.free()

    def absorb_all(self) -> None:
        for unit in self.units:
            unit.absorb()


class _Held:
    """A saved parameter (or view of one) of a unit: the tensor whose storage is gathered on unpack."""

    __slots__ = ("unit", "tensor")

    def __init__(self, unit: Unit, tensor: torch.Tensor):
        self.unit, self.tensor = unit, tensor


def _unpack(packed):
    if isinstance(packed, _Held):
        packed.unit.registry.backward_use(packed.unit)
        return packed.tensor
    return packed
