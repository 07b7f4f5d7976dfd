"""How long autopar takes to plan GPT models for simulated GPU clusters (meta device: no memory needed).

    python benchmarks/plan_time.py                 (or ./run.sh bench plan_time)
    python benchmarks/plan_time.py --points 39B:64:p3.16xlarge:1024 175B:1024:dgx-a100:1536
    python benchmarks/plan_time.py --precision bf16 [--zero 1]   (fp32 weights, bf16 autocast; see autopar.ir.precision)

A point is MODEL:GPUS:PRESET:GLOBAL_BATCH. The defaults are Alpa's GPT weak-scaling suite on AWS
p3.16xlarge (8× V100 per node, 25 Gbps between nodes) at Alpa's global batch of 1024, and GPT-3 175B on
1024 A100s at GPT-3's batch of 1536. Everything is timed: torch.export capture, layer clustering, the
per-submesh ILPs with the stage DP, and the exact ILP of every chosen stage. A benchmark prints a table;
it is never a test with a time limit.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import autopar  # noqa: E402
from autopar.presets import preset_gpus  # noqa: E402
from examples.gpt import GPT, make_batch, suite_config  # noqa: E402

DEFAULT_POINTS = ["1.3B:4:p3.16xlarge:1024", "2.6B:8:p3.16xlarge:1024", "6.7B:16:p3.16xlarge:1024",
                  "15B:32:p3.16xlarge:1024", "39B:64:p3.16xlarge:1024", "175B:1024:dgx-a100:1536"]


def run_point(point: str, precision: str | None = None, zero="auto") -> dict:
    """Without ``precision`` the model is stored in fp16 (as before precision policies existed); with one, it
    is stored in fp32 and planned under that policy (bf16: fp32 master weights, bf16 autocast)."""
    name, gpus, preset, batch = point.split(":")
    cfg = suite_config(name)
    with torch.device("meta"):
        model = GPT(cfg) if precision else GPT(cfg).half()
    start = time.perf_counter()
    options = {"precision": precision, "zero": zero} if precision else {"zero": zero}
    batch_inputs = make_batch(cfg, int(batch), device="meta")
    plan = autopar.plan(model, preset_gpus(preset, int(gpus)), batch_inputs, **options)
    total = time.perf_counter() - start
    t = plan.timings
    return {"model": name, "params": cfg.n_params / 1e9, "gpus": int(gpus), "preset": preset, "batch": int(batch),
            "total": total, "capture": t.get("capture", 0.0), "dp": t.get("stage_dp", 0.0),
            "stages_s": t.get("stage_ilps", 0.0), "solves": plan.planner.get("mesh_solves", 0),
            "stages": len(plan.stages), "B": plan.microbatches,
            "shape": "+".join(f"{s.submesh[0]}x{s.submesh[1]}" for s in plan.stages[:3])
            + ("+…" if len(plan.stages) > 3 else ""),
            "step": plan.predicted["step_time"], "mem": plan.predicted["peak_memory"] / 2**30,
            "pflops": 6 * cfg.n_params * int(batch) * cfg.seq_len / plan.predicted["step_time"] / 1e15}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", nargs="+", default=DEFAULT_POINTS, help="MODEL:GPUS:PRESET:BATCH")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                        help="plan an fp32-stored model under this policy (default: fp16-stored, fp32 policy)")
    parser.add_argument("--zero", default="auto", help="ZeRO level for every parameter: auto, 0, 1 or 2")
    args = parser.parse_args(argv)
    zero = args.zero if args.zero == "auto" else int(args.zero)
    print(f"# autopar plan time — {time.strftime('%Y-%m-%d')}, {platform.machine()} {os.cpu_count()} cores, "
          f"torch {torch.__version__}, load {os.getloadavg()[0]:.1f}, precision {args.precision or 'fp16 weights'}, "
          f"zero {zero}")
    print("| model | GPUs | cluster | batch | plan total s | capture s | DP s | stage ILPs s | mesh solves "
          "| stages (submeshes) | B | predicted step s | PFLOP/s | peak GiB |")
    print("|" + "---|" * 14)
    for point in args.points:
        r = run_point(point, args.precision, zero)
        print(f"| {r['model']} ({r['params']:.1f}B) | {r['gpus']} | {r['preset']} | {r['batch']} | "
              f"{r['total']:.1f} | {r['capture']:.1f} | {r['dp']:.1f} | {r['stages_s']:.1f} | {r['solves']} | "
              f"{r['stages']} ({r['shape']}) | {r['B']} | {r['step']:.2f} | {r['pflops']:.2f} | {r['mem']:.1f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
