"""What choosing CPU offload per pipeline stage gives on Mist's points, against offloading every stage or none.

    python benchmarks/vs_hand/offload_per_stage.py [--points FAMILY:NAME:GPUS:PRESET ...] [--time-limit S]

For each point (``vs_megatron --suite mist``'s workloads, bf16 mixed precision) autopar plans three ways:
offload="none", offload={"optimizer": True} (every stage) and offload="auto" (the faster of the stage DP's
per-stage choice, ``passes.stage_offload``, and every stage: ``planner.offload_choice``). "two-plan" is the
faster feasible of the first two: what "auto" was before the DP chose offload per stage (and still is with
stages=1 or a manual stage list). Printed per point: each plan's predicted step time in seconds, the "auto"
plan in words (its offloaded stages: the DP's choice unless they are all) and its planning seconds;
two-plan / auto > 1 means the per-stage search found a faster step. Simulated on autopar's own cost model;
it prints, never asserts.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import autopar  # noqa: E402
from autopar.errors import InfeasibleError  # noqa: E402
from benchmarks.vs_hand import vs_megatron_report as report  # noqa: E402
from benchmarks.vs_hand.vs_megatron import build_workload  # noqa: E402

POINTS = ["mist:6.7B:8:l4", "mistllama:1.3B:2:l4", "mist:15B:16:l4"]
WAYS = {"none": "none", "every stage": {"optimizer": True}, "auto": "auto"}


def plan_ways(point: str, time_limit: float) -> dict[str, tuple[float | None, str, float]]:
    """{way: (predicted step seconds or None when nothing fits, the plan in words, planning seconds)}."""
    family, name, gpus, preset = point.split(":")
    work = build_workload(family, name, "bf16", preset, int(gpus))
    cluster = autopar.Cluster.preset(preset, gpus=int(gpus))
    out = {}
    for way, offload in WAYS.items():
        start = time.perf_counter()
        try:
            plan = autopar.plan(work.model, cluster, work.batch, precision="bf16", offload=offload,
                                time_limit=time_limit)
            out[way] = (float(plan.predicted["step_time"]), report.describe_plan(plan), time.perf_counter() - start)
        except InfeasibleError:
            out[way] = (None, "does not fit", time.perf_counter() - start)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", nargs="+", default=POINTS)
    parser.add_argument("--time-limit", type=float, default=300.0)
    args = parser.parse_args()
    print(report.machine_line("offload per stage vs every stage or none (autopar's cost model, bf16)"))
    print("| point | none s | every stage s | two-plan s | auto s | two-plan / auto | auto plan | plan s (auto) |")
    print("|---|---|---|---|---|---|---|---|")
    for point in args.points:
        ways = plan_ways(point, args.time_limit)
        feasible = [ways[w][0] for w in ("none", "every stage") if ways[w][0] is not None]
        two = min(feasible) if feasible else None
        auto = ways["auto"][0]
        gain = f"{two / auto:.3f}" if two and auto else "n/a"
        cells = [f"{ways[w][0]:.3f}" if ways[w][0] else "OOM" for w in ("none", "every stage")]
        cells += [f"{t:.3f}" if t else "OOM" for t in (two, auto)]
        print(f"| {point} | {' | '.join(cells)} | {gain} | {ways['auto'][1]} | {ways['auto'][2]:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
