"""What recompute's replay costs in a real step, against what the planner prices for it, in reference-mm units.

    python benchmarks/fidelity/replay_cost.py --cluster cluster.json [--cycles 12] [--batch 8]

One process, one thread, the fidelity GPT (CONFIG) on one data-parallel rank's batch. Each cycle times, in CPU
seconds, between reference mms (fp32 256³): forward + backward plain; the same with every block under
``torch.utils.checkpoint(..., use_reentrant=False, preserve_rng_state=True)`` (the call autopar's runtime makes,
``runtime.recompute_regions``); and the blocks' forward alone (grad enabled, as the replay runs it). Measured:
replay = checkpointed − plain; its part beyond the forward it repeats = replay − forward (checkpoint's
saved-tensor hooks, RNG state, the re-allocation). Priced, at the cluster's figures over its reference seconds
(level × ρ, ``cost_model_fidelity.neighbour_level``: this process runs alone): the planner's replay
(``passes.recompute.extra_forward``: φ_l · compute_l per block, φ_l its forward share of FLOPs, compute_l the
block's forward + backward), and the blocks' forward as the cost model prices a forward-only call of each op
(``compute_time(differentiable=False)``: forward FLOPs and bytes, one op call).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from autopar.cost_models.compute import compute_time, node_flops  # noqa: E402
from autopar.ir.ops import OpView, requires_grad_nodes  # noqa: E402
from autopar.passes.capture import capture  # noqa: E402
from autopar.placement import R  # noqa: E402
from autopar.profiling.probe_step import REFERENCE_SIDE, _Whole  # noqa: E402
from benchmarks.fidelity.cost_model_fidelity import alone_reference_seconds  # noqa: E402
from benchmarks.fidelity.fidelity_plans import BATCH, CONFIG  # noqa: E402
from benchmarks.fidelity.step_parts import cpu_seconds  # noqa: E402
from examples.gpt import make_gpt  # noqa: E402


def _block_of(node) -> int | None:
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        parts = path.split(".")
        if len(parts) >= 2 and parts[0] == "blocks" and parts[1].isdigit():
            return int(parts[1])
    return None


def priced(model, batch, cluster) -> dict[str, float]:
    """{"planner replay": Σ_l φ_l · compute_l, "forward": Σ forward-only compute_time} over the blocks' ops."""
    graph = capture(model, batch)
    needs = requires_grad_nodes(graph.gm, {p.name for p in graph.placeholders if p.kind == "parameter"})
    compute, flops, forward = {}, {}, 0.0
    for node in graph.gm.graph.nodes:
        block = _block_of(node) if node.op == "call_function" else None
        if block is None:
            continue
        view = OpView(node)
        whole = _Whole(tuple((R,) * len(getattr(v, "shape", ())) for v in view.in_vals), (R,) * 2)
        grad = node.name in needs
        compute[block] = compute.get(block, 0.0) + compute_time(node, whole, view.in_vals, view.out_vals, (1, 1),
                                                                cluster, grad)
        forward += compute_time(node, whole, view.in_vals, view.out_vals, (1, 1), cluster, False)
        try:
            f, b = node_flops(node)
        except Exception:  # noqa: BLE001 - as passes.recompute.forward_share: an op it cannot count adds nothing
            f, b = 0.0, 0.0
        fwd, both = flops.get(block, (0.0, 0.0))
        flops[block] = (fwd + f, both + f + b)
    share = {k: (f / both if both > 0 else 1 / 3) for k, (f, both) in flops.items()}
    return {"planner replay": sum(share[k] * compute[k] for k in compute), "forward": forward}


def measure(model, batch, cycles: int) -> dict[str, list[float]]:
    """Per variant, its CPU seconds / the mean of the reference mms around it, one value per cycle."""
    a, b, out = (torch.randn(REFERENCE_SIDE, REFERENCE_SIDE) for _ in range(3))
    idx, _ = batch
    plain_forwards = [block.forward for block in model.blocks]

    def step(recompute: bool):
        for block, plain in zip(model.blocks, plain_forwards):
            block.forward = ((lambda x, plain=plain: checkpoint(plain, x, use_reentrant=False,
                                                                 preserve_rng_state=True)) if recompute else plain)
        model(*batch).backward()
        model.zero_grad(set_to_none=True)

    def blocks_forward():
        x = model.drop(model.wte(idx) + model.wpe(torch.arange(idx.shape[1])))
        for block, plain in zip(model.blocks, plain_forwards):
            x = plain(x)

    variants = {"plain": lambda: step(False), "checkpointed": lambda: step(True), "forward": blocks_forward}
    for call in variants.values():
        call()
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(cycles):
        before = cpu_seconds(lambda: torch.mm(a, b, out=out), 200)
        for name, call in variants.items():
            seconds = cpu_seconds(call, 1)
            after = cpu_seconds(lambda: torch.mm(a, b, out=out), 200)
            ratios[name].append(seconds / ((before + after) / 2))
            before = after
    return ratios


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cluster", required=True, help="a saved `autopar profile` JSON (CPU ranks)")
    parser.add_argument("--cycles", type=int, default=12)
    parser.add_argument("--batch", type=int, default=BATCH // 2)
    args = parser.parse_args(argv)
    if args.cycles < 1 or args.batch < 1:
        parser.error(f"--cycles and --batch must be at least 1, got {args.cycles}, {args.batch}")
    cluster, reference_s = alone_reference_seconds(parser, args.cluster)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, batch = make_gpt(CONFIG, batch_size=args.batch)
    prices = {k: v / reference_s for k, v in priced(model, batch, cluster).items()}
    load = os.getloadavg()
    ratios = measure(model, batch, args.cycles)
    median = {k: statistics.median(v) for k, v in ratios.items()}
    replay = statistics.median(c - p for c, p in zip(ratios["checkpointed"], ratios["plain"]))
    print(f"# replay_cost: GPT, batch {args.batch}, 1 thread, {args.cycles} cycles, {CONFIG.n_layer} blocks "
          f"checkpointed; cluster {args.cluster}; load before {tuple(round(x, 2) for x in load)}, after "
          f"{tuple(round(x, 2) for x in os.getloadavg())}; units: reference mm calls")
    for name, value in median.items():
        print(f"measured {name:<14}{value:9.1f}")
    print(f"measured replay (checkpointed - plain, per cycle) {replay:9.1f}; beyond the blocks' forward "
          f"{replay - median['forward']:9.1f}")
    print(f"priced   planner replay {prices['planner replay']:9.1f} ({replay / prices['planner replay']:.2f}x "
          f"measured/priced); blocks' forward as forward-only ops {prices['forward']:9.1f} "
          f"(measured forward / priced {median['forward'] / prices['forward']:.2f}x)")


if __name__ == "__main__":
    main()
