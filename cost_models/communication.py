"""Communication cost: α-β per mesh axis, and the price of a redistribution (forward + backward).

Collective times on an axis of n devices with link latency α and per-device bandwidth β (bytes/s),
ring algorithms (Thakur et al. 2005; NCCL's bus-bandwidth convention):

    all_reduce(m)      = α + 2(n-1)/n · m / β        m = the full tensor on each device
    all_gather(m)      = α +  (n-1)/n · m / β        m = the gathered (output) size
    reduce_scatter(m)  = α +  (n-1)/n · m / β        m = the input size
    all_to_all(m)      = α +  (n-1)/n · m / β        m = the local size
    send(m)            = α +            m / β

Topology and algorithm (presets carry both, with sources in ``autopar.hardware.presets``):

    α(kind, n) = latency + hop_latency · steps(kind, n)
    steps: all_reduce min(2(n-1) ring, 2·ceil(log2 n) tree: NCCL picks the tree where latency dominates),
           all_gather / reduce_scatter / all_to_all n-1, send 1
    β(n)       = Link.bandwidth_for(n) inside a node (a V100 pair shares 1-2 NVLinks while 8 GPUs ring over
                 all six; NVSwitch gives every group the same), per-node bandwidth / c across nodes (below)

Gradient all-reduces that the runtime buckets (``redistribute_cost(bucketed_sync=True)``) pay only their
bandwidth term per tensor; the bucket's α is paid once per axis per step.

When the cluster carries a measured fit for "<collective>/<n>" on that link class, t = α_fit + m·β_fit
replaces the formula (the profiler defines m the same way). A fit keyed "<collective>/<n>@<R>x<C>" was
measured on an R×C mesh with both axes' collectives interleaved, as training on that mesh runs them; it
takes precedence on that mesh. (On an oversubscribed CPU the two axes' groups share cores, so each
collective waits for ranks busy in the other axis's groups: on 4 gloo ranks of 2 cores an all_reduce/2
interleaved across the axes of a 2×2 mesh took 3.6 ms against 2.0 ms alone.)

A fit keyed "<collective>/<n>@step" was measured right after a burst of compute on every rank
(``autopar.profiling.profiler_in_step``: the wait for a rank still computing, buffers the compute evicted),
as a training step meets its collectives; CPU profiles carry it, and where the cluster has one a collective
costs max(in-step fit, isolated fit): the wait and the cold buffers only add to a call, so an in-step fit
below the isolated one at some size is the noise of its difference of two windows (a mesh's own fit still
comes first). GPU clusters have none, so their prices do not move.

Axis links: the logical mesh's devices are numbered row-major over (nodes × devices per node). An axis
whose groups stay inside a node uses the intra-node link; one whose groups span nodes uses the
inter-node link, whose per-node bandwidth is shared by the c groups that cross the same node's NIC at
once (β = inter_bw / c).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
from torch.distributed.tensor import Shard

from autopar.hardware.cluster import Cluster, Link
from autopar.placement import P, R, Spec, local_shape
from autopar.redistribute import Step, redistribute_steps


def algorithm_steps(kind: str, n: int) -> int:
    """Latency steps of one ``kind`` collective over ``n`` devices (module docstring): ring, or tree for
    all-reduce when it has fewer steps."""
    if n <= 1:
        return 0
    if kind == "all_reduce":
        return min(2 * (n - 1), 2 * math.ceil(math.log2(n)))
    return 1 if kind == "send" else n - 1


RING_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
               "send": lambda n: 1.0}


@dataclasses.dataclass(frozen=True)
class AxisLink:
    """The link one mesh axis communicates over: n devices per group, latency, bandwidth, fits."""

    size: int
    latency: float
    bandwidth: float
    link: Link
    mesh: str = ""  # "<R>x<C>" of the mesh this axis belongs to, when both of its axes have > 1 device

    def time(self, kind: str, nbytes: float) -> float:
        if self.size <= 1 or nbytes <= 0:
            return 0.0
        key = f"{kind}/{self.size}"
        fit = self.link.fits.get(f"{key}@{self.mesh}") if self.mesh else None
        in_step, isolated = self.link.fits.get(f"{key}@step"), self.link.fits.get(key)
        if fit is None and in_step is not None:  # a step only adds to the call: below alone is the fit's noise
            return max(in_step.time(nbytes), isolated.time(nbytes) if isolated else 0.0)
        fit = fit or isolated
        if fit is not None:
            return fit.time(nbytes)
        alpha = self.latency + self.link.hop_latency * algorithm_steps(kind, self.size)
        return alpha + RING_FACTOR[kind](self.size) * nbytes / self.bandwidth

    def startup_time(self, kind: str) -> float:
        """α of one ``kind`` collective on this axis (the fit's, when measured): ``time`` of an empty message."""
        return self.time(kind, 1e-30)

    def bandwidth_time(self, kind: str, nbytes: float) -> float:
        """``time`` less its start-up α: what one more tensor adds to a bucketed (flattened) collective."""
        if self.size <= 1 or nbytes <= 0:
            return 0.0
        return self.time(kind, nbytes) - self.startup_time(kind)


def zero_pair_fit(link: AxisLink):
    """The profile's fit of ZeRO's reduce-scatter + all-gather pair on ``link``'s group ("zero_pair/<n>@step",
    measured after a step's compute on CPU profiles), or None where there is none (GPU presets, one device)."""
    return link.link.fits.get(f"zero_pair/{link.size}@step") if link.size > 1 else None


def zero_pair_time(link: AxisLink, nbytes: float) -> float:
    """Seconds of one ZeRO 1-2 gradient bucket's reduce-scatter + all-gather over ``link`` (m = the full flat
    buffer, as ``all_reduce``'s): the profile's "zero_pair/<n>@step" fit where a CPU profile measured the pair
    as ``runtime.gradsync`` issues it after a step's compute (on gloo it cost 2-4× one all-reduce of the same
    buffer), else the reduce-scatter's and the all-gather's own prices."""
    fit = zero_pair_fit(link) if nbytes > 0 else None
    if fit is not None:
        return fit.time(nbytes)
    return link.time("reduce_scatter", nbytes) + link.time("all_gather", nbytes)


def zero_pair_excess(link: AxisLink, nbytes: float) -> float:
    """Seconds a ZeRO 1-2 bucket of ``nbytes`` costs beyond the one all-reduce of it the planner charges
    (half reduce, half gather): zero_pair_time − all_reduce time, where the profile measured the pair
    ("zero_pair/<n>@step"); 0 without that fit (GPU presets carry none, so their plans do not move)."""
    if nbytes <= 0 or zero_pair_fit(link) is None:
        return 0.0
    return max(0.0, zero_pair_time(link, nbytes) - link.time("all_reduce", nbytes))


def zero_gather_time(link: AxisLink, nbytes: float) -> float:
    """What ZeRO 1-2 adds to one parameter's bucketed gradient all-reduce (bandwidth terms only, as
    ``bandwidth_time``): the after-step all-gather's, or, where the profile measured the pair, the larger of
    that and what the pair's fit costs per byte beyond the all-reduce's."""
    gather = link.bandwidth_time("all_gather", nbytes)
    fit = zero_pair_fit(link) if nbytes > 0 else None
    if fit is None:
        return gather
    pair = fit.time(nbytes) - fit.time(1e-30)
    return max(gather, pair - link.bandwidth_time("all_reduce", nbytes))


def axis_links(cluster: Cluster, mesh_shape: tuple[int, int],
               devices_per_node: int | None = None) -> tuple[AxisLink, ...]:
    """Links for each axis of a logical mesh laid row-major on nodes of ``devices_per_node`` devices.

    devices_per_node defaults to the cluster's; a submesh inside one node passes its own width.
    """
    m = devices_per_node or cluster.devices_per_node
    total = math.prod(mesh_shape)
    mesh = "x".join(map(str, mesh_shape)) if min(mesh_shape) > 1 else ""
    ids = np.arange(total).reshape(mesh_shape)
    node_of = ids // m
    links = []
    for axis, size in enumerate(mesh_shape):
        groups = np.moveaxis(node_of, axis, -1).reshape(-1, size)
        spans = any(len(set(g)) > 1 for g in groups)
        if not spans:
            link = cluster.intra_node
            links.append(AxisLink(size, link.latency, link.bandwidth_for(size), link, mesh))
            continue
        per_node = {}
        for g in groups:
            for node in set(g):
                per_node[node] = per_node.get(node, 0) + 1
        concurrent = max(per_node.values())
        link = cluster.inter_node
        links.append(AxisLink(size, link.latency, link.bandwidth / concurrent, link, mesh))
    return tuple(links)


_BACKWARD = {"all_gather": None, "split": "all_gather", "all_reduce": None, "reduce_scatter": "all_gather",
             "all_to_all": "all_to_all", "to_partial": None, "sync_grad": "all_reduce", "unreachable": None}
# The price of a move nothing can make (into EXPERT_ROWS, see autopar.redistribute): far above any step time,
# so the intra-op ILP never picks it (finite, to keep the ILP's coefficients in a range solvers like).
UNREACHABLE_SECONDS = 1e4


def redistribute_messages(shape: tuple[int, ...], itemsize: int, src: Spec, dst: Spec, mesh_shape,
                          grad_axes=(), needs_grad: bool = True) -> list[tuple[str, int, float, str]]:
    """The collectives of moving a tensor from ``src`` to ``dst``: (collective, axis, bytes, phase).

    Backward messages follow the table in ``autopar.redistribute``; there are none when ``needs_grad``
    is False. Local steps (split, to_partial, forward of sync_grad) send nothing and are left out.
    """
    return [m[:4] for m in _messages(shape, itemsize, src, dst, mesh_shape, grad_axes, needs_grad)]


def _messages(shape, itemsize, src, dst, mesh_shape, grad_axes, needs_grad, numbers=None):
    """``redistribute_messages`` with the kind of the step each message comes from as a fifth field; a
    message moves the step's local size before it (an all-gather's: its output, n times that)."""
    unreachable, entries = _message_plan(src, dst, grad_axes, needs_grad, numbers)
    if unreachable:  # not kept: what such a move sends is asked only where no price is
        entries = _plan_entries(src, dst, tuple(grad_axes) if needs_grad else (), needs_grad)
    for step_kind, axis, spec, gathers, forward, back in entries:
        local = math.prod(local_shape(shape, spec, mesh_shape))
        nbytes = (local * mesh_shape[axis] if gathers else local) * itemsize
        if forward:
            yield step_kind, axis, nbytes, "forward", step_kind
        if back:
            yield back, axis, nbytes, "backward", step_kind


_PLANS: dict[tuple, tuple] = {}


def _message_plan(src: Spec, dst: Spec, grad_axes, needs_grad: bool, numbers: tuple[int, int] | None) -> tuple:
    """What a redistribution sends apart from the tensor's shape, worked out once per (source and destination
    ``spec_number``, gradient axes, needs_grad): (whether a step is unreachable, per step that sends
    something: (step kind, mesh axis, the local spec before the step, whether it all-gathers, whether its
    forward sends, the collective its backward runs or None))."""
    grad_axes = tuple(grad_axes) if needs_grad else ()
    key = (numbers if numbers is not None else (spec_number(src), spec_number(dst)), grad_axes, needs_grad)
    plan = _PLANS.get(key)
    if plan is None:
        unreachable = any(step.kind == "unreachable" for step in redistribute_steps(src, dst))
        plan = _PLANS[key] = (unreachable, () if unreachable else _plan_entries(src, dst, grad_axes, needs_grad))
    return plan


def _plan_entries(src: Spec, dst: Spec, grad_axes: tuple[int, ...], needs_grad: bool) -> tuple:
    entries, spec = [], list(src)
    for step in redistribute_steps(src, dst, grad_axes):
        forward = step.kind in RING_FACTOR
        back = _backward_kind(step) if needs_grad else None
        if forward or back:
            entries.append((step.kind, step.axis, tuple(spec), step.kind == "all_gather", forward, back))
        spec[step.axis] = _after(step, spec[step.axis], dst)
    return tuple(entries)


_SPEC_NUMBERS: dict = {}


def spec_number(spec: Spec) -> int:
    """A number per distinct spec, the same in every caller of this process: equal specs, equal numbers.

    Price caches are probed millions of times per plan; keyed by these numbers they hash ints, where a
    spec key would hash each of its DTensor Placements in Python (``Placement.__hash__``). The table only
    grows by the distinct specs of the meshes planned (a few hundred)."""
    number = _SPEC_NUMBERS.get(spec)
    if number is None:
        number = _SPEC_NUMBERS[spec] = len(_SPEC_NUMBERS)
    return number


def redistribute_cost(shape: tuple[int, ...], itemsize: int, src: Spec, dst: Spec, mesh_shape,
                      links: tuple[AxisLink, ...], grad_axes=(), needs_grad: bool = True,
                      bucketed_sync: bool = False, numbers: tuple[int, int] | None = None) -> tuple[float, float]:
    """(forward seconds, backward seconds) of moving a tensor from ``src`` to ``dst`` (``numbers``: their
    ``spec_number``s, when the caller has them).

    bucketed_sync: the gradient all-reduce of a "sync_grad" step (a replicated parameter read by a
    sharded op) is flattened with the other parameters' into one all-reduce per axis after backward
    (``runtime.gradsync.reduce_deferred``, like DDP's buckets), so it costs only its bandwidth term
    (``AxisLink.bandwidth_time``); the bucket's one α per axis per step is the caller's to add once.
    """
    fwd = bwd = 0.0
    if _message_plan(src, dst, grad_axes, needs_grad, numbers)[0]:
        return UNREACHABLE_SECONDS, 0.0
    for kind, axis, nbytes, phase, step_kind in _messages(shape, itemsize, src, dst, mesh_shape, grad_axes,
                                                          needs_grad, numbers):
        if bucketed_sync and step_kind == "sync_grad":
            t = links[axis].bandwidth_time(kind, nbytes)
        else:
            t = links[axis].time(kind, nbytes)
        if phase == "forward":
            fwd += t
        else:
            bwd += t
    return fwd, bwd


def _backward_kind(step: Step) -> str | None:
    """The collective the backward of ``step`` runs; every one moves the pre-step local size."""
    if step.kind == "all_gather":
        return "reduce_scatter" if step.rs_backward else None
    if step.kind == "all_reduce":
        return "all_reduce" if step.ar_backward else None
    return _BACKWARD[step.kind]


def _after(step: Step, before, dst: Spec):
    if step.kind in ("all_gather", "all_reduce", "sync_grad"):
        return R if step.kind != "sync_grad" else before
    if step.kind in ("split", "reduce_scatter"):
        return Shard(step.dim)
    if step.kind == "all_to_all":
        return Shard(step.dim2)
    if step.kind == "to_partial":
        return P
    return before
