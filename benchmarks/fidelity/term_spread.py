"""Is the spread of the profile's per-op terms the machine or the probe? Both printed, profile after profile.

    python benchmarks/fidelity/term_spread.py [--nprocs 2] [--cycles 4]

In one launch of ``--nprocs`` gloo ranks (all busy at once, as the profiler runs them), each cycle is what
one fresh profile measures of the terms that dominate the fidelity benchmark's tiny GPT, each timed by the
profiler's method (``probes.SpeedReference.measure``: windows between reference-mm windows, median, more
windows where the ratios spread wide), with a fresh reference per cycle (so its level is that cycle's):

* op_overhead: the profiler's tiny block (``profiler_training`` item 2), per op call;
* norm/activation rate: LayerNorm, GELU and softmax forward + backward at the profiler's ``NORM_ACT_SHAPE``
  and, beside it, at the shapes the benchmark GPT's ops run at (one data-parallel rank's tokens × width,
  and × 4 width for the MLP's GELU): whether the profiler's idealised size reads the rate the model sees;
* microbatch_overhead: the pipeline runtime's host time per (chunk, microbatch) and direction
  (``profiler_pipeline``), in CPU seconds against the reference's CPU seconds.

Printed per cycle and term: the figure in seconds as a profile would record it (ratio · level), the
ratio, the raw median seconds, and three spreads (IQR / median) within the cycle: of the ratios, of the
probe's raw seconds, of the reference windows beside it. Then, over cycles: the range (max − min) /
median of the reference level, of each term's raw seconds, of its ratio and of its recorded figure.
The ratio's range is what a profile can make steady; where the raw seconds and the level move together
while the ratio holds, the machine moved; where the ratio moves while the level holds, the probe did.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import autopar  # noqa: E402
from autopar.profiling.probe_step import TinyBlock, tiny_block_nodes  # noqa: E402
from autopar.profiling.probes import SpeedReference  # noqa: E402
from autopar.profiling.profiler import FULL  # noqa: E402
from autopar.profiling.profiler_device import ProbeDevice  # noqa: E402
from autopar.profiling.profiler_training import NORM_ACT_SHAPE, norm_act_bytes, norm_act_calls  # noqa: E402
from benchmarks.fidelity.fidelity_plans import BATCH, CONFIG  # noqa: E402


def gpt_norm_act_shapes(world: int) -> dict[str, tuple[int, int]]:
    """(tokens, width) the benchmark GPT's norms and activations run at on one data-parallel rank."""
    tokens = BATCH * CONFIG.seq_len // world
    return {"layernorm@gpt": (tokens, CONFIG.n_embd), "gelu@gpt-mlp": (tokens, 4 * CONFIG.n_embd)}


def _rank(rank: int, cycles: int, pipeline: bool) -> list[dict]:
    from autopar.profiling.profiler_pipeline import measure_pipeline

    probe = ProbeDevice("cpu")
    world = torch.distributed.get_world_size()
    nodes = tiny_block_nodes()
    block, x = TinyBlock(), torch.randn(4, 8)
    probe_calls = norm_act_calls("cpu", probe.torch)
    gpt_calls = {}
    for name, (tokens, width) in gpt_norm_act_shapes(world).items():
        op = torch.nn.LayerNorm(width) if name.startswith("layernorm") else torch.nn.functional.gelu
        t = torch.randn(tokens, width, requires_grad=True)
        wrt = (t, *op.parameters()) if isinstance(op, torch.nn.Module) else (t,)
        grad = torch.randn_like(t)
        gpt_calls[name] = (lambda op=op, t=t, wrt=wrt, grad=grad: torch.autograd.grad(op(t), wrt, grad),
                           6.0 * tokens * width * 4)
    out = []
    for _ in range(cycles):
        reference = SpeedReference(probe)
        timings = {"op_overhead": (reference.measure(lambda: block(x).backward(), FULL, FULL.probe_window_s),
                                   1.0 / (2 * nodes))}
        for name, call in zip(("layernorm", "gelu", "softmax"), probe_calls):
            timings[f"{name}@probe"] = (reference.measure(call, FULL, FULL.probe_window_s), None)
        for name, (call, nbytes) in gpt_calls.items():
            timings[name] = (reference.measure(call, FULL, FULL.probe_window_s), None)
        cycle = {"level": reference.level(), "terms": {}}
        if pipeline:
            data = measure_pipeline(FULL, probe, reference)
            timings.update({f"pipeline@M={m}": (t, None) for m, t in data["timings"].items()})
            cycle["pipeline"] = {"counts": data["counts"], "calls": data["calls"]}
        cycle["level"] = reference.level()
        for name, (timing, per) in timings.items():
            cycle["terms"][name] = {"ratio": timing.ratio, "raw": timing.seconds, "per": per,
                                    "spreads": (timing.ratio_spread, timing.probe_spread, timing.reference_spread),
                                    "windows": timing.windows}
        out.append(cycle)
    return out


def microbatch_c(cycle: dict) -> float:
    """``profiler_pipeline.microbatch_overhead``'s c for one cycle of rank 0, at the cycle's level."""
    m1, m2 = cycle["pipeline"]["counts"]
    terms, level = cycle["terms"], cycle["level"]
    slope = (terms[f"pipeline@M={m2}"]["ratio"] - terms[f"pipeline@M={m1}"]["ratio"]) * level / (m2 - m1)
    overhead = terms["op_overhead"]["ratio"] * terms["op_overhead"]["per"] * level
    return max(0.0, (slope - cycle["pipeline"]["calls"] * overhead) / 2)


def _range(values) -> float:
    values = list(values)
    return (max(values) - min(values)) / statistics.median(values)


def _unit(name: str, seconds: float, per) -> str:
    if per is not None:
        return f"{seconds * per * 1e6:8.2f} us/op"
    if name.startswith(("layernorm", "gelu", "softmax")):
        tokens, width = (NORM_ACT_SHAPE["cpu"][:2] if name.endswith("@probe")
                         else gpt_norm_act_shapes(2 if "@" in name else 2)[name])
        nbytes = norm_act_bytes("cpu") if name.endswith("@probe") else 6.0 * tokens * width * 4
        return f"{nbytes / seconds / 1e9:8.2f} GB/s "
    return f"{seconds * 1e6:8.1f} us   "


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--cycles", type=int, default=4, help="profiles' worth of the terms, one after another")
    parser.add_argument("--no-pipeline", action="store_true", help="leave the microbatch-overhead probe out")
    args = parser.parse_args(argv)
    if args.cycles < 2:
        parser.error(f"--cycles must be at least 2 (the spread over cycles is the point), got {args.cycles}")
    load = os.getloadavg()
    per_rank = autopar.launch(_rank, args.nprocs, args.cycles, not args.no_pipeline, timeout=600)
    print(f"# term_spread: {args.nprocs} ranks, {args.cycles} cycles; load average before "
          f"{tuple(round(v, 2) for v in load)}, after {tuple(round(v, 2) for v in os.getloadavg())}; "
          f"{os.cpu_count()} cores")
    cycles = per_rank[0]  # rank 0's view; spreads are already the largest over ranks
    for i, cycle in enumerate(cycles, 1):
        print(f"cycle {i}: reference level {2 * 256**3 / cycle['level'] / 1e9:.1f} GFLOP/s")
        for name, t in cycle["terms"].items():
            figure = t["ratio"] * cycle["level"]
            r, p, ref = (s * 100 for s in t["spreads"])
            print(f"  {name:<14} {_unit(name, figure, t['per'])}  ratio {t['ratio']:9.4f}  raw "
                  f"{_unit(name, t['raw'], t['per'])}  spread: ratio {r:5.1f} %  probe {p:5.1f} %  "
                  f"reference {ref:5.1f} %  ({t['windows']} windows)")
    if "pipeline" in cycles[0]:
        print("microbatch_overhead per cycle (slope of CPU per step over M, less its op calls, / 2): " + ", ".join(
            f"{microbatch_c(c) * 1e6:.0f}" for c in cycles) + " us")
    levels = [c["level"] for c in cycles]
    print(f"over {len(cycles)} cycles (range = (max - min) / median): reference level {_range(levels) * 100:.1f} %")
    for name in cycles[0]["terms"]:
        ts = [c["terms"][name] for c in cycles]
        print(f"  {name:<14} raw {_range(t['raw'] for t in ts) * 100:5.1f} %   ratio "
              f"{_range(t['ratio'] for t in ts) * 100:5.1f} %   recorded (ratio x level) "
              f"{_range(t['ratio'] * c['level'] for t, c in zip(ts, cycles)) * 100:5.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
