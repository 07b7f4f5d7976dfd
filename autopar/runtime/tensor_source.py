"""Where a rank's parameter and buffer shards come from: never a copy of the whole model.

Codegen leaves ``source.local(fqn, spec, mesh_shape, coord)`` pending for each shard it places, once per
placeholder a stage of this rank holds; it is called once the gradient sync has laid out its buckets (a
ZeRO-3 bucket then keeps only this rank's range of the value: ``gradsync.Bucket``), one value at a time.
``source.full(fqn)`` serves only the few state entries the graph never reads.
A source holds, besides the shards it has returned, at most one full tensor (or one module's tensors):

  * ``UserTensors``: the user's real model. Slices are cut from the user's tensors (never cloned whole);
    ranks whose tensors differ from rank 0's (a model built without a common seed) get rank 0's values,
    one tensor at a time (``agree_with_rank0``), keeping only the slices this rank holds (DDP broadcasts
    rank 0's weights in the same way, but in place);
  * ``InitTensors``: a meta-device model, each full tensor made by ``runtime.initialize`` and sliced;
  * ``EmptyTensors``: uninitialized shards of the right shape (a checkpoint loads into them next);
  * ``runtime.pretrained_files.FileTensors``: slices read from safetensors files.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from autopar.placement import local_shape, local_slice
from autopar.runtime import devices, faults
from autopar.runtime.initialize import ModuleInit


def shard_bounds(shape, spec, mesh_shape, coord) -> tuple[tuple[slice, ...], bool]:
    """(the box of the full tensor this coordinate holds, whether it holds zeros: a Partial axis off
    coordinate 0), in the nesting order of ``placement.local_slice`` (``torch.chunk`` sizes)."""
    lo, hi = [0] * len(shape), list(shape)
    zero = False
    for axis, p in enumerate(spec):
        if p.is_shard():
            n = hi[p.dim] - lo[p.dim]
            step = -(-n // mesh_shape[axis])
            start = min(lo[p.dim] + coord[axis] * step, hi[p.dim])
            lo[p.dim], hi[p.dim] = start, min(start + step, hi[p.dim])
        elif p.is_partial() and coord[axis] != 0:
            zero = True
    return tuple(slice(a, b) for a, b in zip(lo, hi)), zero


class Source:
    """Base: ``templates`` are fqn -> a tensor (real or meta) with the shape, dtype and requires_grad."""

    def __init__(self, templates: dict[str, torch.Tensor]):
        self.templates = templates

    def requires_grad(self, fqn: str) -> bool:
        return bool(self.templates[fqn].requires_grad)

    def dtype(self, fqn: str) -> torch.dtype:
        return self.templates[fqn].dtype

    def full(self, fqn: str) -> torch.Tensor:
        raise NotImplementedError

    def local(self, fqn: str, spec, mesh_shape, coord) -> torch.Tensor:
        """This coordinate's shard, read-only (codegen's pending values are copied from, never into): a view
        where the slice is contiguous, so a replicated or ZeRO-3 parameter costs no second full tensor."""
        full = self.full(fqn)
        return local_slice(full.detach(), spec, tuple(mesh_shape), tuple(coord)).contiguous()


class UserTensors(Source):
    def __init__(self, templates: dict[str, torch.Tensor]):
        super().__init__(templates)
        self.overrides: dict[tuple, torch.Tensor] = {}

    def full(self, fqn: str) -> torch.Tensor:
        return self.templates[fqn].detach()

    def local(self, fqn: str, spec, mesh_shape, coord) -> torch.Tensor:
        key = (fqn, tuple(spec), tuple(mesh_shape), tuple(coord))
        if key in self.overrides:
            return self.overrides.pop(key)
        return super().local(fqn, spec, mesh_shape, coord)

    def agree_with_rank0(self, needs: dict[str, list[tuple]], unread: set[str]) -> None:
        """Collective: tensors whose bytes differ from rank 0's are broadcast one at a time; this rank keeps
        only the slices ``needs`` lists ({fqn: [(spec, mesh_shape, coord)]}) and the whole of ``unread``."""
        names = sorted(self.templates)
        mine = [_digest(self.templates[n]) for n in names]
        every = [None] * dist.get_world_size()
        faults.guard("all_gather_object", "weights", dist.all_gather_object, every, mine)
        for i, name in enumerate(names):
            if all(d[i] == every[0][i] for d in every):
                continue
            value = devices.to_wire(self.templates[name].detach().clone())
            faults.guard("broadcast", "weights", dist.broadcast, value, src=0)
            for spec, mesh_shape, coord in needs.get(name, ()):
                self.overrides[(name, tuple(spec), tuple(mesh_shape), tuple(coord))] = \
                    local_slice(value, spec, tuple(mesh_shape), tuple(coord)).clone().contiguous()
            if name in unread:
                self.templates[name] = value.requires_grad_(self.templates[name].requires_grad)


class InitTensors(Source):
    def __init__(self, model: torch.nn.Module, templates: dict[str, torch.Tensor], init_seed: int):
        super().__init__(templates)
        self.init = ModuleInit(model, init_seed)

    def full(self, fqn: str) -> torch.Tensor:
        template = self.templates[fqn]
        if template.device.type != "meta":  # a real tensor of a partly meta model: the user's value
            return template.detach()
        if fqn not in self.init.owner:  # a lifted constant (a plain tensor attribute): the model's own value
            if template.device.type == "meta":
                from autopar.runtime.initialize import InitError

                raise InitError(f"the tensor constant {fqn!r} of the meta-device model has no value; make it a "
                                f"buffer (register_buffer) or pass weights=PATH")
            return template.detach()
        return self.init.full(fqn).to(template.dtype)


class EmptyTensors(Source):
    def full(self, fqn: str) -> torch.Tensor:
        t = self.templates[fqn]
        return torch.zeros(t.shape, dtype=t.dtype, device="cpu")  # host values, copied into the rank's shards

    def local(self, fqn: str, spec, mesh_shape, coord) -> torch.Tensor:
        t = self.templates[fqn]
        return torch.zeros(local_shape(tuple(t.shape), spec, tuple(mesh_shape)), dtype=t.dtype, device="cpu")


def _digest(t: torch.Tensor) -> str:
    if t.device.type == "meta":
        return "meta"
    data = t.detach().cpu().contiguous().reshape(-1)  # a model handed over on a GPU: hash its host copy
    return hashlib.blake2b(data.view(torch.uint8).numpy() if data.numel() else b"", digest_size=16).hexdigest()


def retarget_meta_device(gm: torch.fx.GraphModule, device_type: str) -> int:
    """A graph captured from a meta-device model bakes ``device=meta`` into its factory ops (``arange``
    for position ids, ``ones`` for masks): point them at the device the ranks run on. Returns how many."""
    target = torch.device(device_type)
    changed = 0

    def swap(value):
        nonlocal changed
        if isinstance(value, torch.device) and value.type == "meta":
            changed += 1
            return target
        return value

    for node in gm.graph.nodes:
        node.args = torch.fx.node.map_aggregate(node.args, swap)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)
    if changed:
        gm.recompile()
    return changed


def on_meta_for(model: torch.nn.Module, example_inputs):
    """The example inputs as meta tensors when ``model`` has meta tensors (capture then sees one device;
    only shapes and dtypes matter to planning), else unchanged."""
    if not any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
        return example_inputs
    import torch.utils._pytree as pytree

    return pytree.tree_map_only(torch.Tensor, lambda t: torch.empty_like(t, device="meta"), example_inputs)
