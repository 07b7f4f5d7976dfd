"""How long autopar takes to plan GPT models for simulated GPU clusters (meta device: no memory needed).

    python benchmarks/plan_time.py                 (or ./run.sh bench plan_time)
    python benchmarks/plan_time.py --points 39B:64:p3.16xlarge:1024 175B:1024:dgx-a100:1536
    python benchmarks/plan_time.py --precision bf16 [--zero 1]   (GPT stored fp32, bf16 autocast)

A point is MODEL:GPUS:PRESET:GLOBAL_BATCH. MODEL is a GPT suite size, or a Hugging Face ``transformers`` Llama
built from its published config on the meta device (``hf-llama3-8b``: Llama-3-8B, GQA, vocabulary 128256;
``hf-llama2-70b``: Llama-2-70B, GQA; both at sequence 4096, bf16). The defaults are Alpa's GPT weak-scaling suite on AWS
p3.16xlarge (8× V100 per node, 25 Gbps between nodes) at Alpa's global batch of 1024, and GPT-3 175B on
1024 A100s at GPT-3's batch of 1536. Everything is timed: torch.export capture, layer clustering, the
per-submesh ILPs with the stage DP, and the exact ILP of every chosen stage. A benchmark prints a table;
it is never a test with a time limit.
"""
from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import autopar  # noqa: E402
from autopar.errors import InfeasibleError  # noqa: E402
from examples.gpt import GPT, make_batch, suite_config  # noqa: E402
from examples.hf_causal_lm import CausalLMLoss  # noqa: E402

DEFAULT_POINTS = ["1.3B:4:p3.16xlarge:1024", "2.6B:8:p3.16xlarge:1024", "6.7B:16:p3.16xlarge:1024",
                  "15B:32:p3.16xlarge:1024", "39B:64:p3.16xlarge:1024", "175B:1024:dgx-a100:1536",
                  "hf-llama3-8b:64:dgx-h100:256", "hf-llama2-70b:32:dgx-h100:256", "hf-llama2-70b:64:dgx-h100:256"]
HF_SEQ = 4096
HF_LLAMAS = {  # published configs (hidden, intermediate, layers, heads, kv heads, vocabulary)
    "hf-llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "hf-llama2-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=32000),
}


def hf_llama(name: str, batch: int) -> tuple[torch.nn.Module, tuple, float, int]:
    """(model on meta, inputs on meta, parameter count, sequence length) of a published Llama config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**HF_LLAMAS[name], max_position_embeddings=HF_SEQ, use_cache=False, attention_dropout=0.0,
                      torch_dtype=torch.bfloat16)
    with torch.device("meta"):
        model = CausalLMLoss(LlamaForCausalLM(cfg).to(torch.bfloat16))
    ids = torch.zeros(batch, HF_SEQ, dtype=torch.long, device="meta")
    return model, (ids, ids), sum(p.numel() for p in model.parameters()), HF_SEQ


def run_point(point: str, precision: str | None = None, zero="auto") -> dict:
    """GPT sizes are stored in fp16 without ``precision``; with one, in fp32 and planned under that policy
    (bf16: fp32 master weights, bf16 autocast; see autopar.ir.precision)."""
    name, gpus, preset, batch = point.split(":")
    options = {"zero": zero, **({"precision": precision} if precision else {})}
    if name in HF_LLAMAS:
        model, inputs, n_params, seq = hf_llama(name, int(batch))
    else:
        cfg = suite_config(name)
        with torch.device("meta"):
            model = GPT(cfg) if precision else GPT(cfg).half()
        inputs, n_params, seq = make_batch(cfg, int(batch), device="meta"), cfg.n_params, cfg.seq_len
    start, cpu = time.perf_counter(), _cpu_seconds()
    try:
        plan = autopar.plan(model, autopar.Cluster.preset(preset, gpus=int(gpus)), inputs, **options)
    except InfeasibleError as e:  # a row that says precisely why nothing fits
        return {"model": name, "params": n_params / 1e9, "gpus": int(gpus), "preset": preset, "batch": int(batch),
                "total": time.perf_counter() - start, "cpu": _cpu_seconds() - cpu, "infeasible": str(e)}
    total = time.perf_counter() - start
    t = plan.timings
    return {"model": name, "params": n_params / 1e9, "gpus": int(gpus), "preset": preset, "batch": int(batch),
            "total": total, "cpu": _cpu_seconds() - cpu, "capture": t.get("capture", 0.0), "dp": t.get("stage_dp", 0.0),
            "stages_s": t.get("stage_ilps", 0.0), "solves": plan.planner.get("mesh_solves", 0),
            "stages": _stage_count(plan), "B": plan.microbatches,
            "shape": "+".join(f"{s.submesh[0]}x{s.submesh[1]}" for s in plan.stages[:3])
            + ("+…" if len(plan.stages) > 3 else ""),
            "step": plan.predicted["step_time"], "mem": plan.predicted["peak_memory"] / 2**30,
            "pflops": 6 * n_params * int(batch) * seq / plan.predicted["step_time"] / 1e15}


def _stage_count(plan) -> str:
    """Pipeline stages; "pp×v" for an interleaved plan, whose ``plan.stages`` lists its pp·v model chunks."""
    v = plan.virtual_stages
    return f"{len(plan.stages) // v}×{v} chunks" if v > 1 else str(len(plan.stages))


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished workers (the planner forks some): a
    fairer figure than wall time on a loaded machine."""
    own, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + workers.ru_utime + workers.ru_stime


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", nargs="+", default=DEFAULT_POINTS, help="MODEL:GPUS:PRESET:BATCH")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                        help="plan GPT sizes stored in fp32 under this policy (default: fp16-stored, fp32 policy)")
    parser.add_argument("--zero", default="auto", help="ZeRO level for every parameter: auto, 0, 1 or 2")
    args = parser.parse_args(argv)
    zero = args.zero if args.zero == "auto" else int(args.zero)
    print(f"# autopar plan time — {time.strftime('%Y-%m-%d')}, {platform.machine()} {os.cpu_count()} cores, "
          f"torch {torch.__version__}, load {os.getloadavg()[0]:.1f}, precision {args.precision or 'default'}, "
          f"zero {zero}")
    print("| model | GPUs | cluster | batch | plan total s | CPU s | capture s | DP s | stage ILPs s | mesh solves "
          "| stages (submeshes) | B | predicted step s | PFLOP/s | peak GiB |")
    print("|" + "---|" * 15)
    for point in args.points:
        r = run_point(point, args.precision, zero)
        if "infeasible" in r:
            print(f"| {r['model']} ({r['params']:.1f}B) | {r['gpus']} | {r['preset']} | {r['batch']} | "
                  f"{r['total']:.1f} | {r['cpu']:.1f} | no plan fits: {r['infeasible']} |", flush=True)
            continue
        print(f"| {r['model']} ({r['params']:.1f}B) | {r['gpus']} | {r['preset']} | {r['batch']} | "
              f"{r['total']:.1f} | {r['cpu']:.1f} | {r['capture']:.1f} | {r['dp']:.1f} | {r['stages_s']:.1f} | "
              f"{r['solves']} | "
              f"{r['stages']} ({r['shape']}) | {r['B']} | {r['step']:.2f} | {r['pflops']:.2f} | {r['mem']:.1f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
