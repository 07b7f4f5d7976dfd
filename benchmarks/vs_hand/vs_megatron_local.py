"""Measured: autopar's plan against the hand-written Megatron-style layouts on 4 local gloo ranks.

    python benchmarks/vs_megatron.py --local [--cluster cluster.json] [--rounds 5] [--steps 3]

One ``autopar.launch`` of 4 ranks builds every hand layout of ``benchmarks/megatron_baselines.py`` (DP4, TP4,
DP2xTP2, PP2xDP2, PP2xTP2, PP4; pipelines with ``HAND_MICROBATCHES``) and ``autopar.compile`` of the same
GPT on the profiled cluster, all from the same weights. Then, after ``WARMUP`` untimed steps each, it runs
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

WORLD = 4
LOCAL_GPT = GPTConfig(vocab_size=1024, seq_len=64, n_layer=4, n_head=8, n_embd=128)
BATCH = 16
HAND_LAYOUTS = ("DP4", "TP4", "DP2xTP2", "PP2xDP2", "PP2xTP2", "PP4")
HAND_MICROBATCHES = 4
WARMUP = 2
CLUSTER_FILE = os.path.join(report.RESULTS, "local4_cluster.json")


def local_cluster(path: str | None) -> autopar.Cluster:
    """The given cluster file, the saved one, or a fresh profile (saved for the next run)."""
    if path is not None:
        return autopar.Cluster.from_json(path)
    if os.path.exists(CLUSTER_FILE):
        return autopar.Cluster.from_json(CLUSTER_FILE)
    print(f"profiling this machine as {WORLD} gloo ranks (once; saved to {CLUSTER_FILE})", file=sys.stderr)
    cluster = autopar.Cluster.profile(WORLD)
    os.makedirs(report.RESULTS, exist_ok=True)
    cluster.to_json(CLUSTER_FILE)
    return cluster


def build_runners(cluster: autopar.Cluster) -> tuple[dict, str]:
    """{layout name: (step fn, optimizer)} for every hand layout and autopar, from the same weights;
    and autopar's plan in words. Collective: every rank calls it."""
    from benchmarks.vs_hand.vs_megatron import describe_plan
    from examples.megatron_baselines import LAYOUTS, build

    model, batch = make_gpt(LOCAL_GPT, batch_size=BATCH)
    runners = {}
    for name in HAND_LAYOUTS:
        hp = build(LAYOUTS[name], copy.deepcopy(model), batch, microbatches=HAND_MICROBATCHES)
        runners[name] = (hp.train_step, torch.optim.AdamW(hp.parameters(), lr=1e-4))
    pm = autopar.compile(copy.deepcopy(model), cluster, batch)
    runners["autopar"] = (pm.train_step, torch.optim.AdamW(pm.parameters(), lr=1e-4))
    return runners, describe_plan(pm.plan)


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
    from examples.megatron_baselines import LAYOUTS

    model, batch = make_gpt(LOCAL_GPT, batch_size=BATCH)
    graph, recapture = capture_once(model, batch)
    out = {}
    for name in HAND_LAYOUTS:
        layout = LAYOUTS[name]
        config = MegatronConfig(dp=layout.dp, tp=layout.tp, pp=layout.pp,
                                microbatches=HAND_MICROBATCHES if layout.pp > 1 else 1)
        out[name] = score_config(graph, cluster, config, LOCAL_GPT.n_layer, recapture).step_time
    out["autopar"] = float(autopar.plan(model, cluster, batch).predicted["step_time"])
    return out


def quartiles(samples: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(samples, n=4) if len(samples) > 1 else [samples[0]] * 3
    return q[0], statistics.median(samples), q[2]


def measure(cluster_path: str | None, rounds: int = 5, steps: int = 3) -> int:
    cluster = local_cluster(cluster_path)
    predicted = predicted_times(cluster)
    load_before = os.getloadavg()
    start = time.perf_counter()
    result = autopar.launch(measure_rank, WORLD, cluster, rounds, steps, timeout=900.0)[0]
    wall = time.perf_counter() - start
    header = report.machine_line("autopar vs hand-written layouts, measured on 4 local gloo ranks")
    stats = {name: quartiles(samples) for name, samples in result["times"].items()}
    best_hand = min((n for n in stats if n != "autopar"), key=lambda n: stats[n][1])
    speedup = stats[best_hand][1] / stats["autopar"][1]
    rows = [[name + (f" ({result['plan']})" if name == "autopar" else ""), f"{1e3 * med:.1f}",
             f"{1e3 * lo:.1f} – {1e3 * hi:.1f}", f"{stats[best_hand][1] / med:.2f}",
             f"{1e3 * predicted[name]:.1f}" if predicted.get(name) else "OOM"]
            for name, (lo, med, hi) in sorted(stats.items(), key=lambda kv: kv[1][1])]
    table = report.markdown_table(["layout", "median step ms", "quartiles ms", "best hand / this (speedup)",
                                   "predicted ms (cost model)"], rows)
    context = (f"GPT {LOCAL_GPT} (batch {BATCH}); hand pipelines use {HAND_MICROBATCHES} microbatches; "
               f"{rounds} rounds × {steps} steps per layout after {WARMUP} warm-up steps, round-robin; cluster "
               f"{cluster.name!r} ({cluster.source}); load average before {load_before[0]:.1f}, after "
               f"{os.getloadavg()[0]:.1f}; wall {wall:.0f} s.")
    summary = report.summary_line([(f"local-4 vs {best_hand}", speedup)])
    text = "\n\n".join([header, context, table, summary])
    print(text)
    path = report.write_results("local", text, {"times": result["times"], "plan": result["plan"],
                                                "predicted": predicted})
    names = [n for n, _ in sorted(stats.items(), key=lambda kv: kv[1][1])]
    chart = report.step_time_chart("local", names, [stats[n][1] for n in names],
                                   [(stats[n][0], stats[n][2]) for n in names],
                                   "measured step time on 4 gloo ranks (lower is better)")
    print(f"\nwrote {path} and {chart}")
    print(summary)
    return 0
