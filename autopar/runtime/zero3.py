"""ZeRO-3: parameters sharded between uses (FSDP's scheme), over the data-parallel group of a sync bucket.

A unit is one level-3 gradient-sync bucket (``ir.buckets.sync_buckets``: consecutive parameters of one
stage synced over the same mesh axes, at most ``bucket_bytes``; FSDP's unit is a module's parameters). Each
rank keeps only its 1/n shard of the unit's flat, padded buffer (the optimizer steps it, in fp32: it is the
master copy). The generated module's parameters keep their shapes and stay views of the flat buffer, whose
storage is resized to zero bytes between uses (as FSDP1's FlatParameter), so at rest a rank holds:

    parameters: padded / n elements per unit      gradients: padded / n (as ZeRO-2)      state: on the shard

  * forward: a ``gather`` node (all-gather of the shards into the flat buffer) runs before the first op
    that reads any of the unit's parameters, a ``free`` node after the last one; both are inserted into
    the generated graph, so every microbatch's forward gathers;
  * backward: an op that saved a parameter (or a view of one) for backward holds it through a saved-tensor
    hook (``torch.autograd.graph.saved_tensors_hooks``, active while the generated module runs); unpacking
    gathers the unit again when it is freed. Once every parameter of the unit has accumulated this
    microbatch's gradient (post-accumulate-grad hook) no backward op reads it any more, and it is freed;
  * gradients: reduce-scattered once per step by ``gradsync.Bucket`` exactly as at level 2;
  * recompute: the body of a checkpointed region that reads a unit starts with an ``ensure`` node (nothing
    in forward, where the unit is gathered; a gather when backward replays the region);
  * after the optimizer step the units are left freed (the next forward gathers the updated shards).
At most one unit is gathered at a time per op in forward (no prefetch); transiently, between a unit's
first and last forward use, and in backward until its gradients are in. Every gather is a collective of
the unit's group under ``faults.guard`` (its group's timeout).

Why not torch's FSDP2 (``fully_shard``): it makes nn.Module parameters DTensors and hooks the forward of
submodules; the generated per-rank module is one fx GraphModule of plain aten calls on local (already
tensor-parallel) shards, without submodules to wrap, and DTensor parameters would send every generated op
through DTensor dispatch with placements the plan did not choose. Re-using gradsync's buckets also keeps
the planner's prediction (``held_state_bytes``) and the runtime on one layout.
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx

from autopar.ir.buckets import parameter_sources, unit_spans
from autopar.runtime import faults

_ALL_GATHER = getattr(torch.distributed, "all_gather_single", torch.distributed.all_gather_into_tensor)


class Unit:
    """The gathered/freed state of one level-3 bucket's flat parameter buffer (see module docstring)."""

    def __init__(self, bucket, registry: "Units"):
        self.bucket, self.registry = bucket, registry
        self.nbytes = bucket.param_flat.untyped_storage().nbytes()
        self.gathered = True
        self.dirty = False  # the full buffer may have been written outside a step (``materialize``)
        self.backward_seen = 0
        self.gathers = 0
        registry.note(self.nbytes)  # built gathered (gradsync filled the flat buffer): free it at once
        self.free()

    def gather(self) -> None:
        """All-gather the shards into the flat buffer, unless it is gathered already."""
        if self.gathered:
            return
        flat = self.bucket.param_flat
        flat.untyped_storage().resize_(self.nbytes)
        faults.guard("all_gather", self.bucket.key, _ALL_GATHER, flat, self.bucket.shard.detach(),
                     group=self.bucket.group)
        self.gathered, self.gathers = True, self.gathers + 1
        self.registry.by_storage[flat.untyped_storage().data_ptr()] = self
        self.registry.note(self.nbytes)

    def free(self) -> None:
        """Keep only the shard: fold in writes made to the full buffer, then release its storage."""
        if not self.gathered:
            return
        self.absorb()
        flat = self.bucket.param_flat
        self.registry.by_storage.pop(flat.untyped_storage().data_ptr(), None)
        flat.untyped_storage().resize_(0)
        self.gathered, self.backward_seen = False, 0
        self.registry.note(-self.nbytes)

    def absorb(self) -> None:
        """After ``materialize`` (a checkpoint load writes the full buffer): copy this rank's slice into the shard."""
        if self.dirty and self.gathered:
            with torch.no_grad():
                self.bucket.shard.copy_(self.bucket.param_flat[self.bucket.lo:self.bucket.hi])
        self.dirty = False

    def materialize(self) -> None:
        """Gather for a reader outside ``train_step`` (state dicts, checkpoints), which may also write it."""
        self.gather()
        self.dirty = True

    def accumulated(self) -> None:
        """One parameter's gradient of this microbatch is in; free when all are (no backward op reads it after)."""
        self.backward_seen += 1
        if self.backward_seen >= len(self.bucket.params):
            self.free()


class UnitCall(torch.nn.Module):
    """A node of the generated graph: ``gather`` / ``free`` / ``ensure`` (= gather) of one unit."""

    def __init__(self, unit: Unit, action: str):
        super().__init__()
        self._unit, self.action = [unit], action  # a list: the unit is not a submodule

    def forward(self) -> None:
        if self.action == "free":
            self._unit[0].free()
        else:
            self._unit[0].gather()


class Units:
    """Every unit of one stage module, the graph rewrite that drives them, and the saved-tensor hooks."""

    def __init__(self, gm: fx.GraphModule, buckets: list):
        self.by_storage: dict[int, Unit] = {}
        self.gathered_bytes = self.peak_bytes = 0  # bytes of units gathered now / at most since reset
        self.units = [Unit(b, self) for b in buckets if b.level == 3]
        self.peak_bytes = 0
        self.of_param = {name: u for u in self.units for name in u.bucket.names}
        for unit in self.units:
            for p in unit.bucket.params:
                p.register_post_accumulate_grad_hook(lambda _, u=unit: u.accumulated())
        if self.units:
            insert_unit_calls(gm, self)

    def note(self, delta: int) -> None:
        self.gathered_bytes += delta
        self.peak_bytes = max(self.peak_bytes, self.gathered_bytes)

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
        for unit in self.units:
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
        packed.unit.gather()
        return packed.tensor
    return packed


def insert_unit_calls(gm: fx.GraphModule, units: Units) -> None:
    """Insert each unit's ``gather`` before the first node reading its parameters and its ``free`` after
    the last one (``ir.buckets.unit_spans``), and an ``ensure`` at the top of every recomputed region that
    reads them; recompile ``gm``."""
    index = {id(u): k for k, u in enumerate(units.units)}
    unit_of = {name: index[id(u)] for name, u in units.of_param.items()}
    for k, (first, last) in sorted(unit_spans(gm.graph, unit_of, "get_attr").items()):
        unit = units.units[k]
        gm.add_module(f"zero3_gather_{k}", UnitCall(unit, "gather"))
        with gm.graph.inserting_before(first):
            gm.graph.call_module(f"zero3_gather_{k}")
        if last.op != "output":
            gm.add_module(f"zero3_free_{k}", UnitCall(unit, "free"))
            with gm.graph.inserting_after(last):
                gm.graph.call_module(f"zero3_free_{k}")
    sources = parameter_sources(gm.graph, unit_of, "get_attr")
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target.startswith("recompute_"):
            for k in sorted(set().union(*(sources.get(a, set()) for a in node.all_input_nodes))):
                _ensure_in_region(getattr(gm, node.target).body, units.units[k], k)
    gm.graph.lint()
    gm.recompile()


def _ensure_in_region(body: fx.GraphModule, unit: Unit, k: int) -> None:
    name = f"zero3_ensure_{k}"
    if hasattr(body, name):
        return
    body.add_module(name, UnitCall(unit, "ensure"))
    first = next(n for n in body.graph.nodes if n.op != "placeholder")
    with body.graph.inserting_before(first):
        body.graph.call_module(name)
    body.recompile()
