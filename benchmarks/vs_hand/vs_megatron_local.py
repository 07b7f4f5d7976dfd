"""Measured: autopar's plan against the hand-written Megatron-style layouts on N local gloo ranks.

    python benchmarks/vs_hand/vs_megatron.py --local --nprocs 2 [--cluster cluster.json] [--rounds 5] [--steps 3]
    python benchmarks/vs_hand/vs_megatron.py --local --nprocs 4

One ``autopar.launch`` of N ranks builds every hand layout of ``examples/megatron_baselines.py`` with
pp·dp·tp = N (``hand_layouts``: DP2, TP2, PP2 on 2 ranks; DP4, TP4, DP2xTP2, PP2xDP2, PP2xTP2, PP4 on 4;
pipelines with ``HAND_MICROBATCHES``), each also with Megatron's full activation recompute ("+rc"), and
``autopar.compile`` of the same GPT on the profiled cluster, with its default recompute="auto" and with
recompute="full" ("autopar+rc"), all from the same weights. Run as many ranks as the machine has cores for
the main figure: with more ranks than cores the processes time-share, so a pipeline's idle ranks hand their
core to the busy ones, which the cost model (every rank busy at once) does not describe.

Then, after ``WARMUP`` untimed steps each, it runs
``rounds`` rounds, each visiting every layout in turn (round-robin, so a burst of load from other jobs on the
machine hits all layouts alike) for ``steps`` timed steps. A step is train_step + AdamW step + zero_grad,
between two barriers, so it lasts as long as its slowest rank. Reported: the median step time of each
layout over its rounds × steps samples, its quartiles, and autopar's speedup over the best hand layout
(best-hand median / autopar median: > 1 means autopar is faster), and beside it every layout's step time
as autopar's cost model predicts it (the hand layouts expressed as Megatron configs, ``megatron_configs``).

The cluster file: ``--cluster``, else ``benchmarks/results/local4_cluster.json`` when present, else it is
profiled now (``autopar.Cluster.profile(4)``, which includes the training-condition measurements: in-mesh
collective fits, the per-op host overhead, the training-matmul factor) and saved there.

GPT config (``LOCAL_GPT``): big enough that a step takes tens of ms or more on these ranks, where per-op
host overheads no longer dominate, and small enough that the whole run takes a few minutes.
"""
from __future__ import annotations

import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import autopar  # noqa: E402
from benchmarks.vs_hand import vs_megatron_report as report  # noqa: E402
from examples.gpt import GPTConfig, make_gpt  # noqa: E402

LOCAL_GPT = GPTConfig(vocab_size=1024, seq_len=64, n_layer=4, n_head=8, n_embd=128)
BATCH = 16
HAND_MICROBATCHES = 4
WARMUP = 2
RECOMPUTE = "+rc"  # name suffix of a layout run with full activation recompute


def hand_layouts(world: int) -> dict[str, object]:
    """{name: Layout} for every pp·dp·tp = world with pp dividing the blocks and tp the heads; names list the
    degrees above 1 in (pp, dp, tp) order ("PP2xDP2", "TP4")."""
    from examples.megatron_baselines import Layout

    out = {}
    for pp in [p for p in range(1, world + 1) if world % p == 0 and LOCAL_GPT.n_layer % p == 0]:
        for tp in [t for t in range(1, world // pp + 1) if (world // pp) % t == 0 and LOCAL_GPT.n_head % t == 0]:
            dp = world // (pp * tp)
            name = "x".join(f"{axis}{n}" for axis, n in (("PP", pp), ("DP", dp), ("TP", tp)) if n > 1) or "single"
            out[name] = Layout(pp=pp, dp=dp, tp=tp)
    return out


def cluster_file(world: int) -> str:
    return os.path.join(report.RESULTS, f"local{world}_cluster.json")


def local_cluster(path: str | None, world: int) -> autopar.Cluster:
    """The given cluster file, the saved one, or a fresh profile (saved for the next run)."""
    if path is not None:
        return autopar.Cluster.from_json(path)
    saved = cluster_file(world)
    if os.path.exists(saved):
        return autopar.Cluster.from_json(saved)
    print(f"profiling this machine as {world} gloo ranks (once; saved to {saved})", file=sys.stderr)
    cluster = autopar.Cluster.profile(world)
    os.makedirs(report.RESULTS, exist_ok=True)
    cluster.to_json(saved)
    return cluster


def build_runners(cluster: autopar.Cluster) -> tuple[dict, dict]:
    """{layout name: (step fn, optimizer)} for every hand layout (with and without recompute) and autopar
    (recompute "auto" and "full"), from the same weights; and autopar's plans in words. Collective."""
    from examples.megatron_baselines import build

    model, batch = make_gpt(LOCAL_GPT, batch_size=BATCH)
    runners = {}
    for name, layout in hand_layouts(cluster.num_devices).items():
        for suffix, recompute in (("", False), (RECOMPUTE, True)):
            hp = build(layout, copy.deepcopy(model), batch, microbatches=HAND_MICROBATCHES, recompute=recompute)
            runners[name + suffix] = (hp.train_step, torch.optim.AdamW(hp.parameters(), lr=1e-4))
    plans = {}
    for name, recompute in (("autopar", "auto"), ("autopar" + RECOMPUTE, "full")):
        pm = autopar.compile(copy.deepcopy(model), cluster, batch, recompute=recompute)
        runners[name] = (pm.train_step, torch.optim.AdamW(pm.parameters(), lr=1e-4))
        plans[name] = report.describe_plan(pm.plan)
    return runners, plans


def timed_step(step, optimizer, batch) -> float:
    """Seconds of one training step of the slowest rank (barriers on both sides)."""
    dist.barrier()
    start = time.perf_counter()
    step(*batch)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    return time.perf_counter() - start


def measure_rank(rank: int, cluster: autopar.Cluster, rounds: int, steps: int) -> dict:
    """Every rank: warm up every layout, then ``rounds`` round-robin rounds of ``steps`` timed steps each."""
    runners, plan_text = build_runners(cluster)
    _, batch = make_gpt(LOCAL_GPT, batch_size=BATCH)
    for step, optimizer in runners.values():
        for _ in range(WARMUP):
            timed_step(step, optimizer, batch)
    times = {name: [] for name in runners}
    for _ in range(rounds):
        for name, (step, optimizer) in runners.items():
            times[name] += [timed_step(step, optimizer, batch) for _ in range(steps)]
    return {"times": times, "plan": plan_text}


def predicted_times(cluster: autopar.Cluster) -> dict[str, float | None]:
    """autopar's cost-model step time of every measured layout: each hand layout as the Megatron config it
    is (``megatron_configs``), and autopar's own plan. Shows whether a miss comes from the cost model's
    ranking of the layouts (prediction error) or from the planner's search (a better layout it did not find)."""
    from autopar.baselines.megatron_configs import MegatronConfig, capture_once, score_config

    model, batch = make_gpt(LOCAL_GPT, batch_size=BATCH)
    graph, recapture = capture_once(model, batch)
    out = {}
    for name, layout in hand_layouts(cluster.num_devices).items():
        for suffix, recompute in (("", "none"), (RECOMPUTE, "full")):
            config = MegatronConfig(dp=layout.dp, tp=layout.tp, pp=layout.pp, recompute=recompute,
                                    microbatches=HAND_MICROBATCHES if layout.pp > 1 else 1)
            out[name + suffix] = score_config(graph, cluster, config, LOCAL_GPT.n_layer, recapture).step_time
    for name, recompute in (("autopar", "auto"), ("autopar" + RECOMPUTE, "full")):
        out[name] = float(autopar.plan(model, cluster, batch, recompute=recompute).predicted["step_time"])
    return out


def quartiles(samples: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(samples, n=4) if len(samples) > 1 else [samples[0]] * 3
    return q[0], statistics.median(samples), q[2]


def measure(cluster_path: str | None, rounds: int = 5, steps: int = 3, world: int = 2) -> int:
    cluster = local_cluster(cluster_path, world)
    if cluster.num_devices != world:
        raise SystemExit(f"the cluster file has {cluster.num_devices} devices; pass --nprocs {cluster.num_devices} "
                         f"or a cluster of {world}")
    predicted = predicted_times(cluster)
    load_before = os.getloadavg()
    start = time.perf_counter()
    result = autopar.launch(measure_rank, world, cluster, rounds, steps, timeout=900.0)[0]
    wall = time.perf_counter() - start
    header = report.machine_line(f"autopar vs hand-written layouts, measured on {world} local gloo ranks")
    stats = {name: quartiles(samples) for name, samples in result["times"].items()}
    best_hand = min((n for n in stats if not n.startswith("autopar")), key=lambda n: stats[n][1])
    speedup = stats[best_hand][1] / stats["autopar"][1]
    plans = result["plan"]
    rows = [[name + (f" ({plans[name]})" if name in plans else ""), f"{1e3 * med:.1f}",
             f"{1e3 * lo:.1f} – {1e3 * hi:.1f}", f"{stats[best_hand][1] / med:.2f}",
             f"{1e3 * predicted[name]:.1f}" if predicted.get(name) else "OOM"]
            for name, (lo, med, hi) in sorted(stats.items(), key=lambda kv: kv[1][1])]
    table = report.markdown_table(["layout", "median step ms", "quartiles ms", "best hand / this (speedup)",
                                   "predicted ms (cost model)"], rows)
    context = (f"GPT {LOCAL_GPT} (batch {BATCH}); hand pipelines use {HAND_MICROBATCHES} microbatches; "
               f"{rounds} rounds × {steps} steps per layout after {WARMUP} warm-up steps, round-robin; cluster "
               f"{cluster.name!r} ({cluster.source}); load average before {load_before[0]:.1f}, after "
               f"{os.getloadavg()[0]:.1f}; wall {wall:.0f} s.")
    summary = report.summary_line([(f"local-{world} vs {best_hand}", speedup)])
    text = "\n\n".join([header, context, table, summary])
    print(text)
    path = report.write_results(f"local{world}", text, {"times": result["times"], "plan": result["plan"],
                                                "predicted": predicted})
    names = [n for n, _ in sorted(stats.items(), key=lambda kv: kv[1][1])]
    chart = report.step_time_chart(f"local{world}", names, [stats[n][1] for n in names],
                                   [(stats[n][0], stats[n][2]) for n in names],
                                   f"measured step time on {world} gloo ranks (lower is better)")
    print(f"\nwrote {path} and {chart}")
    print(summary)
    return 0
