"""Gradient synchronization: bucketed, overlapped with backward, optionally ZeRO-sharded; tied parameters.

``GradSync``: parameters whose every read only all-reduces the gradient over some mesh axes (see
``runtime.codegen._Emitter._deferrable_syncs``) are reduced here instead, once per step, in flat buckets
(``cost_models.memory.sync_buckets``: the planner predicts the same buckets). Each parameter carries a
post-accumulate-grad hook; when the last microbatch's backward has accumulated every gradient of a bucket,
the bucket's collective starts at once, asynchronously (``async_op=True``, gloo and NCCL alike), while
backward goes on with earlier layers. ``finish`` (end of ``train_step``) starts any bucket not started
(a parameter that got no gradient) and waits for all, each under the collective timeout. Per bucket, by
its ZeRO level over its n-way group (the mesh axes it is synced over):
  * 0: all-reduce the flat gradient buffer in place; each ``p.grad`` is a view of it (DDP's
    gradient_as_bucket_view), so nothing is copied back;
  * 1: the parameters are views of one flat buffer padded to n equal shards; the rank's shard of it is the
    ``shard`` parameter the optimizer steps; gradients are reduce-scattered into the rank's slice of the flat
    gradient buffer (kept whole, as Megatron's distributed optimizer keeps its grad buffer);
  * 2: as 1, but the full gradients are freed after the reduce-scatter: only the shard's gradient is kept;
  * 3: as 2, and the shard is the only copy of the parameters between uses: the flat parameter buffer is
    gathered (in the precision policy's compute dtype, when it has one) and freed around each use, the
    next unit's all-gather prefetched (``runtime.zero3``: the bucket is an FSDP unit).
After the optimizer steps the shards, ``gather_params`` all-gathers them into the flat parameter buffers
(levels 1 and 2; level 3 gathers at the next use).
Gradients are reduced in the precision policy's ``reduce_dtype`` (a temporary copy when it is not float32).

Accumulation over steps (``train_step(A); train_step(B); opt.step()``): what the group holds after the
step must be R(A) + R(B), R the reduction, while autograd adds B's local gradient onto the buffer that
holds R(A). ``Bucket.begin`` keeps the held part on exactly one rank of the group per element (the rank
whose shard it is; level 0: the group's first rank) and zeroes it elsewhere, so the collective's sum is
R(A) + R(B) with no copy; at levels 2-3 the reduced shard is added to the shard's gradient, not copied over it.

``sync_shared``: a parameter read by several stages (tied embeddings: GPT-2's token embedding is also
its output projection) lives on every stage that reads it, each with its own layout. Each stage first
gathers its whole gradient (a collective inside the stage); every rank of every holding stage then
contributes G_s / n_s to one all-reduce over all holding ranks, so the sum is Σ_s G_s, and each rank keeps
its shard. Identical gradients and identical optimizers keep the copies identical. Accumulated over
steps, the gradient held before the step (``take_shared``) is set aside and added back after the sum.
"""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from autopar.ir.buckets import padded_numel, sync_buckets
from autopar.placement import local_slice, parse_spec
from autopar.runtime import faults, groups, zero3
from autopar.runtime.collectives import gather_full
from autopar.runtime.flat_collectives import all_gather_flat, reduce_scatter_flat


class Bucket:
    """One gradient-sync bucket of a stage (see module docstring)."""

    def __init__(self, gm, spec: dict, mesh_index: int, mesh_shape):
        self.names, self.level, self.ways, self.axes = spec["names"], spec["level"], spec["ways"], spec["axes"]
        self.params = [getattr(gm, n) for n in self.names]
        self.numels = [p.numel() for p in self.params]  # a ZeRO-3 parameter at rest is a piece (``zero3``)
        self.device = self.params[0].device  # the rank's device (``runtime.devices``): flat buffers live there
        self.numel = spec["numel"]
        self.key = _group_key(mesh_index, spec["axes"], mesh_shape)
        self.group = groups.get(self.key)
        self.padded = padded_numel(self.numel, self.ways, self.level)
        self.shard_size = self.padded // self.ways
        me = groups.local_rank_in(self.key)
        self.lo, self.hi = me * self.shard_size, (me + 1) * self.shard_size
        self.expected, self.seen, self.work = 0, 0, None
        self.shard = None
        if self.level >= 1:
            self._flatten_params(gm.meta.get("pending_values", {}))
        if self.level <= 1:
            self.grad_flat = torch.zeros(self.padded, dtype=self.params[0].dtype, device=self.device)
            self._grads_as_views()
        self._grad_shard = None  # levels 2-3: allocated by the first step (``grad_shard``), not at build
        if self.shard is not None and self.level == 1:
            self.shard.grad = self.grad_flat[self.lo:self.hi]

    @property
    def grad_shard(self) -> torch.Tensor:
        """Levels 2-3: the shard's gradient buffer, allocated on first use (a step's ``begin``), as FSDP2
        allocates gradients in backward: building the module holds parameters only. Until then the shard's
        ``.grad`` is None, as any torch parameter's is before its first backward."""
        if self._grad_shard is None:
            self._grad_shard = torch.zeros(self.shard_size, dtype=self.params[0].dtype, device=self.device)
        return self._grad_shard

    def offsets(self):
        offset = 0
        for p, numel in zip(self.params, self.numels):
            yield p, offset, offset + numel
            offset += numel

    def _flatten_params(self, pending: dict) -> None:
        if self.level == 3 and any(n in pending for n in self.names):
            return self._shard_pending(pending)
        self.param_flat = torch.zeros(self.padded, dtype=self.params[0].dtype, device=self.device)
        for p, a, b in self.offsets():
            self.param_flat[a:b].copy_(p.detach().reshape(-1))
            p.data = self.param_flat[a:b].view_as(p)
        own = self.param_flat[self.lo:self.hi]
        self.shard = torch.nn.Parameter(own.clone() if self.level == 3 else own)  # level 3 frees param_flat

    def _shard_pending(self, pending: dict) -> None:
        """Level 3 with values codegen left pending: only this rank's range of each is ever written (the flat
        buffer is allocated, never touched, and released by ``zero3.Unit``), one parameter's value at a time."""
        dtype = self.params[0].dtype
        self.param_flat = torch.empty(self.padded, dtype=dtype, device=self.device)
        shard = torch.zeros(self.shard_size, dtype=dtype, device=self.device)
        for name, (p, a, b) in zip(self.names, self.offsets()):
            value = pending.pop(name, None)
            lo, hi = max(a, self.lo), min(b, self.hi)
            if lo < hi:
                full = value() if value is not None else p.detach()
                shard[lo - self.lo:hi - self.lo].copy_(full.reshape(-1)[lo - a:hi - a])
                del full  # not alive beside the next parameter's full value
            p.data = self.param_flat[a:b].view_as(p)
        self.shard = torch.nn.Parameter(shard)

    def _grads_as_views(self) -> None:
        """Point every ``p.grad`` at its slice of the flat buffer (copying a gradient allocated elsewhere)."""
        for p, a, b in self.offsets():
            view = self.grad_flat[a:b].view_as(p)
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view

    def begin(self) -> None:
        """Before a step's backward: reduce only what this step adds (see module docstring, accumulation).
        The gradient already held (reduced by earlier steps, never zeroed since) stays on one rank of the
        group per element, the one whose shard holds it (level 0: the group's first rank); the others hold
        zero there, so the sum the collective forms counts it once. A gradient set to None is a zero one."""
        me = groups.local_rank_in(self.key)
        if self.level == 0:
            self._grads_as_views()  # autograd then accumulates every microbatch in place into the flat buffer
            if me != 0:
                self.grad_flat.zero_()
        elif self.level == 1:
            kept = self._shard_grad_kept(self.grad_flat[self.lo:self.hi])
            self._grads_as_views()
            self.grad_flat[:self.lo].zero_()
            self.grad_flat[self.hi:].zero_()
            if not kept:
                self.grad_flat[self.lo:self.hi].zero_()
            self.shard.grad = self.grad_flat[self.lo:self.hi]
        elif not self._shard_grad_kept(self.grad_shard):
            self.grad_shard.zero_()
            self.shard.grad = self.grad_shard

    def _shard_grad_kept(self, storage: torch.Tensor) -> bool:
        """Whether the shard's gradient is still ``storage`` (an optimizer's ``zero_grad`` may have set it to
        None, or another tensor, which then is what it holds)."""
        grad = self.shard.grad
        if grad is None:
            return False
        if grad.data_ptr() != storage.data_ptr():
            storage.copy_(grad)
        return True

    def launch(self, reduce_dtype: torch.dtype) -> None:
        """Start this bucket's collective (asynchronously); see the module docstring for each level."""
        if self.level <= 1:
            self._grads_as_views()
            flat = self.grad_flat
        else:
            flat = torch.zeros(self.padded, dtype=self.params[0].dtype, device=self.device)
            for p, a, b in self.offsets():
                if p.grad is not None:
                    flat[a:b].copy_(p.grad.reshape(-1))
                p.grad = None
        self.buffer = flat if flat.dtype == reduce_dtype else flat.to(reduce_dtype)
        if self.level == 0:
            self.work = _start("all_reduce", self.key, dist.all_reduce, self.buffer, group=self.group)
            self.out = self.buffer
        else:
            self.out = torch.empty(self.shard_size, dtype=reduce_dtype, device=self.device)
            self.work = _start("reduce_scatter", self.key, reduce_scatter_flat, self.out, self.buffer,
                               group=self.group)

    def complete(self, timeout) -> None:
        faults.guard("wait", self.key, self.work.wait, timeout)
        self.work = None
        if self.level == 0:
            if self.out is not self.grad_flat:
                self.grad_flat.copy_(self.out)
        elif self.level == 1:
            self.grad_flat[self.lo:self.hi].copy_(self.out)
        else:  # the reduced sum of this step's gradients, added to what the shard held (``begin``)
            self.grad_shard.add_(self.out)
            self.shard.grad = self.grad_shard
        self.buffer = self.out = None

    def gather_params(self) -> None:
        """All-gather the updated shards into the flat parameter buffer (ZeRO ≥ 1)."""
        faults.guard("all_gather", self.key, all_gather_flat, self.param_flat, self.shard.detach().clone(),
                     group=self.group)


class GradSync:
    """The buckets of one stage and the hooks that start them (see module docstring)."""

    def __init__(self, gm, graph, stage, mesh_index: int, microbatches: int, bucket_bytes: float,
                 reduce_dtype: torch.dtype = torch.float32, timeout=None, gather_dtype: torch.dtype | None = None):
        deferred = {n: axes for n, axes in gm.meta.get("deferred_syncs", {}).items()
                    if getattr(gm, n).requires_grad}  # a frozen parameter has no gradient to sync
        numel = {n: getattr(gm, n).numel() for n in deferred}
        specs = sync_buckets(graph.gm, deferred, stage.zero, stage.mesh_shape, numel, bucket_bytes)
        self.buckets = [Bucket(gm, spec, mesh_index, stage.mesh_shape) for spec in specs]
        self.timeout = timeout or datetime.timedelta(seconds=300)
        self.units = zero3.Units(gm, self.buckets, gather_dtype, self.timeout)
        self._args = (graph, stage, mesh_index, microbatches, bucket_bytes, reduce_dtype, timeout, gather_dtype)
        self.microbatches, self.reduce_dtype = microbatches, reduce_dtype
        self.armed = False
        # (event, bucket, perf_counter, buckets whose gradients are not all in yet): for tests and traces
        self.events: list[tuple[str, int, float, int]] = []
        for bucket in self.buckets:  # a compute-dtype ZeRO-3 unit's gradients arrive on its leaves
            for p in self.units.leaves_of(bucket):
                p.register_post_accumulate_grad_hook(lambda _, b=bucket: self._accumulated(b))

    def over(self, gm) -> "GradSync":
        """The same buckets over ``gm``'s current tensors: after ``ParallelModule.share_state_of`` put another
        module's parameters into ``gm``, the hooks and flat buffers must follow them (ZeRO level 0 only: at
        higher levels the parameters are views of this sync's flat buffer)."""
        assert all(b.level == 0 for b in self.buckets), "only ZeRO level 0 buckets can follow shared tensors"
        return GradSync(gm, *self._args)

    def begin(self) -> None:
        """Arm the hooks for one ``train_step``. At levels 0-1 every ``p.grad`` becomes its view of the flat
        buffer before backward (DDP's gradient_as_bucket_view): gradients accumulated over microbatches
        would otherwise be a second full copy until the bucket launches after the last one."""
        self.armed = True
        self.events.clear()
        for b in self.buckets:
            b.seen, b.expected = 0, len(b.params) * self.microbatches
            b.begin()

    def _accumulated(self, bucket: Bucket) -> None:
        if not self.armed:
            return
        bucket.seen += 1
        if bucket.seen == bucket.expected and bucket.work is None:
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        waiting = sum(1 for b in self.buckets if b.seen < b.expected)  # > 0: backward is still running
        self.events.append(("launch", self.buckets.index(bucket), time.perf_counter(), waiting))
        bucket.launch(self.reduce_dtype)

    def finish(self) -> None:
        """Start what has not started, wait for everything (under the timeout)."""
        self.armed = False
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket)
        for i, bucket in enumerate(self.buckets):
            bucket.complete(self.timeout)
            self.events.append(("done", i, time.perf_counter(), 0))
        self.units.free_all()  # a unit some parameter of which got no gradient is still gathered

    def gather_params(self) -> None:
        """After the optimizer step: all-gather the updated shards (levels 1, 2); level 3 units stay freed."""
        for bucket in self.buckets:
            if bucket.level in (1, 2):
                bucket.gather_params()
        self.units.free_all()


def _group_key(mesh_index: int, axes, mesh_shape) -> str:
    """The process group over ``axes`` of the mesh: one axis's group, or the whole mesh's."""
    real = [a for a in axes if mesh_shape[a] > 1]
    if len(real) == 1:
        return groups.group_key(mesh_index, real[0])
    return f"m{mesh_index}.all"


def _start(what: str, key: str, fn, *args, **kwargs):
    return faults.guard(what, key, fn, *args, async_op=True, **kwargs)


def take_shared(gm, shared: dict[str, str]) -> dict[str, torch.Tensor]:
    """Before a step: the gradients the tied parameters hold (from earlier steps), which ``sync_shared``
    adds back after summing this step's over the stages; the parameters start the step without one."""
    held = {}
    for name in sorted(shared):
        param = getattr(gm, name, None)
        if param is not None and param.grad is not None:
            held[name] = param.grad.detach().clone()
            param.grad = None
    return held


def sync_shared(gm, stage, shared: dict[str, str], coord, mesh_index: int, held: dict | None = None) -> None:
    """``shared``: {parameter placeholder held by this stage and others: its group key}; ``mesh_index``:
    this stage's mesh id in the group registry; ``held``: ``take_shared``'s gradients from earlier steps."""
    for name in sorted(shared):
        param = getattr(gm, name, None)
        if param is None or not param.requires_grad:
            continue
        spec = parse_spec(stage.shardings[name].out)
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        full = gather_full(grad, spec, mesh_index) / len(stage.ranks)
        faults.guard("all_reduce", shared[name], dist.all_reduce, full, group=groups.get(shared[name]))
        param.grad = local_slice(full, spec, tuple(stage.mesh_shape), coord).clone()
        if held and name in held:
            param.grad.add_(held[name])
