"""The plan autopar makes for a Mixtral-8x7B-sized model on simulated DGX-H100 nodes (meta device).

    python benchmarks/experts/mixtral_plan.py                    (2 and 4 nodes, global batch 256)
    python benchmarks/experts/mixtral_plan.py --nodes 8 --batch 512 --layers 32
    python benchmarks/experts/mixtral_plan.py --nodes 4 --json OUT_DIR   (also each plan's to_json())

Mixtral-8x7B's published config: hidden 4096, intermediate 14336, 32 layers, 8 experts top-2, GQA 32/8
heads, vocabulary 32000, sequence 4096 here, bf16. Prints, per point, the layout (stages, submeshes, how
the expert weights are split and how its MoE layers dispatch their tokens), the predicted step time and peak
memory, and the plan time (wall and CPU seconds, forked pricing workers included, with the load average:
the machine is shared). A benchmark prints a table; it is never a test with a time limit.
"""
from __future__ import annotations

import argparse
import collections
import os
import resource
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import autopar  # noqa: E402
from autopar.errors import InfeasibleError  # noqa: E402
from autopar.ir.units import fmt_bytes  # noqa: E402
from autopar.views.moe import moe_rows  # noqa: E402
from examples.hf_causal_lm import MIXTRAL_8X7B, CausalLMLoss  # noqa: E402

SEQ = 4096


def mixtral(layers: int, batch: int) -> tuple[torch.nn.Module, tuple, float]:
    """(model on meta in bf16, inputs on meta, parameter count)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(**MIXTRAL_8X7B, num_hidden_layers=layers, max_position_embeddings=SEQ, use_cache=False)
    with torch.device("meta"):
        model = CausalLMLoss(MixtralForCausalLM(cfg).to(torch.bfloat16))
    ids = torch.zeros(batch, SEQ, dtype=torch.long, device="meta")
    return model, (ids, ids), sum(p.numel() for p in model.parameters())


def expert_layout(plan) -> str:
    """How the expert weights are split, and how the MoE layers dispatch (``autopar.views.moe``: all-to-all,
    gather or none, with the all-to-all's bytes per device per step), counted over every stage; a model
    captured without the MoE experts op shows its grouped matmuls instead."""
    weights, kernels = collections.Counter(), collections.Counter()
    for stage in plan.stages:
        for name, sh in stage.shardings.items():
            if name.startswith("p_") and "experts" in name:
                weights[f"{sh.out}@{stage.mesh_shape[0]}x{stage.mesh_shape[1]}"] += 1
            elif "grouped_mm" in plan.node_ops.get(name, ""):
                kernels["expert-parallel" if sh.kernels else f"{sh.out}<-{sh.ins[1]}"] += 1
    layers = [f"{r.dispatch}" + (f"@axis {','.join(map(str, r.axes))} {fmt_bytes(r.bytes_per_step)}/step"
                                 if r.dispatch == "all-to-all" else "") + f" ×{len(r.nodes)}" for r in moe_rows(plan)]
    moved = "; MoE layers: " + ", ".join(layers) if layers else ""
    grouped = "; grouped matmuls: " + ", ".join(f"{k} ×{v}" for k, v in kernels.items()) if kernels else ""
    return ", ".join(f"{k} ×{v}" for k, v in weights.items()) + moved + grouped


def cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (the planner prices mesh options in forked
    workers: ``passes.forked``)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run(nodes: int, layers: int, batch: int, json_dir: str | None = None) -> str:
    model, inputs, n_params = mixtral(layers, batch)
    cluster = autopar.Cluster.preset("dgx-h100", nodes)
    wall, cpu = time.perf_counter(), cpu_seconds()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = autopar.plan(model, cluster, inputs)
    except InfeasibleError as e:
        return f"| {nodes} | {layers} | {batch} | no plan fits: {e} |"
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    if json_dir:  # two trees plan alike exactly when these files are byte-identical
        with open(os.path.join(json_dir, f"mixtral_{nodes}n_{layers}l_{batch}.json"), "w") as f:
            f.write(plan.to_json())
    shape = "+".join(f"{s.submesh[0]}x{s.submesh[1]}" for s in plan.stages)
    p = plan.predicted
    return (f"| {nodes} ({8 * nodes} GPUs) | {layers} ({n_params / 1e9:.1f}B) | {batch} | {len(plan.stages)} ({shape}) "
            f"| {plan.microbatches} | {expert_layout(plan)} | {p['step_time']:.2f} | {p['peak_memory'] / 2**30:.1f} "
            f"| {wall:.0f} / {cpu:.0f} | {os.getloadavg()[0]:.0f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=256, help="global batch (sequences of 4096 tokens)")
    parser.add_argument("--json", metavar="DIR", help="write each plan's to_json() into DIR (compare trees)")
    args = parser.parse_args(argv)
    if args.json:
        os.makedirs(args.json, exist_ok=True)
    print(f"# Mixtral-8x7B-sized plans on DGX-H100 — {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, load {os.getloadavg()[0]:.0f} at start")
    print("| nodes | layers (params) | batch | stages (submeshes) | B | expert weights; MoE dispatch "
          "| predicted step s | peak GiB | plan s wall / CPU | load |")
    print("|" + "---|" * 10)
    for nodes in args.nodes:
        print(run(nodes, args.layers, args.batch, args.json), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
