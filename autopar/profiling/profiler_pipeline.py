r"""Item 5 of the profiler's training conditions: the pipeline runtime's host time per (chunk, microbatch).

    per rank: measure_pipeline(settings, probe, reference) -> raw figures   (inside the profiler's launch)
    caller:   microbatch_overhead(cluster, per_rank) -> (c seconds, note)

The pipeline runtime (``runtime.pipeline``, ``runtime.interleaved``) runs Python per microbatch of each
stage beyond the ops of the stage's graph, which ``op_overhead`` prices: it slices the microbatch, posts
sends and receives, calls the generated module, and autograd does its bookkeeping. Method, with W >= 2
ranks: ``autopar.compile`` plans a chain of 2·W tiny linear layers (width 8, so kernels cost ~nothing) as
W one-device stages under 1F1B, once at M₁ = W and once at M₂ = 4·W microbatches, and every rank times
``train_step`` of both in the CPU seconds its process spends (``time.process_time``: its threads' work,
gloo's included, not the time it waits for its peers or for a core). On CPU ranks each count is timed
like every compute probe (``probes.SpeedReference.measure`` with cpu=True): windows between reference-mm
windows, also in CPU seconds, the median ratio, more windows where the ratios spread wide; ratio × the
profile's level puts cpu(M) in wall seconds at the profile's reference speed, the units op_overhead is
measured in. On GPUs (whose reference is device time) a point is the median over rounds alternating the
two counts. Rank r runs one stage, so its slope

    s_r = (cpu(M₂) − cpu(M₁)) / (M₂ − M₁) = n_r · op_overhead + 2c

is one forward and one backward of its stage: n_r op calls as the cost model counts them (the plan is
compiled on a cluster whose op_overhead is 1 s and whose kernels are ~free, so the stage's predicted
latency is n_r) and the runtime's c in each direction. c = median over ranks of max(0, (s_r − n_r ·
op_overhead) / 2). Waits are left out on purpose: the schedule replay prices transfers and dependencies,
and a rank's host work, unlike its waits, does not overlap its compute on a CPU rank. (Plain CPU seconds
against op_overhead's wall-clock rate read c low on a loaded machine; scaled to the level, both are in the
same units.) One rank has no pipeline: c stays 0 and the cluster's source says so.

On GPUs the same probe runs with the device's backend; the process's CPU seconds are the host's work
(the tiny kernels run while the host is still issuing), and the cost model adds c to the stages' forward
and backward as on CPU ranks (``plan_builder``'s docstring: exact for host-bound stages, an upper bound
where queued kernels hide it).
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from autopar.hardware.cluster import Cluster

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


def measure_pipeline(settings, probe, reference=None) -> dict | None:
    """This rank's {"counts": (M₁, M₂), "cpu": {M: CPU per step}, "calls": n_r, ...}, or None with one rank.
    Every rank calls it together.

    With ``reference`` (a ``probes.SpeedReference``) on CPU ranks, each count's step is timed the way every
    compute probe is: windows between reference windows, both in CPU seconds, median ratio, more windows
    where the ratios spread wide; "cpu" is then in reference units ("units": "reference", turned into
    seconds at the profile's level by ``profiler_training.training_seconds``), "cpu_raw" the raw CPU seconds
    and "timings" the ``probes.Timing`` of each count. Without one (GPUs: the reference is device time, not
    host time), "cpu" and "wall" are median seconds over rounds alternating the two counts."""
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
        modules[m] = autopar.compile(model, cluster, (x,), stages=world, microbatches=m, schedule="1f1b",
                                     compile=False)  # the eager runtime's host time, what it prices
        for _ in range(WARMUP_STEPS):
            modules[m].train_step(x)
    (stage,) = modules[counts[0]].plan.stages_of_rank(dist.get_rank())
    out = {"counts": counts, "calls": stage.predicted["latency"]}
    if reference is not None and probe.kind == "cpu":
        timings = {m: reference.measure(lambda m=m: modules[m].train_step(x), settings, settings.probe_window_s,
                                        cpu=True) for m in counts}
        return dict(out, units="reference", cpu={m: t.ratio for m, t in timings.items()},
                    cpu_raw={m: t.seconds for m, t in timings.items()}, timings=timings)
    cpu: dict[int, list[float]] = {m: [] for m in counts}
    wall: dict[int, list[float]] = {m: [] for m in counts}
    for _ in range(2 * settings.windows):
        for m in counts:
            dist.barrier()
            start = time.process_time()
            wall[m].append(probe.window_seconds(lambda m=m: modules[m].train_step(x), ROUND_STEPS) / ROUND_STEPS)
            cpu[m].append((time.process_time() - start) / ROUND_STEPS)
    return dict(out, cpu={m: statistics.median(t) for m, t in cpu.items()},
                wall={m: statistics.median(t) for m, t in wall.items()})


# ---- in the caller --------------------------------------------------------------------------------
def _slope(points: dict, counts) -> float:
    return (points[counts[1]] - points[counts[0]]) / (counts[1] - counts[0])


def microbatch_overhead(cluster: Cluster, per_rank: list[dict]) -> tuple[float, str]:
    """(c, a note for the cluster's source): the median over ranks of max(0, (s_r − n_r · op_overhead) / 2)
    (module docstring)."""
    data = [r["pipeline"] for r in per_rank if r.get("pipeline")]
    if not data:
        return 0.0, "microbatch_overhead not measured (one rank: no pipeline to time), 0"
    counts = tuple(data[0]["counts"])
    cpu = [_slope(d["cpu"], counts) for d in data]
    ops = [d["calls"] * cluster.op_overhead for d in data]
    c = statistics.median(max(0.0, (s - o) / 2) for s, o in zip(cpu, ops))
    if "wall" in data[0]:
        other = f"{statistics.median(_slope(d['wall'], counts) for d in data) * 1e3:.2f} ms of wall clock"
    else:
        raw = statistics.median(_slope(d["cpu_raw"], counts) for d in data)
        other = f"{raw * 1e3:.2f} ms of CPU as timed, before scaling to the reference's level"
    return c, (f"microbatch_overhead {c * 1e6:.0f} µs per (chunk, microbatch) and direction from a "
               f"{len(data)}-stage pipeline at {counts[0]} and {counts[1]} microbatches (per microbatch and "
               f"stage: {statistics.median(cpu) * 1e3:.2f} ms of CPU, {statistics.median(ops) * 1e3:.2f} of it "
               f"its ops; {other})")
