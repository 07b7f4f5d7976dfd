"""The MoE example on 2 local gloo ranks: all-to-all expert dispatch against the gathered-token expert split.

    .venv/bin/python benchmarks/experts/moe_dispatch_local.py [--steps 10] [--experts 8] [--embd 128]

One launch compiles the GShard-style example (``examples/moe.py``, capacity factor 1.0) twice on a (1, 2)
mesh, its MoE experts split by experts on the mesh axis either way (pins; the rest of the plan is the
planner's): "all-to-all" (``expert_all_to_all``: each rank keeps its half of the tokens, rows travel to
their experts' rank and back) and "gather" (``local_experts_op``: every rank sees every token, computes its
own experts' assignments, and the Partial output is reduced). Steps of the two modules alternate after two
warm-up steps each, so both see the same machine load. Per step and rank it reports the median step time
(train_step + AdamW step) and the bytes a rank sends to others in the collectives the generated code runs
through ``faults.guard`` (``_sent``: all-to-all rows a rank keeps for itself do not count). Timings on a
shared 2-core machine are only indicative: rerun idle.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import autopar  # noqa: E402
from autopar.runtime import faults, groups  # noqa: E402
from examples.moe import MoEConfig, make_moe  # noqa: E402

DISPATCHES = {"all-to-all": "RS(0)", "gather": "RP"}  # the experts op's output on the (1, 2) mesh


def _sent(name: str, key, args) -> float:
    """Bytes this rank sends to other ranks in one collective, by the textbook algorithm on a group of W:
    all-to-all its input less the part it keeps; all-gather (W - 1)·input; reduce-scatter (W - 1)/W·input;
    all-reduce (ring) 2·(W - 1)/W·input. Other calls (object broadcasts at start-up) count 0."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors or name not in ("all_to_all", "all_gather", "reduce_scatter", "all_reduce"):
        return 0.0
    world = groups.size(key) if key in groups._MEMBERS else dist.get_world_size()
    data = tensors[1] if len(tensors) > 1 else tensors[0]
    total = data.numel() * data.element_size()
    if name == "all_to_all":
        splits = [a for a in args[2:] if isinstance(a, list)]  # (output splits, input splits) when uneven
        me = groups.local_rank_in(key) if key in groups._MEMBERS else dist.get_rank()
        kept = splits[1][me] * total / max(1, data.shape[0]) if len(splits) == 2 else total / world
        return total - kept
    return total * {"all_gather": world - 1, "reduce_scatter": (world - 1) / world,
                    "all_reduce": 2 * (world - 1) / world}[name]


class ByteCounter:
    """Counts the bytes entering ``faults.guard`` collectives, by collective name, while active."""

    def __init__(self):
        self.bytes: dict[str, int] = {}
        self._original = faults.guard

    def __enter__(self):
        def counting(name, key, fn, *args, **kwargs):
            self.bytes[name] = self.bytes.get(name, 0) + _sent(name, key, args)
            return self._original(name, key, fn, *args, **kwargs)
        faults.guard = counting
        return self

    def __exit__(self, *exc):
        faults.guard = self._original


def run(rank: int, cfg: MoEConfig, batch_size: int, steps: int) -> dict:
    model, batch = make_moe(cfg, batch_size=batch_size)
    cluster = autopar.Cluster.local(2, mesh_shape=(1, 2))
    modules = {}
    for name, out in DISPATCHES.items():
        pins = {"p_*ffn_w_*": "RS(0)", "moe_experts*": out}
        pm = autopar.compile(model, cluster, batch, stages=1, pin=pins)
        kernels = sorted({t for sh in pm.plan.stages[0].shardings.values() for _, t in sh.kernels})
        modules[name] = (pm, torch.optim.AdamW(pm.parameters(), lr=1e-3), kernels, [], {})
    for name, (pm, opt, *_rest) in modules.items():
        for _ in range(2):
            _step(pm, opt, batch)
    for _ in range(steps):
        for name, (pm, opt, _k, times, moved) in modules.items():
            with ByteCounter() as counter:
                start = time.perf_counter()
                loss = _step(pm, opt, batch)
                times.append(time.perf_counter() - start)
            for kind, n in counter.bytes.items():
                moved[kind] = moved.get(kind, 0) + n / steps
    return {name: {"median_s": statistics.median(times), "kernels": kernels, "bytes": moved, "loss": loss}
            for name, (_pm, _opt, kernels, times, moved) in modules.items()}


def _step(pm, opt, batch) -> float:
    loss = pm.train_step(*batch)
    opt.step()
    opt.zero_grad()
    return float(loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    cfg = MoEConfig(n_embd=args.embd, n_expert=args.experts, seq_len=64, group_size=64, n_layer=2)
    load = open("/proc/loadavg").read().split()[:3]
    per_rank = autopar.launch(run, 2, cfg, args.batch, args.steps, timeout=600)
    print(f"MoE example {cfg.n_embd}-wide, {cfg.n_expert} experts top-2, capacity {cfg.capacity_factor}, "
          f"{args.batch}×{cfg.seq_len} tokens, 2 gloo ranks, {args.steps} steps; load before {' '.join(load)}, "
          f"after {' '.join(open('/proc/loadavg').read().split()[:3])}; torch {torch.__version__}")
    kinds = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")
    print("| dispatch | kernel | step median rank 0 / 1 (ms) | " + " | ".join(f"MiB sent, {k} / step" for k in kinds)
          + " | MiB sent in all (rank 0) |")
    print("|---|---|---|" + "---|" * (len(kinds) + 1))
    for name in DISPATCHES:
        r0, r1 = per_rank[0][name], per_rank[1][name]
        b = r0["bytes"]
        kernel = ", ".join(k for k in r0["kernels"] if "experts" in k or "all_to_all" in k)
        print(f"| {name} | {kernel} | {1e3 * r0['median_s']:.1f} / {1e3 * r1['median_s']:.1f} | "
              + " | ".join(f"{b.get(k, 0) / 2**20:.3f}" for k in kinds) + f" | {sum(b.values()) / 2**20:.3f} |")


if __name__ == "__main__":
    main()
