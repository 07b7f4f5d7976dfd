"""Cost-model fidelity: the planner's predicted step time and peak memory vs measured, plan by plan.

    python benchmarks/fidelity/cost_model_fidelity.py                         # profiles the local ranks first
    python benchmarks/fidelity/cost_model_fidelity.py --cluster cluster.json  # a saved `autopar profile` result
    python benchmarks/fidelity/cost_model_fidelity.py --split                 # also time compute without collectives
    python benchmarks/fidelity/cost_model_fidelity.py --nprocs 4 --cluster local4.json   # the second figure

On N local gloo ranks (``--nprocs``, default one per core, at most 4; ``Cluster.local(N)`` semantics, numbers
from the profiled cluster file), the GPT example (CONFIG, global batch BATCH) is planned under every layout of
``benchmarks.fidelity.fidelity_plans.plans_for(N)`` (forced data and Megatron tensor parallel, the same with
recompute or ZeRO, 2-D mixes on 4 ranks, pipelines, the planner's own choices) and each plan is compiled on
every rank. One rank per core is the main figure: the cost model describes devices that each run their own
rank; with more ranks than cores the processes time-share, so an idle rank's core goes to a busy one.
Measured, in one launch with all plans interleaved round by round (so load drift
from other jobs hits every plan alike):

  * step time: [barrier; train_step + optimizer.step + zero_grad; barrier] on rank 0 (the barriers make it
    the slowest rank's time), once per plan in each of ``--steps`` timed rounds after ``--warmup`` untimed
    ones, the plans' order rotated every round; the figure is ``autopar.profiling.fidelity.round_normalized``:
    the median over rounds after dividing out each round's common speed (a burst of other jobs' load slows
    every plan of its round alike), so close plans are not reordered by when their steps happened to run
    (the raw median is kept in the JSON as meas_raw);
  * peak memory per rank: parameters, optimizer state and gradient-sync buffers allocated before the step
    (exact storage sizes; the flat gradient buffers persist across steps, so a step's allocations miss them),
    plus the peak of the running sum of every CPU allocation and free that ``torch.profiler``
    (profile_memory=True) records over one step; the largest over ranks. RSS is not used: it is
    dominated by the interpreter and the allocator's cached pages.

The cluster comes from ``autopar profile`` (``--cluster``, else profiled now), which also measures collective
fits taken with both axes of a 2-D mesh busy, the per-op host overhead and the training-matmul factor.
``--split`` also times each single-stage plan with torch.distributed's collectives replaced by local copies,
so the table shows compute and communication apart (measured comm = step - compute-only step).

Printed: one row per plan, the median absolute time error, the Spearman rank correlation of predicted
and measured time, the memory error per plan, and whether each auto plan measured no slower than the
best forced plan. Goals: median time error <= 10 %, Spearman >= 0.9, worst memory error <= 10 %.

Predictions: the table and the first verdict lines are the cost model's predictions from the cluster file,
as profiled. Every timed round also runs the profiler's own probe step (``profiler_training`` item 4, all
ranks busy), so each launch knows how fast the machine computed while it timed the plans, in the units the
profile's compute_time_scale was measured in: q = the scale that probe gives now / the cluster's. A second
set of lines re-prices every plan at that speed (``drift_corrected``: its compute scaled by q; communication
is left as profiled). On a quiet machine q is the probe's own noise (a few per cent); under other jobs' load
it is what keeps the comparison meaningful. Every round also times the profiler's reference mm (fp32 256³):
its speed is printed beside the profile's level, and a third set of lines re-prices the compute by
q_ref = its seconds now / at the level (``reference_drift``; the profile scaled every compute figure to that
level, so this asks whether the model is right at the speed the machine ran the plans at, whatever the
profile happened to sample). The goal also asks for no single-sign bias: the sign line counts plans
predicted too slow and too fast.

``--repeats N`` measures N launches one after another (the plans are compiled afresh in each): the table
shows each plan's median over launches, and each of the three figures is computed per launch and reported
as its median over launches (with its range), so that one noisy launch cannot decide it.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import autopar  # noqa: E402
from autopar.profiling.fidelity import (  # noqa: E402
    peak_allocated_bytes,
    relative_error,
    round_normalized,
)
from autopar.profiling.probe_step import REFERENCE_SIDE, TinyBlock, end_to_end_factor, probe_shape  # noqa: E402
from benchmarks.fidelity.fidelity_plans import BATCH, CONFIG, PLANS_BY_WORLD, make_plans, priced_compute  # noqa: E402
from benchmarks.fidelity.fidelity_report import (  # noqa: E402
    median_rows,
    print_auto_versus_forced,
    print_figures,
    print_table,
)
from examples.gpt import make_gpt  # noqa: E402


# ---- on every rank --------------------------------------------------------------------------------
def _state_bytes(pm, opt) -> int:
    """Bytes of what this rank holds before a step starts: parameters, optimizer state and the gradient sync's
    flat buffers (``runtime.gradsync.Bucket``: allocated once, the gradients are views of them), each storage
    once (parameters and gradients may be views of one flat buffer)."""
    held = list(pm.parameters()) + [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    for bucket in getattr(getattr(pm.runner, "gradsync", None), "buckets", ()):
        held += [t for t in (getattr(bucket, "grad_flat", None), getattr(bucket, "grad_shard", None),
                             getattr(bucket, "shard", None)) if t is not None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
    return sum(storages.values())


def _step(pm, opt, batch) -> None:
    pm.train_step(*batch)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _timed(built, batch, fake_comm: bool) -> float:
    """Seconds of one step of ``built`` = (name, module, optimizer), between two barriers."""
    _, pm, opt = built
    dist.barrier()
    start = time.perf_counter()
    with (_local_collectives() if fake_comm else contextlib.nullcontext()):
        _step(pm, opt, batch)
    dist.barrier()
    return time.perf_counter() - start


def _probe_step(window_s: float = 0.15):
    """A zero-argument call timing the profiler's own probe step (``profiler_training`` item 4: forward +
    backward of ``TinyBlock`` at ``probe_shape("cpu")``) for about ``window_s`` with every rank running it at
    once; it returns seconds per step. Timed every round, it shows how fast the machine computes then, in the
    very units the profile's compute_time_scale was measured in."""
    shape = probe_shape("cpu")
    block, x = TinyBlock(shape.width), torch.randn(shape.tokens, shape.width)
    return _all_ranks_window(lambda: block(x).backward(), window_s)


def _reference_mm(window_s: float = 0.1):
    """The profiler's reference mm (fp32 256³, ``probes.SpeedReference``) timed like ``_probe_step``: its
    seconds per call during the benchmark, beside the profile's level (the machine moved, or the profile)."""
    a, b, out = (torch.randn(REFERENCE_SIDE, REFERENCE_SIDE) for _ in range(3))
    return _all_ranks_window(lambda: torch.mm(a, b, out=out), window_s)


def _all_ranks_window(call, window_s: float):
    """A zero-argument call that runs ``call`` for about ``window_s`` on every rank at once (the same number
    of calls on each, from the slowest rank's trial) and returns this rank's seconds per call."""
    def timed() -> float:
        call()
        start = time.perf_counter()
        call()
        calls = torch.tensor([max(1.0, window_s / (time.perf_counter() - start))])
        dist.all_reduce(calls, op=dist.ReduceOp.MIN)  # every rank the same number of steps
        dist.barrier()
        start = time.perf_counter()
        for _ in range(int(calls)):
            call()
        return (time.perf_counter() - start) / int(calls)
    return timed


def _measure_rank(rank: int, plans: list[tuple[str, str]], warmup: int, steps: int, split: bool) -> dict:
    """Per plan: step times (s) over rounds, compute-only times when ``split``, and this rank's peak bytes."""
    model, batch = make_gpt(CONFIG, batch_size=BATCH)
    built = []
    for name, text in plans:
        plan = autopar.Plan.from_json(text)
        pm = autopar.compile(model, autopar.Cluster.from_dict(plan.cluster), batch, plan=plan, compile=False)
        built.append((name, pm, pm.optimizer(torch.optim.AdamW, lr=1e-4)))  # ZeRO plans step their shards
    out = {name: {"times": [], "compute": []} for name, _, _ in built}
    out["probe_step"], probe_step = [], _probe_step()
    out["reference_mm"], reference_mm = [], _reference_mm()
    for name, pm, opt in built:
        _step(pm, opt, batch)  # the first step allocates the optimizer state
        dist.barrier()
        out[name]["peak"] = _state_bytes(pm, opt) + peak_allocated_bytes(lambda: _step(pm, opt, batch))
    single = [b for b in built if len(b[1].plan.stages) == 1]  # compute-only needs no sends between stages
    for r in range(warmup + steps):
        out["probe_step"].append(probe_step())
        out["reference_mm"].append(reference_mm())
        rotated = built[r % len(built):] + built[:r % len(built)]  # no plan always runs first
        for b in rotated:
            t = _timed(b, batch, False)
            if r >= warmup:
                out[b[0]]["times"].append(t)
        for b in single if split else ():
            t = _timed(b, batch, True)
            if r >= warmup:
                out[b[0]]["compute"].append(t)
    return out


@contextlib.contextmanager
def _local_collectives():
    """Diagnostic only (``--split``): torch.distributed's SPMD collectives become local copies of the right
    shapes, so a step times its computation alone (the results are wrong; the timing is what is wanted)."""
    class Done:  # what an async collective returns: the gradient sync waits on it
        def wait(self, *args, **kwargs):
            return True

    def gather(out, inp, group=None, async_op=False):
        out.copy_(inp.repeat((out.shape[0] // inp.shape[0],) + (1,) * (inp.dim() - 1)))
        return Done()

    def scatter(out, inp, group=None, async_op=False):
        out.copy_(inp[:out.shape[0]])
        return Done()

    def copy(out, inp, group=None, async_op=False):
        out.copy_(inp)
        return Done()

    fakes = {"all_reduce": lambda t, *a, **k: Done(), "all_gather_single": gather, "all_gather_into_tensor": gather,
             "reduce_scatter_single": scatter, "reduce_scatter_tensor": scatter, "all_to_all_single": copy}
    from autopar.runtime import collectives, gradsync, zero3

    # (module, name, fake): torch.distributed's functions, and the runtime's module-level references to them
    # (``runtime.flat_collectives``' aliases, imported by name: every module holding one is listed, and a
    # missing name is an error, so a renamed reference cannot silently escape the fakes)
    patches = [(dist, k, f) for k, f in fakes.items() if hasattr(dist, k)]
    patches += [(gradsync, "reduce_scatter_flat", scatter), (gradsync, "all_gather_flat", gather),
                (zero3, "all_gather_flat", gather), (collectives, "all_gather_flat", gather),
                (collectives, "reduce_scatter_flat", scatter)]
    missing = [f"{m.__name__}.{k}" for m, k, _ in patches if not hasattr(m, k)]
    if missing:
        raise AttributeError(f"the collective fakes name references the runtime no longer has: {missing}")
    saved = [(m, k, getattr(m, k)) for m, k, _ in patches]
    try:
        for m, k, f in patches:
            setattr(m, k, f)
        yield
    finally:
        for m, k, f in saved:
            setattr(m, k, f)


# ---- in the caller --------------------------------------------------------------------------------
def load_or_profile(path: str | None, out: str, world: int) -> tuple[autopar.Cluster, str]:
    """The cluster file given, else a fresh ``world``-rank ``autopar profile`` (written to ``out``), which measures
    everything the cost model reads: isolated probes, in-mesh collective fits, op_overhead, and the
    training-matmul factor (``autopar.profiling.profiler_training``). A file without in-mesh fits predates that
    profiler: re-profile rather than plan with half the measurements."""
    if path:
        cluster = autopar.Cluster.from_json(path)
        from autopar.profiling.profiler_training import meshes_of

        if meshes_of(world) and not any("@" in key for key in cluster.intra_node.fits):
            print(f"# warning: {path} has no in-mesh collective fits (profiled before "
                  f"autopar.profiling.profiler_training); "
                  f"re-run `autopar profile --nprocs {world} --out {path}` for the full measurement", flush=True)
        return cluster, path
    print(f"# no --cluster given: profiling {world} local ranks first (writes {out})", flush=True)
    cluster = autopar.Cluster.profile(nprocs=world, progress=False)
    cluster.to_json(out)
    return cluster, out


def drift(cluster, measured: list[dict]) -> float:
    """q = the compute_time_scale the profiler's probe step gives during this launch (every rank's median
    over rounds, priced on ``cluster`` as the profiler prices it) / the cluster's own: how much slower the
    machine computed while the plans were timed than when it was profiled (1 on a steady machine). The probe
    runs here beside the probe, and the profile priced its figures beside a training step (× ρ,
    ``neighbour_level``): the probe's time is read at that level too, so q does not take ρ out again."""
    during = statistics.median(x for r in measured for x in r["probe_step"])
    return end_to_end_factor(cluster, during * neighbour_level(cluster)) / cluster.compute_time_scale


def neighbour_level(cluster) -> float:
    """ρ, the profile's compute figures' factor for a neighbour's training step (``profiler_neighbour``), as its
    source line states it; 1 in files written before the profiler measured it."""
    import re

    found = re.search(r"compute figures × ([0-9.]+), the reference's speed beside a neighbour", cluster.source)
    return float(found.group(1)) if found else 1.0


def alone_reference_seconds(parser, path: str):
    """(cluster, seconds of one reference mm at the profile's level × ρ) for a benchmark that times one process
    alone against the profile: its parts meet no neighbour, so they compare with the reference beside the
    reference, and the profile's figures are at that level × ρ. ``parser.error`` where the file states no level."""
    import autopar
    from autopar.profiling.probe_step import REFERENCE_SIDE

    cluster = autopar.Cluster.from_json(path)
    level = profile_level(cluster)
    if level is None:
        parser.error(f"{path} states no reference level (profiled before the profiler timed against a reference "
                     f"mm); re-profile with `autopar profile --out {path}`")
    return cluster, 2.0 * REFERENCE_SIDE**3 / (level * 1e9) * neighbour_level(cluster)


def profile_level(cluster) -> float | None:
    """GFLOP/s of the reference mm at the profile's median speed, as its source line states it (None in files
    written before the profiler timed against a reference)."""
    import re

    found = re.search(r"at its median speed \(([0-9.]+) GFLOP/s per rank\)", cluster.source)
    return float(found.group(1)) if found else None


def reference_line(cluster, launches: list) -> str:
    """The reference mm's speed during the benchmark (median over rounds and ranks; per round min-max) beside the
    profile's level: where both this and the probe step moved from the profile, the machine moved."""
    per_round = [statistics.median(r["reference_mm"][i] for r in measured)
                 for measured in launches for i in range(len(measured[0]["reference_mm"]))]
    rate = lambda s: 2.0 * REFERENCE_SIDE**3 / s / 1e9  # noqa: E731
    level = profile_level(cluster)
    during = rate(statistics.median(per_round))
    versus = f"{during / level:.3f} of the profile's {level:.1f}" if level else "the profile states no level"
    return (f"# reference mm fp32 {REFERENCE_SIDE}³ during the measurement: {during:.1f} GFLOP/s per rank "
            f"(rounds {rate(max(per_round)):.1f}-{rate(min(per_round)):.1f}), {versus}")


def reference_drift(cluster, measured: list[dict]) -> float | None:
    """q_ref = the reference mm's seconds during this launch (median over rounds and ranks) / its seconds at the
    profile's level: the profile scaled every compute figure to that level, so q_ref re-prices the compute at
    the speed the reference ran at while the plans were timed (None when the file states no level)."""
    level = profile_level(cluster)
    if level is None:
        return None
    during = statistics.median(x for r in measured for x in r["reference_mm"])
    return during / (2.0 * REFERENCE_SIDE**3 / (level * 1e9))


def drift_corrected(plan, q: float) -> float:
    """The plan's predicted step with its compute priced at the launch's speed: step + (q − 1) · c, c the
    busiest stage's predicted compute (kernels and host overhead, and the extra forward of recomputed layers
    over all microbatches; communication is left as profiled)."""
    return float(plan.predicted["step_time"]) + (q - 1.0) * priced_compute(plan)


def summarize(plans: dict, measured: list[dict], q: float = 1.0) -> list[dict]:
    """One row per plan: predicted (``drift_corrected`` by ``q``; as profiled: pred_profile) and measured
    time (s) and peak (bytes), and their errors."""
    rows = []
    steady = round_normalized({name: measured[0][name]["times"] for name in plans})
    for name, plan in plans.items():
        times = measured[0][name]["times"]
        row = {"plan": name, "mesh": "x".join(map(str, plan.stages[0].mesh_shape)), "stages": len(plan.stages),
               "pred_t": drift_corrected(plan, q), "pred_profile": float(plan.predicted["step_time"]),
               "meas_t": steady[name], "meas_raw": statistics.median(times), "drift": q,
               "iqr": float(np.subtract(*np.percentile(times, [75, 25]))) / statistics.median(times),
               "pred_mem": float(plan.predicted["peak_memory"]), "meas_mem": max(r[name]["peak"] for r in measured),
               "pred_compute": priced_compute(plan),
               "pred_comm": float(plan.predicted.get("comm", float("nan")))}
        row["mesh"] = row["mesh"] if len(plan.stages) == 1 else "+".join(
            "x".join(map(str, s.mesh_shape)) for s in plan.stages)
        compute = measured[0][name]["compute"]
        row["meas_compute"] = statistics.median(compute) if compute else float("nan")
        row["t_err"] = relative_error(row["pred_t"], row["meas_t"])
        row["mem_err"] = relative_error(row["pred_mem"], row["meas_mem"])
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=min(4, os.cpu_count() or 2),
                        help="local ranks (default: one per core, at most 4); plan sets exist for 2 and 4")
    parser.add_argument("--cluster", help="profiled cluster JSON of --nprocs ranks (default: profile them first)")
    parser.add_argument("--profile-out", default="cluster.json", help="where a fresh profile is written")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds before timing")
    parser.add_argument("--steps", type=int, default=9, help="timed rounds (the median is reported)")
    parser.add_argument("--split", action="store_true", help="also time every step with local stand-ins for "
                        "collectives (compute alone; diagnostic)")
    parser.add_argument("--plans", nargs="+", default=None,
                        help=f"a subset of {({w: [p.name for p in ps] for w, ps in PLANS_BY_WORLD.items()})}")
    parser.add_argument("--repeats", type=int, default=3, help="launches; figures are medians over them")
    parser.add_argument("--json", help="also write every launch's rows (as profiled and drift-corrected) here")
    args = parser.parse_args(argv)
    cluster, source = load_or_profile(args.cluster, args.profile_out, args.nprocs)
    if cluster.num_devices != args.nprocs:
        parser.error(f"{source} describes {cluster.num_devices} ranks; pass --nprocs {cluster.num_devices}")
    plans = make_plans(cluster, args.plans)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    load_before = os.getloadavg()
    start = time.perf_counter()
    launches = [autopar.launch(_measure_rank, cluster.num_devices, [(n, p.to_json()) for n, p in plans.items()],
                               args.warmup, args.steps, args.split, timeout=600) for _ in range(args.repeats)]
    print(f"# cost-model fidelity, {datetime.datetime.now().isoformat(timespec='minutes')}, GPT {CONFIG}, "
          f"batch {BATCH}, cluster {source} ({cluster.source[:60]}...)")
    print(f"# load average before {tuple(round(x, 2) for x in load_before)}, after "
          f"{tuple(round(x, 2) for x in os.getloadavg())}; {os.cpu_count()} cores; measured in "
          f"{time.perf_counter() - start:.0f} s; {args.repeats} launch(es) of {args.steps} timed rounds")
    qs = [drift(cluster, measured) for measured in launches]
    during = statistics.median(x for measured in launches for r in measured for x in r["probe_step"])
    print(f"# machine speed: the profiler's probe step with all ranks busy took {during * 1e3:.2f} ms during the "
          f"measurement, compute x {', '.join(f'{q:.3f}' for q in qs)} (per launch) of the speed the cluster file "
          f"was profiled at (compute_time_scale {cluster.compute_time_scale:.3f})")
    print(reference_line(cluster, launches))
    profiled = [summarize(plans, measured) for measured in launches]
    corrected = [summarize(plans, measured, q) for measured, q in zip(launches, qs)]
    rows = median_rows(profiled)
    print_table(rows, args.split)
    print_figures("as profiled", profiled)
    print_figures("drift-corrected (compute x " + ", ".join(f"{q:.3f}" for q in qs) + " per launch)", corrected)
    q_ref = [reference_drift(cluster, measured) for measured in launches]
    by_reference = []
    if None not in q_ref:
        by_reference = [summarize(plans, measured, q) for measured, q in zip(launches, q_ref)]
        print_figures("reference-corrected (compute x " + ", ".join(f"{q:.3f}" for q in q_ref) + " per launch)",
                      by_reference)
        print("# probe step over the reference mm, during the measurement over as profiled (drift / reference "
              "drift; other jobs' load moves both and cancels): " + ", ".join(f"{q / r:.3f}" for q, r in zip(qs, q_ref))
              + " per launch")
    print_auto_versus_forced(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"profiled": profiled, "corrected": corrected, "drift": qs, "cluster": source,
                       "reference_corrected": by_reference, "reference_drift": q_ref,
                       "load_before": load_before, "load_after": os.getloadavg()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
