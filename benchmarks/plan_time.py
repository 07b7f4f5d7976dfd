"""Plan time for Alpa's GPT suite on simulated GPU clusters (models on the meta device: no memory needed).

    python benchmarks/plan_time.py                      (or ./run.sh bench plan_time)
    python benchmarks/plan_time.py --cluster p3.16xlarge --points 1.3B:4 39B:64

Each point is Alpa's weak-scaling pairing of a model with a GPU count (1.3B on 4 GPUs ... 39B on 64).
Columns: capture (torch.export) and plan (everything after it) in seconds, the predicted step time and
peak memory per device. A benchmark prints a table; it is never a test with a time limit.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.driver import PlanOptions, plan_graph  # noqa: E402
from autopar.errors import InfeasibleError  # noqa: E402
from autopar.passes.capture import capture  # noqa: E402
from examples.gpt import GPT, make_batch, suite_config  # noqa: E402

DEFAULT_POINTS = ["1.3B:4", "2.6B:8", "6.7B:16", "15B:32", "39B:64"]


def cluster_for(preset: str, gpus: int) -> autopar.Cluster:
    base = autopar.Cluster.preset(preset, nodes=max(1, gpus // 8))
    if gpus < base.devices_per_node:  # part of one node
        base = dataclasses.replace(base, devices_per_node=gpus, mesh_shape=(1, gpus))
    return base


def run_point(model_name: str, gpus: int, preset: str, batch: int, options: dict) -> dict:
    cfg = suite_config(model_name)
    with torch.device("meta"):
        model = GPT(cfg).half()
    inputs = make_batch(cfg, batch, device="meta")
    cluster = cluster_for(preset, gpus)
    start = time.perf_counter()
    graph = capture(model, inputs)
    captured = time.perf_counter()
    try:
        plan = plan_graph(graph, cluster, PlanOptions(**options), model_name="GPT")
        outcome = {"step_ms": plan.predicted["step_time"] * 1e3,
                   "peak_gib": plan.predicted["peak_memory"] / 2**30, "stages": len(plan.stages)}
    except InfeasibleError:
        outcome = {"step_ms": float("nan"), "peak_gib": float("nan"), "stages": 0}
    return {"model": model_name, "gpus": gpus, "params_b": cfg.n_params / 1e9, "batch": batch,
            "capture_s": captured - start, "plan_s": time.perf_counter() - captured, **outcome}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", default="dgx-a100", help="preset name (default dgx-a100)")
    parser.add_argument("--points", nargs="+", default=DEFAULT_POINTS, help="MODEL:GPUS pairs")
    parser.add_argument("--batch-per-gpu", type=int, default=2, help="global batch = this × GPUs")
    args = parser.parse_args(argv)
    print(f"# plan time, {args.cluster}, {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}")
    print(f"{'model':>6} {'params':>8} {'GPUs':>5} {'batch':>6} {'capture s':>10} {'plan s':>8} {'stages':>7} "
          f"{'step ms':>9} {'peak GiB':>9}")
    for point in args.points:
        name, gpus = point.split(":")
        r = run_point(name, int(gpus), args.cluster, args.batch_per_gpu * int(gpus), {})
        print(f"{r['model']:>6} {r['params_b']:>7.1f}B {r['gpus']:>5} {r['batch']:>6} {r['capture_s']:>10.2f} "
              f"{r['plan_s']:>8.2f} {r['stages']:>7} {r['step_ms']:>9.1f} {r['peak_gib']:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
