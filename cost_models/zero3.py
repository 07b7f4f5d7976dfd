"""ZeRO-3's terms: the all-gathers compute does not hide (prefetch), and the units gathered at once.

What the runtime does (``runtime.zero3``): a stage's level-3 parameters are U units (its level-3 sync
buckets); in forward unit k+1's all-gather is in flight while unit k's ops run, and in backward the same in
reverse order, at most two units held at once. Parameters are gathered in the gather dtype: the precision
policy's compute dtype when it has one (FSDP2's ``param_dtype``), else their own.

Gathers, per microbatch and direction (forward, backward apart). With g the direction's gather seconds (all
its units' all-gathers) and c its compute, U equal units gathered and computed in turn end at
max(g/U + c, g + c/U), so compute hides all but

    exposed(g, c, U) = g/U + max(0, g·(U−1)/U − c·(U−1)/U) = max(g/U, g − c·(U−1)/U)

(the first unit's gather precedes any compute; the others hide behind the units before them). Where the
cluster measured that compute hides only a share ω of a collective beside it (``Cluster.comm_overlap``, CPU
ranks: gloo's threads share the cores), exposed_ω = exposed + (1 − ω)·(g − exposed). The plan
(``plan_builder.charge_zero3``) prices each direction so: g = f3 · s/2 · r, with s the stage's gradient
all-reduce seconds (``grad_sync``, at the parameters' bytes), f3 the level-3 share of its elements (an
all-gather moves half a ring all-reduce) and r = gather itemsize / parameter itemsize (1/2 for fp32 weights
gathered in bf16); c = the stage's forward (backward) seconds per microbatch before its gathers.

In the ILP (``passes.intra_op_zero``) a level-3 twin column sees only its own group: the all-gather seconds
g_i of its parameters (at the gather dtype) and the compute c_i of its ops per microbatch, forward c_i/3 and
backward 2c_i/3 (the plan's split). It is charged, per microbatch,

    e_i = max(0, g_i − c_i/3) + max(0, g_i − 2c_i/3)                                   (``group_exposed``)

a sound per-group approximation: since Σ_i max(0, x_i) ≥ max(0, Σ_i x_i) and the stage's compute c includes
every group's, Σ_i max(0, g_i − c_i,dir) ≥ max(0, g − c) ≥ exposed(g, c, U) − g/U in each direction. The
columns' sum bounds from above what the plan charges less the first unit's gather (g/U per direction,
one unit's all-gather whatever the layout), which ``charge_zero3`` adds when it replaces the ILP's sum by
the exact formula. Not modelled: the gathers share the data-parallel links with the gradient
reduce-scatter that hides behind the last microbatch's backward (``exposed_sync``); each is priced as if
it had the link to itself.

Memory: the most bytes of units held at once in forward (``zero3_transient``): each unit its padded flat
buffer at the gather itemsize, held from its prefetch (``ir.buckets.prefetch_spans``) to its last read; a
run of consecutive ops of one recomputed region is one call of the generated module and shares one
position. The runtime measures exactly this (its backward prefetch stays within it).
"""
from __future__ import annotations

import numpy as np
import torch

from autopar.ir.buckets import padded_numel, peak_gathered, prefetch_spans, unit_spans
from autopar.ir.recompute import region_keys


def exposed_gather(gather: float, compute: float, units: int, overlap: float = 1.0) -> float:
    """Seconds of ``gather`` (one direction's all-gathers of ``units`` prefetched units) that ``compute``
    beside them does not hide (module docstring); ``overlap`` (``Cluster.comm_overlap``): the share of the
    hideable part that running beside compute really hides."""
    if gather <= 0:
        return 0.0
    u = max(int(units), 1)
    exposed = max(gather / u, gather - compute * (u - 1) / u)
    return exposed + (1.0 - overlap) * (gather - exposed)


def group_exposed(gather, compute):
    """The ILP's per-group charge per microbatch, forward and backward together (module docstring):
    ``gather`` the group's all-gather seconds, ``compute`` its forward + backward compute per microbatch
    (floats or arrays of columns)."""
    return np.maximum(0.0, gather - compute / 3) + np.maximum(0.0, gather - 2 * compute / 3)


def gather_itemsize(param_dtype: torch.dtype, compute_dtype: torch.dtype | None) -> int:
    """Bytes per element a level-3 unit gathers: the compute dtype's when the policy has one."""
    return (compute_dtype or param_dtype).itemsize


def zero3_units(graph, stage, buckets: list[dict], compute_dtype: torch.dtype | None, node_layers: dict) -> dict:
    """The plan's ZeRO-3 figures for ``stage`` with sync ``buckets`` (``plan_builder.stage_sync_buckets``):
    {"zero3_units": U, "zero3_gather_scale": r, "zero3_transient": bytes} (empty without level-3 units)."""
    units = [b for b in buckets if b["level"] == 3]
    if not units:
        return {}
    dtypes = {p.name: p.dtype for p in graph.placeholders}
    param_dtype = dtypes[units[0]["names"][0]]
    itemsize = gather_itemsize(param_dtype, compute_dtype)
    return {"zero3_units": float(len(units)), "zero3_gather_scale": itemsize / param_dtype.itemsize,
            "zero3_transient": zero3_transient(graph, stage, units, node_layers, itemsize)}


def zero3_transient(graph, stage, units: list[dict], node_layers: dict, itemsize: int) -> float:
    """Peak bytes of level-3 ``units`` held at once in forward (module docstring)."""
    unit_of = {name: k for k, b in enumerate(units) for name in b["names"]}
    regions = region_keys(graph, node_layers, stage.recompute) if stage.recompute else {}
    order, position, previous = {}, -1, None
    for node in graph.gm.graph.nodes:
        key = regions.get(node.name)
        position += 0 if key is not None and key == previous else 1
        order[node], previous = position, key
    spans = {k: (order[a], order[b]) for k, (a, b) in unit_spans(graph.gm.graph, unit_of, "placeholder").items()}
    nbytes = {k: padded_numel(b["numel"], b["ways"], 3) * itemsize for k, b in enumerate(units)}
    return peak_gathered(prefetch_spans(spans), nbytes)


def unit_bytes(numel: float, floor_numel: float, itemsize: int) -> float:
    """The ILP's two gathered units: 2 · max(the parameter's local elements, a bucket's) at the gather
    itemsize (``passes.intra_op_zero``)."""
    return 2.0 * max(numel, floor_numel) * itemsize if numel > 0 else 0.0


def bucket_numel(bucket_bytes: float, total_numel: float) -> float:
    """Elements of one sync bucket: ``bucket_bytes`` at 4 bytes each (``ir.buckets.sync_buckets``'s cap),
    or every parameter in scope if fewer."""
    return min(bucket_bytes / 4, total_numel)
