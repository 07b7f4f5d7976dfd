"""The fidelity GPT's step, part by part, in units of the profiler's reference mm: measured against predicted.

    python benchmarks/fidelity/step_parts.py --cluster cluster.json [--cycles 12]

One process, one thread (what each rank of the 2-rank benchmark runs with), one data-parallel rank's batch
(``BATCH / 2``). Each cycle times, in this process's CPU seconds (other jobs' time slices do not count),
the reference mm (fp32 256³, 200 calls), then forward + backward, ``AdamW.step()`` and ``zero_grad``
once each, then the reference again; each part's figure is the median over cycles of its seconds / the
mean of the two references around it. Predicted in the same units: the cost model's seconds for each part
on ``--cluster`` (forward + backward of every op of the captured graph, replicated; the optimizer step
by ``cost_models.compute.optimizer_step_time``) over the reference's seconds at the profile's level (the
speed the profile scaled every compute figure to, stated in its source line, times its factor ρ for a
neighbour's training step: this process runs alone).

A part whose measured and predicted reference units agree is priced right at whatever speed the machine
runs; a plan that still misses as profiled then missed because the profile sampled another speed (its
level) than the benchmark ran at, or in what the multi-rank step adds (collectives, barriers).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from autopar.cost_models.compute import compute_time, optimizer_step_time  # noqa: E402
from autopar.ir.ops import OpView, requires_grad_nodes  # noqa: E402
from autopar.passes.capture import capture  # noqa: E402
from autopar.placement import R  # noqa: E402
from autopar.profiling.probe_step import REFERENCE_SIDE, _Whole  # noqa: E402
from benchmarks.fidelity.cost_model_fidelity import alone_reference_seconds, profile_level  # noqa: E402
from benchmarks.fidelity.fidelity_plans import BATCH, CONFIG  # noqa: E402
from examples.gpt import make_gpt  # noqa: E402


def predicted_forward_backward(model, batch, cluster) -> float:
    """The cost model's seconds for forward + backward of every op of ``model`` on ``batch``, replicated."""
    graph = capture(model, batch)
    needs = requires_grad_nodes(graph.gm, {p.name for p in graph.placeholders if p.kind == "parameter"})
    total = 0.0
    for node in graph.gm.graph.nodes:
        if node.op == "call_function":
            view = OpView(node)
            whole = _Whole(tuple((R,) * len(getattr(v, "shape", ())) for v in view.in_vals), (R,) * 2)
            total += compute_time(node, whole, view.in_vals, view.out_vals, (1, 1), cluster, node.name in needs)
    return total


def cpu_seconds(call, calls: int) -> float:
    """CPU seconds per call of ``call()``, over ``calls`` calls back to back."""
    start = time.process_time()
    for _ in range(calls):
        call()
    return (time.process_time() - start) / calls


def measure(model, batch, cycles: int) -> dict[str, list[float]]:
    """Per part, its CPU seconds / the mean of the reference mms around it, one value per cycle."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    a, b, out = (torch.randn(REFERENCE_SIDE, REFERENCE_SIDE) for _ in range(3))

    def forward_backward():
        loss = model(*batch)
        (loss if loss.dim() == 0 else loss.float().mean()).backward()

    parts = {"forward + backward": forward_backward, "optimizer step": optimizer.step,
             "zero_grad": lambda: optimizer.zero_grad(set_to_none=True)}
    for call in parts.values():  # warm: the optimizer's state, the allocator's pages
        call()
    ratios: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(cycles):
        before = cpu_seconds(lambda: torch.mm(a, b, out=out), 200)
        seconds = {name: cpu_seconds(call, 1) for name, call in parts.items()}
        after = cpu_seconds(lambda: torch.mm(a, b, out=out), 200)
        for name, s in seconds.items():
            ratios[name].append(s / ((before + after) / 2))
    return ratios


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", required=True, help="a profiled cluster JSON (`autopar profile --out ...`)")
    parser.add_argument("--cycles", type=int, default=12)
    parser.add_argument("--batch", type=int, default=BATCH // 2, help="samples per step (default: one "
                        "data-parallel rank's; 1 is a pipeline microbatch of pp2-B16)")
    args = parser.parse_args(argv)
    if args.cycles < 1:
        parser.error(f"--cycles must be at least 1, got {args.cycles}")
    if args.batch < 1:
        parser.error(f"--batch must be at least 1, got {args.batch}")
    cluster, reference_s = alone_reference_seconds(parser, args.cluster)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, batch = make_gpt(CONFIG, batch_size=args.batch)
    params = list(model.parameters())
    predicted = {"forward + backward": predicted_forward_backward(model, batch, cluster),
                 "optimizer step": optimizer_step_time(sum(p.numel() for p in params), len(params), 4, "adamw",
                                                       cluster),
                 "zero_grad": 0.0}
    load = os.getloadavg()
    ratios = measure(model, batch, args.cycles)
    print(f"# step_parts: GPT {dataclasses.asdict(CONFIG)}, batch {args.batch}, 1 thread, {args.cycles} cycles; "
          f"cluster {args.cluster} (level {profile_level(cluster):.1f} GFLOP/s: reference {reference_s * 1e6:.0f} us); "
          f"load "
          f"average before {tuple(round(x, 2) for x in load)}, after {tuple(round(x, 2) for x in os.getloadavg())}")
    print(f"{'part':<20}{'measured':>10}{'IQR':>16}{'predicted':>11}{'error':>9}   (reference-mm units)")
    total_measured = total_predicted = 0.0
    for name, values in ratios.items():
        measured = statistics.median(values)
        q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (measured, 0, measured)
        units = predicted[name] / reference_s
        total_measured, total_predicted = total_measured + measured, total_predicted + units
        error = f"{(units - measured) / measured * 100:+8.1f}%" if measured > 0 else "       -"
        print(f"{name:<20}{measured:>10.1f}{f'{q1:.1f}-{q3:.1f}':>16}{units:>11.1f}{error}")
    print(f"{'step':<20}{total_measured:>10.1f}{'':>16}{total_predicted:>11.1f}"
          f"{(total_predicted - total_measured) / total_measured * 100:+8.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
