"""Does the profiler's probe step see what a training step sees? Both timed back to back, in one launch.

    python benchmarks/fidelity/probe_check.py --cluster cluster.json [--cycles 2]

On the cluster's ranks, all busy at once, every compute figure the profiler measures (the fp32 square-mm
ladder, the training-shaped linears, the host time per op, norm/activation rates, its probe step) and the
forward + backward of the fidelity benchmark's GPT at one data-parallel rank's batch are timed against the
same reference mm (``autopar.profiling.probes.SpeedReference``), so the comparison holds whatever other
jobs do to the machine's speed. From those figures (the cluster file gives the rest: memory bandwidth) the
cost model prices both graphs and each gets its end-to-end factor

    s_x = (measured_x − Σ host time) / Σ roofline time          (``probe_step.end_to_end_factor``)

The profiler applies s_probe to every model; s_probe / s_gpt − 1 is then the error it leaves in the GPT's
predicted compute. Printed per cycle (each cycle re-measures everything).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import autopar  # noqa: E402
from autopar.profiling import probe_step  # noqa: E402
from autopar.profiling import profiler_training as pt  # noqa: E402
from autopar.profiling.probes import SpeedReference  # noqa: E402
from autopar.profiling.profiler_device import ProbeDevice  # noqa: E402
from benchmarks.fidelity.fidelity_plans import BATCH, CONFIG  # noqa: E402
from examples.gpt import make_gpt  # noqa: E402

SIDES = (64, 128, 256, 512, 1024)
SETTINGS = types.SimpleNamespace(warmup=2, windows=7, window_s=0.03, probe_window_s=0.15)


def _rank(rank: int, world: int, cycles: int) -> list[dict]:
    reference, cpu = SpeedReference(ProbeDevice("cpu")), torch.device("cpu")

    def relative(call, window_s=SETTINGS.probe_window_s):
        return reference.ratio(call, SETTINGS, window_s)

    mats = {s: [torch.randn(s, s) for _ in range(3)] for s in SIDES}
    tiny, tiny_x = probe_step.TinyBlock(), torch.randn(4, 8)
    shape = probe_step.probe_shape("cpu")
    block, x = probe_step.TinyBlock(shape.width), torch.randn(shape.tokens, shape.width)
    model, (idx, targets) = make_gpt(CONFIG, batch_size=BATCH // world)
    out = []
    for _ in range(cycles):
        row = {"ladder": [relative(lambda m=m: torch.mm(m[0], m[1], out=m[2]), SETTINGS.window_s)
                          for m in mats.values()],
               "tiny_step": relative(lambda: tiny(tiny_x).backward()),
               "linears": [relative(pt._linear_step(s, torch.float32, cpu)) for s in pt.training_shapes(
                   types.SimpleNamespace(kind="cpu"))],
               "norm_act": [relative(call) for call in pt.norm_act_calls("cpu", cpu)],
               "probe_step": relative(lambda: block(x).backward()),
               "gpt": relative(lambda: model(idx, targets).backward())}
        row["level"] = reference.level()
        out.append(row)
    return out


def _graph_sums(cluster, model, inputs) -> tuple[float, float]:
    """(Σ roofline seconds at scale 1, Σ host seconds) of forward + backward of ``model`` on one device."""
    from autopar.cost_models.compute import compute_time, op_overhead_time
    from autopar.ir.ops import OpView, requires_grad_nodes
    from autopar.passes.capture import capture
    from autopar.placement import R

    graph = capture(model, inputs)
    needs = requires_grad_nodes(graph.gm, {p.name for p in graph.placeholders if p.kind == "parameter"})
    bare = dataclasses.replace(cluster, compute_time_scale=1.0, op_overhead=0.0)
    roofline = host = 0.0
    for node in graph.gm.graph.nodes:
        if node.op == "call_function":
            view, grad = OpView(node), node.name in needs
            whole = probe_step._Whole(tuple((R,) * len(getattr(v, "shape", ())) for v in view.in_vals), (R,) * 2)
            roofline += compute_time(node, whole, view.in_vals, view.out_vals, (1, 1), bare, grad)
            host += op_overhead_time(cluster, grad)
    return roofline, host


def cycle_cluster(base, rows: list[dict]) -> tuple[autopar.Cluster, dict]:
    """``base`` with the compute figures of one cycle (median over ranks, in seconds at the ranks' level)."""
    level = statistics.median(r["level"] for r in rows)
    med = lambda key, i=None: level * statistics.median(r[key] if i is None else r[key][i] for r in rows)  # noqa: E731
    curve = [[2.0 * s**3, 2.0 * s**3 / med("ladder", i)] for i, s in enumerate(SIDES)]
    overhead = med("tiny_step") / (2 * probe_step.tiny_block_nodes())
    square = dataclasses.replace(base, matmul_curve={"float32": curve}, op_overhead=overhead,
                                 peak_flops={"float32": max(r for _, r in curve)}, matmul_efficiency=1.0)
    shapes = pt.training_shapes(types.SimpleNamespace(kind="cpu"))
    factor = pt.training_matmul_factor(square, "float32", shapes, [med("linears", i) for i in range(len(shapes))],
                                       overhead)
    norm_act = pt.norm_act_bandwidth([{"norm_act": [med("norm_act", i) for i in range(3)]}], "cpu", overhead)
    cluster = dataclasses.replace(square, matmul_curve={"float32": [[f, r * factor] for f, r in curve]},
                                  peak_flops={"float32": max(r for _, r in curve) * factor},
                                  norm_act_bandwidth=norm_act)
    return cluster, {"factor": factor, "overhead": overhead, "norm_act": norm_act, "probe": med("probe_step"),
                     "gpt": med("gpt"), "rate256": curve[2][1]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", required=True, help="a profiled cluster JSON (its ranks and memory bandwidth)")
    parser.add_argument("--cycles", type=int, default=2)
    args = parser.parse_args(argv)
    base = autopar.Cluster.from_json(args.cluster)
    world = base.num_devices
    load = os.getloadavg()
    per_rank = autopar.launch(_rank, world, world, args.cycles, timeout=900)
    model, inputs = make_gpt(CONFIG, batch_size=BATCH // world)
    print(f"# probe check, {world} ranks at once, GPT {CONFIG} at batch {BATCH // world} per rank; load average "
          f"{tuple(round(v, 2) for v in load)} -> {tuple(round(v, 2) for v in os.getloadavg())}")
    for c in range(args.cycles):
        cluster, fig = cycle_cluster(base, [r[c] for r in per_rank])
        s_probe = probe_step.end_to_end_factor(cluster, fig["probe"])
        roofline, host = _graph_sums(cluster, model, inputs)
        s_gpt = (fig["gpt"] - host) / roofline
        print(f"cycle {c + 1}: fp32 mm 256³ {fig['rate256'] / 1e9:.1f} GFLOP/s, training-matmul factor "
              f"{fig['factor']:.2f}, op_overhead {fig['overhead'] * 1e6:.1f} µs, norm/act {fig['norm_act'] / 1e9:.1f} "
              f"GB/s; probe step {fig['probe'] * 1e3:.2f} ms -> s_probe {s_probe:.3f}; GPT fwd+bwd "
              f"{fig['gpt'] * 1e3:.1f} ms -> s_gpt {s_gpt:.3f}; GPT compute priced with s_probe: "
              f"{(s_probe * roofline + host) / fig['gpt'] - 1:+.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
