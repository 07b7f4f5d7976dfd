"""Compiled ÷ eager step time, measured: autopar's plan and the hand-written layouts, each eager and compiled.

    python benchmarks/vs_hand/compiled_local.py [--nprocs 2] [--cluster cluster.json] [--rounds 3] [--steps 3]

One ``autopar.launch`` of N gloo ranks (2 by default) builds, from the same weights of the local benchmark's
GPT (``vs_megatron_local.LOCAL_GPT``, batch 16):
  * autopar: ``autopar.compile(model, cluster, batch)`` with compile=False and with compile=True (every rank's
    generated module under torch.compile; the compiled plan is priced with ``Cluster.compiled_view``, so it
    may differ from the eager one when the cluster file measured ``compiled_time_scale``);
  * the hand layouts of ``examples/megatron_baselines.py`` with pp·dp·tp = N (DP2, TP2, PP2 on 2 ranks), eager
    and compiled the way torchtitan compiles its models: ``torch.compile`` on each transformer block's forward
    (the blocks are where the FLOPs are; the embeddings, the loss and the DTensor/replicate/pipelining
    machinery around them stay eager, as there).
Each runner takes ``WARMUP`` untimed steps (compilation happens there), then ``rounds`` round-robin rounds of
``steps`` timed steps (train_step + AdamW step + zero_grad between barriers: the slowest rank's time), so a
burst of load from other jobs hits every runner alike. Reported per layout: the median step time eager and
compiled and their ratio compiled ÷ eager (< 1: compiling pays), and autopar ÷ best hand layout in both modes
(the like-for-like "autopar vs hand" figure). Written to benchmarks/results/compiled_local<N>.md (and .json).
On a shared CPU machine the figures move with the load: the header records the load average.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import autopar  # noqa: E402
from benchmarks.vs_hand import vs_megatron_report as report  # noqa: E402
from benchmarks.vs_hand.vs_megatron_local import (  # noqa: E402
    BATCH,
    HAND_MICROBATCHES,
    LOCAL_GPT,
    hand_layouts,
    local_cluster,
    timed_step,
)
from examples.gpt import make_gpt  # noqa: E402

WARMUP = 2
MODES = ("eager", "compiled")


def compile_blocks(stage: torch.nn.Module) -> None:
    """torch.compile each transformer block's forward, in place (names, hooks and state dict unchanged)."""
    blocks = stage.blocks.values() if isinstance(stage.blocks, torch.nn.ModuleDict) else stage.blocks
    for block in blocks:
        block.forward = torch.compile(block.forward, dynamic=False)


def build_runners(cluster: autopar.Cluster) -> tuple[dict, dict]:
    """{(layout, mode): (step fn, optimizer)} from the same weights, and autopar's plans in words. Collective."""
    from examples.megatron_baselines import build

    model, batch = make_gpt(LOCAL_GPT, batch_size=BATCH)
    runners, plans = {}, {}
    for mode in MODES:
        pm = autopar.compile(copy.deepcopy(model), cluster, batch, compile=mode == "compiled")
        runners["autopar", mode] = (pm.train_step, torch.optim.AdamW(pm.parameters(), lr=1e-4))
        plans[mode] = report.describe_plan(pm.plan)
        for name, layout in hand_layouts(cluster.num_devices).items():
            hp = build(layout, copy.deepcopy(model), batch, microbatches=HAND_MICROBATCHES)
            if mode == "compiled":
                compile_blocks(hp.stage)
            runners[name, mode] = (hp.train_step, torch.optim.AdamW(hp.parameters(), lr=1e-4))
    return runners, plans


def measure_rank(rank: int, cluster: autopar.Cluster, rounds: int, steps: int) -> dict:
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1  # the ranks share the cores: no compile worker pools
    runners, plans = build_runners(cluster)
    _, batch = make_gpt(LOCAL_GPT, batch_size=BATCH)
    start = time.perf_counter()
    for step, optimizer in runners.values():
        for _ in range(WARMUP):
            timed_step(step, optimizer, batch)
    warmup_s = time.perf_counter() - start
    times = {key: [] for key in runners}
    for _ in range(rounds):
        for key, (step, optimizer) in runners.items():
            times[key] += [timed_step(step, optimizer, batch) for _ in range(steps)]
    return {"times": {f"{name}|{mode}": t for (name, mode), t in times.items()}, "plans": plans,
            "warmup_s": warmup_s}


def table(times: dict[str, list[float]]) -> tuple[str, dict]:
    med = {key: statistics.median(t) for key, t in times.items()}
    names = sorted({k.split("|")[0] for k in med}, key=lambda n: (n != "autopar", n))
    rows, ratios = [], {}
    for name in names:
        eager, compiled = med[f"{name}|eager"], med[f"{name}|compiled"]
        ratios[name] = compiled / eager
        rows.append([name, f"{1e3 * eager:.1f}", f"{1e3 * compiled:.1f}", f"{compiled / eager:.2f}"])
    best = {mode: min((n for n in names if n != "autopar"), key=lambda n: med[f"{n}|{mode}"]) for mode in MODES}
    versus = {mode: med[f"{best[mode]}|{mode}"] / med[f"autopar|{mode}"] for mode in MODES}
    text = report.markdown_table(["layout", "eager median ms", "compiled median ms", "compiled ÷ eager"], rows)
    text += "\n\n" + "\n".join(f"autopar vs best hand layout, {mode}: best hand ({best[mode]}) ÷ autopar = "
                               f"{versus[mode]:.2f} (> 1: autopar faster)" for mode in MODES)
    return text, {"compiled_over_eager": ratios, "best_hand": best, "hand_over_autopar": versus}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--cluster", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    cluster = local_cluster(args.cluster, args.nprocs)
    load_before = os.getloadavg()
    start = time.perf_counter()
    result = autopar.launch(measure_rank, args.nprocs, cluster, args.rounds, args.steps, timeout=1800.0)[0]
    wall = time.perf_counter() - start
    body, figures = table(result["times"])
    context = (f"GPT {LOCAL_GPT} (batch {BATCH}) on {args.nprocs} gloo ranks; hand pipelines use {HAND_MICROBATCHES} "
               f"microbatches; hand layouts compiled per transformer block, autopar's generated module whole; "
               f"{args.rounds} rounds × {args.steps} steps per runner after {WARMUP} warm-up steps (compilation: "
               f"{result['warmup_s']:.0f} s of warm-up in all), round-robin; autopar's plan eager: "
               f"{result['plans']['eager']}, compiled: {result['plans']['compiled']}; cluster {cluster.name!r}; "
               f"load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}; wall {wall:.0f} s.")
    text = "\n\n".join([report.machine_line(f"compiled ÷ eager step time on {args.nprocs} local gloo ranks"),
                        context, body])
    print(text)
    os.makedirs(report.RESULTS, exist_ok=True)
    path = os.path.join(report.RESULTS, f"compiled_local{args.nprocs}")
    with open(path + ".md", "w") as f:
        f.write(text + "\n")
    with open(path + ".json", "w") as f:
        json.dump({**figures, "times": result["times"], "plans": result["plans"]}, f, indent=1)
    print(f"\nwrote {path}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
