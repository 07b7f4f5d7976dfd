"""Record the plans of plan-time points: each plan's JSON, predicted step time and the planner's CPU seconds.

    python benchmarks/plan_time/record_plans.py OUT_DIR [--points MODEL:GPUS:PRESET:BATCH ...] [--profile] [--phases]
                                                [--parts] [--against BASE_DIR]

Two trees give the same plans for the same inputs exactly when their OUT_DIR/*.json files are byte-identical;
the summary file says how much CPU time each point took (time.process_time plus finished workers), which load
hardly affects, so planner speed-ups can be judged on a busy machine. ``--against BASE_DIR`` (another tree's
OUT_DIR) adds to each row whether its plan JSON is byte-identical to BASE_DIR's, and the predicted step there.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from plan_time import HF_LLAMAS, _cpu_seconds, hf_llama  # noqa: E402

import autopar  # noqa: E402
from examples.gpt import GPT, make_batch, suite_config  # noqa: E402

ROWS = ["hf-llama3-8b:64:dgx-h100:256", "hf-llama2-70b:64:dgx-h100:256", "39B:64:p3.16xlarge:1024",
        "175B:1024:dgx-a100:1536"]


def model_of(name: str, batch: int):
    import torch
    if name in HF_LLAMAS:
        model, inputs, _, _ = hf_llama(name, batch)
        return model, inputs
    cfg = suite_config(name)
    with torch.device("meta"):
        model = GPT(cfg).half()
    return model, make_batch(cfg, batch, device="meta")


PHASES = {"price submeshes": ("autopar.passes.inter_op", "StageCosts", "prepare"),
          "stage DP": ("autopar.passes.inter_op_choice", None, "stage_dp"),
          "DP tables": ("autopar.passes.inter_op", "StageCosts", "table"),
          "stage ILPs": ("autopar.planner.driver", None, "_pipeline"),
          "capture": ("autopar.planner.driver", None, "capture")}
# The parts inside those phases (--parts; they nest: a check's exact solves count in "stage ILPs" too). The
# single-stage check runs in a forked worker beside the DP; its CPU seconds count when the driver joins it.
PARTS = {"chunk builds": ("autopar.passes.chunk_reuse", "ChunkBuilds", "build"),
         "stage solves": ("autopar.planner.driver", None, "solve_walks"),
         "single-stage check": ("autopar.planner.driver", None, "or_single_stage"),
         "fewer microbatches": ("autopar.planner.driver", None, "fewer_microbatches"),
         "more microbatches": ("autopar.planner.driver", None, "more_microbatches"),
         "even split": ("autopar.planner.driver", None, "or_even_split")}


def time_phases(parts: bool = False) -> dict[str, float]:
    """Wrap the planner's phases (PHASES, and PARTS with ``parts``) so each adds the CPU seconds it used,
    forked workers included. Timed with ``_cpu_seconds`` around each call, not by cProfile: a profiler's
    per-call overhead inflates this Python-heavy code several times over (and the CPU clock's more)."""
    import importlib

    spent: dict[str, float] = {}

    def wrap(name, fn):
        def timed(*args, **kwargs):
            start = _cpu_seconds()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + _cpu_seconds() - start
        return timed

    for name, (module, cls, attr) in {**PHASES, **(PARTS if parts else {})}.items():
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        setattr(owner, attr, wrap(name, getattr(owner, attr)))
    return spent


def record(point: str, out: str, profile: bool, spent: dict | None = None) -> dict:
    name, gpus, preset, batch = point.split(":")
    model, inputs = model_of(name, int(batch))
    prof = cProfile.Profile() if profile else None
    wall, cpu = time.perf_counter(), _cpu_seconds()
    if prof:
        prof.enable()
    plan = autopar.plan(model, autopar.Cluster.preset(preset, gpus=int(gpus)), inputs)
    if prof:
        prof.disable()
    wall, cpu = time.perf_counter() - wall, _cpu_seconds() - cpu
    tag = point.replace(":", "_")
    with open(os.path.join(out, tag + ".json"), "w") as f:
        f.write(plan.to_json())
    if prof:
        prof.dump_stats(os.path.join(out, tag + ".prof"))
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
    phases = {k: round(v, 2) for k, v in (spent or {}).items()}
    if spent:
        spent.clear()
    return {"point": point, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "cpu_phases": phases,
            "load": os.getloadavg()[0],
            "step_time": plan.predicted["step_time"], "stages": len(plan.stages), "B": plan.microbatches,
            "timings": {k: round(v, 2) for k, v in plan.timings.items()}}


def compare(point: str, out: str, base: str) -> dict:
    """{"identical": whether the two plan JSONs are byte-identical, "base_step_time": the other's prediction}
    (None for both when BASE has no plan of this point)."""
    tag = point.replace(":", "_") + ".json"
    if not os.path.exists(os.path.join(base, tag)):
        return {"identical": None, "base_step_time": None}
    with open(os.path.join(out, tag), "rb") as mine, open(os.path.join(base, tag), "rb") as theirs:
        text, other = mine.read(), theirs.read()
    return {"identical": text == other, "base_step_time": json.loads(other)["predicted"]["step_time"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--points", nargs="+", default=ROWS)
    parser.add_argument("--profile", action="store_true", help="cProfile each point into OUT/<point>.prof")
    parser.add_argument("--phases", action="store_true", help="CPU seconds per planner phase (PHASES)")
    parser.add_argument("--parts", action="store_true", help="with --phases: and per part of them (PARTS)")
    parser.add_argument("--against", help="OUT_DIR of another tree: say per point whether the plans are identical")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    spent = time_phases(args.parts) if args.phases or args.parts else None
    for point in args.points:
        row = record(point, args.out, args.profile, spent)
        if args.against:
            row.update(compare(point, args.out, args.against))
        print(json.dumps(row), flush=True)
        with open(os.path.join(args.out, "summary.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
