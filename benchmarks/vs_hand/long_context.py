"""Long context: autopar's plan against a torchtitan-style hand grid (FSDP × TP or CP, activation checkpointing).

    python benchmarks/vs_hand/long_context.py                          # 8B-shaped at 32K and 128K on 8 and 64 H100
    python benchmarks/vs_hand/long_context.py --points 32768:8 --model small   # a quick check of the script

The model is the GPT example at Llama-3-8B's shape (hidden 4096, 32 blocks, 32 heads, vocabulary 128256; causal
SDPA; no GQA or SwiGLU: an "8B-shaped GPT", not HF Llama), bf16 mixed precision, one sequence per data-parallel
replica as torchtitan's long-context runs take. Hand layouts, each one stage on a (dp, m) mesh of the
"dgx-h100" preset with full activation checkpointing (recompute="full") and FSDP (zero=3: every weight sharded
over the axes it is replicated on):
  * "tp": Megatron's tensor-parallel weight layout on the m axis (``megatron_configs.TP_WEIGHT_SPECS``);
  * "cp": context parallelism on the m axis: tokens and every attention split over the sequence
    (``autopar/runtime/context_parallel.py``), weights replicated on m (so FSDP shards them over dp·m).
torchtitan combines FSDP × TP × CP on a 3-D mesh; autopar's meshes are 2-D, so the grid holds the two-axis
combinations (an honest subset). Each layout is scored by autopar's cost model (activations placed by the same
ILP); the table says which fit in memory and compares the fastest that fits with ``autopar.plan`` (default
options). Prints a markdown table; asserts nothing about time.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import autopar  # noqa: E402
from autopar.baselines.megatron_configs import TP_WEIGHT_SPECS  # noqa: E402
from autopar.errors import InfeasibleError  # noqa: E402

MODELS = {"8b": dict(vocab_size=128256, n_layer=32, n_head=32, n_embd=4096),
          "small": dict(vocab_size=1024, n_layer=2, n_head=8, n_embd=256)}
DEFAULT_POINTS = ["32768:8", "131072:8", "32768:64", "131072:64"]


def workload(model: str, seq: int, gpus: int):
    from examples.gpt import GPT, GPTConfig

    cfg = GPTConfig(seq_len=seq, **MODELS[model])
    with torch.device("meta"):
        gpt = GPT(cfg)
    return gpt, cfg


def hand_layouts(gpus: int, per_node: int) -> list[tuple[str, int, int]]:
    """(kind, dp, m) with dp·m = gpus and m inside a node."""
    return [(kind, gpus // m, m) for m in (2, 4, 8) if m <= per_node and gpus % m == 0 for kind in ("tp", "cp")]


def hand_options(kind: str, dp: int, m: int) -> dict:
    batch = "S(0)" if dp > 1 else "R"
    if kind == "tp":
        pin = {glob: "R" + spec for glob, spec in TP_WEIGHT_SPECS.items()}
        pin.update({"idx": batch + "R", "targets": batch + "R"})
    else:
        pin = {"idx": batch + "S(1)", "scaled_dot_product_attention*": batch + "S(2)"}
    return {"stages": 1, "pin": pin, "recompute": "full", "zero": 3, "precision": "bf16"}


def score(model, batch, cluster, options: dict) -> float | None:
    try:
        return float(autopar.plan(model, cluster, batch, **options).predicted["step_time"])
    except InfeasibleError:
        return None


def run_point(point: str, model_name: str, log) -> dict:
    seq, gpus = (int(x) for x in point.split(":"))
    from examples.gpt import make_batch

    model, cfg = workload(model_name, seq, gpus)
    base = autopar.Cluster.preset("dgx-h100", gpus=gpus)
    hand = {}
    for kind, dp, m in hand_layouts(gpus, base.devices_per_node):
        batch = make_batch(cfg, dp, device="meta")
        cluster = autopar.Cluster.preset("dgx-h100", gpus=gpus, mesh_shape=(dp, m))
        start = time.perf_counter()
        hand[f"{kind}{m}·fsdp{dp}"] = score(model, batch, cluster, hand_options(kind, dp, m))
        log(f"  {point} {kind}{m}·fsdp{dp}: {hand[f'{kind}{m}·fsdp{dp}']} ({time.perf_counter() - start:.0f} s)")
    batches = {layout: int(layout.rsplit("fsdp", 1)[1]) for layout in hand}
    fitting = {k: v for k, v in hand.items() if v is not None}
    best = min(fitting, key=fitting.get) if fitting else None
    global_batch = batches[best] if best else gpus // 2
    start = time.perf_counter()
    auto = score(model, make_batch(cfg, global_batch, device="meta"), base, {"precision": "bf16"})
    return {"point": point, "hand": hand, "best": best, "hand_step": fitting.get(best), "auto_step": auto,
            "global_batch": global_batch, "plan_s": time.perf_counter() - start}


def table(rows: list[dict]) -> str:
    lines = ["| sequence | GPUs | hand layouts that fit | best hand (s/step) | autopar (s/step) | autopar / hand |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        seq, gpus = r["point"].split(":")
        fits = ", ".join(k for k, v in r["hand"].items() if v is not None) or "none"
        ratio = f"{r['hand_step'] / r['auto_step']:.3f}" if r["hand_step"] and r["auto_step"] else "n/a"
        best = f"{r['best']} ({r['hand_step']:.4g})" if r["best"] else "none fits"
        auto = f"{r['auto_step']:.4g}" if r["auto_step"] else "no plan"
        lines.append(f"| {seq} | {gpus} | {fits} | {best} | {auto} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", nargs="+", default=DEFAULT_POINTS, help="SEQUENCE:GPUS")
    parser.add_argument("--model", choices=sorted(MODELS), default="8b")
    args = parser.parse_args(argv)
    rows = [run_point(p, args.model, lambda line: print(line, file=sys.stderr, flush=True)) for p in args.points]
    print(f"load average {os.getloadavg()}\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
