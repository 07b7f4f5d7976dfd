"""Gradient sync as the plan predicts it: the buckets the runtime builds per stage, what ZeRO adds to them,
and how much of the sync the backward hides.

    exposed = max(s / K, s − b·(K − 1)/K) + g        (``exposed_sync``; K buckets, b the last backward)

and, where compute hides only a share ω of a collective beside it (``Cluster.comm_overlap``, measured on CPU
ranks; 1 elsewhere), (1 − ω) of the part the backward would hide added back.

with g the ZeRO 1-2 all-gathers after the step (plus, on CPU profiles, the measured pair's excess) and ZeRO-3's
gathers charged into forward and backward instead (``charge_zero3``). ``plan_builder`` calls these per stage.
"""
from __future__ import annotations

import math

from autopar.cost_models.communication import axis_links, zero_pair_excess, zero_pair_fit
from autopar.cost_models.zero3 import exposed_gather
from autopar.hardware.cluster import Cluster
from autopar.ir.buckets import deferrable_syncs, padded_numel, sync_buckets
from autopar.ir.ops import requires_grad_nodes
from autopar.placement import local_shape, parse_spec


def requires_grad_kept(graph, trainable: set[str]) -> frozenset[str]:
    """``requires_grad_nodes`` of the graph, kept on it per (module, trainable set): every stage of a plan asks
    twice (its collectives, its sync buckets), and the walk over the whole graph is the same each time."""
    key = (graph.gm, frozenset(trainable))
    kept = getattr(graph, "_requires_grad_kept", None)
    if kept is None or kept[0][0] is not key[0] or kept[0][1] != key[1]:
        kept = graph._requires_grad_kept = (key, frozenset(requires_grad_nodes(graph.gm, trainable)))
    return kept[1]


def stage_sync_buckets(graph, stage, bucket_bytes: float) -> list[dict]:
    """The gradient-sync buckets the runtime builds for ``stage`` (``cost_models.memory.sync_buckets``),
    from the parameters whose gradient codegen leaves to the once-per-step sync."""
    trainable = {p.name for p in graph.placeholders if p.kind == "parameter"}
    deferred = deferrable_syncs(graph, stage, requires_grad_kept(graph, trainable))
    numel = {p.name: math.prod(local_shape(p.shape, parse_spec(stage.shardings[p.name].out), stage.mesh_shape))
             for p in graph.placeholders if p.name in deferred}
    return sync_buckets(graph.gm, deferred, stage.zero, stage.mesh_shape, numel, bucket_bytes)


def charge_zero3(stage) -> None:
    """Add ZeRO-3's all-gathers and gathered units to ``stage.predicted`` (after ``predict_state``).

    Per microbatch, the level-3 share f3 of the stage's gradient-sync elements is all-gathered before its
    forward use and again for backward; each all-gather moves what half a ring all-reduce does, at the
    gather dtype: g = f3 · s/2 · r per direction (s: the stage's gradient all-reduce seconds, ``grad_sync``;
    r: ``zero3_gather_scale``). Prefetched over U units (``zero3_units``), forward and backward each gain
    only what their compute c does not hide, ``cost_models.zero3.exposed_gather``:
    max(g/U, g − c·(U − 1)/U), the hidden rest scaled by 1 − ω (``comm_overlap``) where the cluster measured ω
    (``zero3_exposed``: both, per microbatch). Per step the level-3 gradients
    are reduce-scattered (f3 · s / 2, in ``exposed_sync``) and nothing is gathered after the optimizer step.
    Memory: the units held at once (``zero3_transient``) add to the stage's memory and peak."""
    p = stage.predicted
    g3 = p.get("zero3_gather_measured", p.get("zero3_share", 0.0) * p.get("grad_sync", 0.0) / 2
               * p.get("zero3_gather_scale", 1.0))
    p["zero3_gather"] = g3
    if g3 > 0:
        units = p.get("zero3_units", 1.0)
        overlap = p.get("comm_overlap", 1.0)
        exposed = {key: exposed_gather(g3, p.get(key, 0.0), units, overlap) for key in ("forward", "backward")}
        for key, seconds in exposed.items():
            p[key] = p.get(key, 0.0) + seconds
        p["zero3_exposed"] = sum(exposed.values())
        p["latency"] = p.get("latency", 0.0) + p["zero3_exposed"]
    for key in ("memory", "peak_memory"):
        p[key] = p.get(key, 0.0) + p.get("zero3_transient", 0.0)


def _flat_bytes_by_axis(graph, stage, bucket_bytes: float, levels: tuple[int, ...]):
    """(mesh axis, bytes of the fp32 flat buffer, padded) per axis of each of ``stage``'s sync buckets whose ZeRO
    level is in ``levels``: what one ZeRO collective of that bucket moves on that axis."""
    for b in stage_sync_buckets(graph, stage, bucket_bytes):
        if b["level"] in levels:
            nbytes = 4.0 * padded_numel(b["numel"], b["ways"], b["level"])
            yield from ((a, nbytes) for a in b["axes"])


def charge_zero_pair(graph, stage, cluster: Cluster, bucket_bytes: float) -> None:
    """Where the profile measured ZeRO's reduce-scatter + all-gather pair after a step's compute
    ("zero_pair/<n>@step", CPU profiles), add to ``stage.predicted["zero_pair_excess"]`` what the stage's
    level 1-2 buckets (fp32 flat buffers, padded) cost beyond the all-reduce ``exposed_sync`` prices them as
    (``cost_models.communication.zero_pair_excess``, per bucket and axis); nothing is added, and no key, where
    no such fit exists, so plans on clusters without one stay as they were."""
    links = axis_links(cluster, tuple(stage.mesh_shape), stage.submesh[1])
    if all(zero_pair_fit(link) is None for link in links):
        return
    pieces = _flat_bytes_by_axis(graph, stage, bucket_bytes, (1, 2))
    excess = sum(zero_pair_excess(links[a], nbytes) for a, nbytes in pieces)
    if excess > 0:
        stage.predicted["zero_pair_excess"] = excess


def charge_zero3_in_step(graph, stage, cluster: Cluster, bucket_bytes: float) -> None:
    """Where the profile timed all-gathers and reduce-scatters right after a step's compute ("<kind>/<n>@step",
    CPU profiles), price ZeRO-3's collectives from those fits, per level-3 bucket and axis, instead of as
    halves of the gradient all-reduce: ``stage.predicted["zero3_gather_measured"]`` (one direction's
    all-gathers, at the gather itemsize) for ``charge_zero3``, and ``["zero3_scatter_excess"]`` (what the
    reduce-scatters cost beyond half the all-reduce ``exposed_sync`` prices them as). On 2 gloo ranks of the
    2-core VM an in-step all-gather of 16 MiB took 0.8-0.9 of an all-reduce's time, not half. No keys, and so
    no change, where no such fit exists (presets, GPU profiles). The ILP's level-3 columns
    (``passes.intra_op_zero``) still price the halves, so the level it picks on such a cluster was chosen at the
    lower price; the plan states the measured one."""
    links = axis_links(cluster, tuple(stage.mesh_shape), stage.submesh[1])
    if not any(link.size > 1 and f"all_gather/{link.size}@step" in link.link.fits for link in links):
        return
    scale = stage.predicted.get("zero3_gather_scale", 1.0)
    gather = scatter = 0.0
    for a, nbytes in _flat_bytes_by_axis(graph, stage, bucket_bytes, (3,)):
        gather += links[a].time("all_gather", nbytes * scale)
        scatter += max(0.0, links[a].time("reduce_scatter", nbytes) - links[a].time("all_reduce", nbytes) / 2)
    if gather > 0:
        stage.predicted["zero3_gather_measured"] = gather
        stage.predicted["zero3_scatter_excess"] = scatter


def exposed_sync(sync: float, backward: float, buckets: int, gather_share: float, zero3_share: float = 0.0,
                 pair_excess: float = 0.0, overlap: float = 1.0) -> float:
    """Seconds of gradient sync the backward does not hide. Buckets of equal size become ready at
    b/K, 2b/K, ..., b (b: the last microbatch's backward, K buckets) and go out one after another, so the
    last finishes at max(b/K + s, b + s/K) (s: the sync's reduce part); what lies past b is exposed:

        exposed = max(s / K, s − b·(K − 1)/K) + g

    With ZeRO 1 or 2 a share f of the gradients is reduce-scattered (half a ring all-reduce) and the updated
    shards all-gathered after the step (the other half, g = f·sync/2), which nothing hides. At ZeRO 3 a
    share f3 is only reduce-scattered here (s loses f3·sync/2); its all-gathers are in forward and backward
    (``charge_zero3``). ``pair_excess``: what the measured pair costs beyond that all-reduce
    (``charge_zero_pair``), exposed with the gathers it runs among. ``overlap``: ``Cluster.comm_overlap``."""
    if sync <= 0:
        return 0.0
    gather = gather_share * sync / 2 + pair_excess
    s, k = sync - gather_share * sync / 2 - zero3_share * sync / 2, max(int(buckets), 1)
    reduce = max(s / k, s - backward * (k - 1) / k)
    return reduce + (1.0 - overlap) * (s - reduce) + gather
