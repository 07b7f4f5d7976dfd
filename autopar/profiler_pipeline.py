r"""Item 5 of the profiler's training conditions: the pipeline runtime's host time per (chunk, microbatch).

    per rank: measure_pipeline(settings, probe) -> raw seconds        (inside the profiler's launch)
    caller:   microbatch_overhead(cluster, per_rank) -> (c seconds, note)

The pipeline runtime (``runtime.pipeline``, ``runtime.interleaved``) runs Python per microbatch of each
stage beyond the ops of the stage's graph, which ``op_overhead`` prices: it slices the microbatch, posts
sends and receives, calls the generated module, and autograd does its bookkeeping. Method, with W >= 2
ranks: ``autopar.compile`` plans a chain of 2·W tiny linear layers (width 8, so kernels cost ~nothing) as
W one-device stages under 1F1B, once at M₁ = W and once at M₂ = 4·W microbatches, and every rank times
``train_step`` of both, alternating in rounds (drift hits both alike); a point is the median over rounds,
then over ranks. The slope s = (t(M₂) − t(M₁)) / (M₂ − M₁) is what one more microbatch costs.

The cost model's own prediction of that slope is the schedule replay of ``plan_builder.predict``:

    s_pred(c) = (makespan(M₂, c) − makespan(M₁, c)) / (M₂ − M₁),
    makespan(M, c) = ``simulate_schedule``(f_s + c, b_s + c, M, 1f1b, hop)

with f_s = n_s · op_overhead / 3 and b_s = 2 · n_s · op_overhead / 3, n_s the stage's op calls per
microbatch as the cost model counts them (the plan is compiled on a cluster whose op_overhead is 1 s and
whose kernels are ~free, so a stage's predicted latency is n_s), and hop half of the slowest transfer's
2·α + rank bytes / β on the profiled link, as ``plan_builder.transfers_between`` prices it. s_pred is
linear in c (with slope k = 2 when one stage sets the cycle: its forward and backward of each microbatch),
so c = max(0, (s − s_pred(0)) / k): the host time per (chunk, microbatch) and direction that the model
misses. One rank has no pipeline: c stays 0 and the cluster's source says so.

On GPUs the same probe runs with the device's backend and is timed with CUDA events; its kernels are
~free, so the window is the host's time, and the cost model adds c to the stages' forward and backward
as on CPU ranks (``plan_builder``'s docstring: exact for host-bound stages, an upper bound where queued
kernels hide it).
"""
from __future__ import annotations

import dataclasses
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from autopar.cluster import Cluster
from autopar.ir.schedule import simulate_schedule

WIDTH, LAYERS_PER_STAGE, ROUND_STEPS, WARMUP_STEPS = 8, 2, 3, 2


class Chain(nn.Module):
    """``layers`` linear layers of width ``WIDTH`` with GELU, the sum as the loss: kernels cost ~nothing."""

    def __init__(self, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = F.gelu(block(x))
        return x.sum()


def microbatch_counts(world: int) -> tuple[int, int]:
    """(M₁, M₂): the two microbatch counts the W-stage probe pipeline is timed at."""
    return world, 4 * world


def _unit_cluster(world: int, probe) -> Cluster:
    """``Cluster.local(world)`` on the probe's device with op_overhead 1 s: a stage's predicted latency then
    counts its op calls per microbatch (module docstring)."""
    return dataclasses.replace(Cluster.local(world), op_overhead=1.0, **probe.cluster_fields())


def measure_pipeline(settings, probe) -> dict | None:
    """This rank's {"counts": (M₁, M₂), "seconds": {M: median step s}, "calls": [n_s], "rank_bytes": [...]},
    or None with one rank. Every rank calls it together."""
    import autopar

    world = dist.get_world_size()
    if world < 2:
        return None
    counts, cluster = microbatch_counts(world), _unit_cluster(world, probe)
    x = torch.randn(counts[1], WIDTH, device=probe.torch)
    modules = {}
    for m in counts:
        torch.manual_seed(0)
        model = Chain(LAYERS_PER_STAGE * world).to(probe.torch)
        modules[m] = autopar.compile(model, cluster, (x,), stages=world, microbatches=m, schedule="1f1b")
        for _ in range(WARMUP_STEPS):
            modules[m].train_step(x)
    times: dict[int, list[float]] = {m: [] for m in counts}
    for _ in range(2 * settings.windows):
        for m in counts:
            dist.barrier()
            times[m].append(probe.window_seconds(lambda m=m: modules[m].train_step(x), ROUND_STEPS) / ROUND_STEPS)
    plan = modules[counts[0]].plan
    return {"counts": counts, "seconds": {m: statistics.median(t) for m, t in times.items()},
            "calls": [s.predicted["latency"] for s in plan.stages],
            "rank_bytes": [t["rank_bytes"] for t in plan.transfers]}


# ---- in the caller --------------------------------------------------------------------------------
def predicted_slope(cluster: Cluster, calls: list[float], rank_bytes: list[float], counts, c: float) -> float:
    """s_pred(c) of the module docstring: seconds per extra microbatch of the probe pipeline, as predicted."""
    link = cluster.intra_node
    hop = max((2 * link.latency + b / link.bandwidth_for(2) for b in rank_bytes), default=0.0) / 2
    f = [n * cluster.op_overhead / 3 + c for n in calls]
    b = [2 * n * cluster.op_overhead / 3 + c for n in calls]
    span = [max(op.end for op in simulate_schedule(f, b, m, "1f1b", hop)) for m in counts]
    return (span[1] - span[0]) / (counts[1] - counts[0])


def microbatch_overhead(cluster: Cluster, per_rank: list[dict]) -> tuple[float, str]:
    """(c, a note for the cluster's source): c = max(0, (s − s_pred(0)) / k) (module docstring)."""
    data = [r["pipeline"] for r in per_rank if r.get("pipeline")]
    if not data:
        return 0.0, "microbatch_overhead not measured (one rank: no pipeline to time), 0"
    first = data[0]
    counts = tuple(first["counts"])
    seconds = [statistics.median(d["seconds"][m] for d in data) for m in counts]
    slope = (seconds[1] - seconds[0]) / (counts[1] - counts[0])
    args = (cluster, first["calls"], first["rank_bytes"], counts)
    base, probe_c = predicted_slope(*args, 0.0), 1e-3
    k = (predicted_slope(*args, probe_c) - base) / probe_c
    c = max(0.0, (slope - base) / k)
    return c, (f"microbatch_overhead {c * 1e6:.0f} µs per (chunk, microbatch) and direction from a "
               f"{len(first['calls'])}-stage pipeline at {counts[0]} and {counts[1]} microbatches "
               f"({slope * 1e3:.2f} ms per microbatch measured, {base * 1e3:.2f} predicted without it)")
