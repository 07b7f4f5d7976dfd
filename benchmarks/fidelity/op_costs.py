"""Per-op check of the compute model: ``cost_models.compute.compute_time`` vs the measured op, forward + backward.

    python benchmarks/op_costs.py --cluster cluster.json [--batch 4]

Every distinct op of the GPT example of ``fidelity_plans`` (at one data-parallel rank's share of the batch,
``--batch``) runs on real tensors shaped like the graph's, on 4 local ranks at once (as the profiler and
training run them: each rank has half a core of this 2-core machine). Measured per op: the median over
windows of [forward; backward of the outputs with a ones gradient], the profiler's timing method (windows
of back-to-back calls, all ranks at once). Predicted: ``compute_time`` of the replicated strategy, which
includes ``2 · op_overhead``. Integer inputs are zeros (valid indices); float inputs random. Printed: one
row per op signature with its count in the graph, then totals by kind (matmul-like: FLOPs > 0; memory-bound;
moves no data).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import autopar  # noqa: E402
from autopar.cost_models.compute import compute_time, moves_no_data, node_flops  # noqa: E402
from autopar.ir.ops import OpView, is_free_view, node_signature, requires_grad_nodes  # noqa: E402
from autopar.passes.capture import capture  # noqa: E402
from autopar.placement import R  # noqa: E402
from benchmarks.fidelity.fidelity_plans import CONFIG  # noqa: E402
from examples.gpt import make_gpt  # noqa: E402


def distinct_ops(gm: fx.GraphModule, grad: set[str]) -> dict[str, tuple[fx.Node, int]]:
    """{signature: (first node, count)} of the graph's ATen calls (views and getitem left out)."""
    out: dict[str, tuple[fx.Node, int]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_free_view(node) or not hasattr(node.target, "_schema"):
            continue
        key = f"{node_signature(node)}|{node.name in grad}"
        first, count = out.get(key, (node, 0))
        out[key] = (first, count + 1)
    return out


def _real(val, grad: bool):
    if not isinstance(val, torch.Tensor):
        return val
    if val.dtype.is_floating_point:
        return torch.randn(val.shape, dtype=val.dtype).requires_grad_(grad)
    return torch.zeros(val.shape, dtype=val.dtype)


def _forward_backward(node: fx.Node, grad: set[str]):
    """A zero-argument call running the op on fresh-looking inputs, then backward when it is differentiable."""
    args, kwargs = pytree.tree_map(
        lambda a: _real(a.meta.get("val"), a.name in grad) if isinstance(a, fx.Node) else a, (node.args, node.kwargs))

    def call():
        out = node.target(*args, **kwargs)
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return call


def _seconds(call, window_s: float = 0.05, windows: int = 5) -> float:
    """Median over windows of seconds per call, every rank timing at once (calls per window agreed)."""
    call()
    start = time.perf_counter()
    call()
    n = torch.tensor([max(1, int(window_s / max(time.perf_counter() - start, 1e-7)))])
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    dist.barrier()
    per_call = []
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(int(n)):
            call()
        per_call.append((time.perf_counter() - start) / int(n))
    return statistics.median(per_call)


def _graph(batch: int):
    torch.manual_seed(0)
    model, inputs = make_gpt(CONFIG, batch_size=batch)
    graph = capture(model, inputs)
    grad = requires_grad_nodes(graph.gm, {p.name for p in graph.placeholders if p.kind == "parameter"})
    return graph.gm, grad


def _measure_rank(rank: int, batch: int) -> dict[str, float]:
    gm, grad = _graph(batch)
    return {key: _seconds(_forward_backward(node, grad)) for key, (node, _) in distinct_ops(gm, grad).items()}


def _predict(node: fx.Node, grad: set[str], cluster) -> float:
    view = OpView(node)
    strategy = types.SimpleNamespace(work_fraction=1.0, in_specs=[(R, R)] * len(view.in_vals), out_spec=(R, R))
    return compute_time(node, strategy, view.in_vals, view.out_vals, (1, 1), cluster, node.name in grad)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", required=True, help="profiled cluster JSON")
    parser.add_argument("--batch", type=int, default=4, help="batch of the graph (default 4: a 4-way DP shard)")
    args = parser.parse_args(argv)
    cluster = autopar.Cluster.from_json(args.cluster)
    load = os.getloadavg()
    measured = autopar.launch(_measure_rank, cluster.num_devices, args.batch, timeout=600)
    gm, grad = _graph(args.batch)
    print(f"# per-op compute check, GPT {CONFIG}, batch {args.batch}, {cluster.num_devices} ranks at once; "
          f"load {tuple(round(x, 2) for x in load)} -> {tuple(round(x, 2) for x in os.getloadavg())}")
    print(f"{'op':<44}{'count':>6}{'GFLOP':>8}{'meas us':>10}{'pred us':>10}{'pred/meas':>10}")
    totals: dict[str, list[float]] = {}
    for key, (node, count) in distinct_ops(gm, grad).items():
        meas = statistics.median(r[key] for r in measured)
        pred = _predict(node, grad, cluster)
        flops = sum(node_flops(node))
        kind = "matmul-like" if flops else ("moves no data" if moves_no_data(node) else "memory-bound")
        acc = totals.setdefault(kind, [0.0, 0.0])
        acc[0], acc[1] = acc[0] + count * meas, acc[1] + count * pred
        print(f"{str(node.target):<44}{count:>6}{flops / 1e9:>8.3f}{meas * 1e6:>10.1f}{pred * 1e6:>10.1f}"
              f"{pred / meas:>10.2f}")
    for kind, (meas, pred) in totals.items():
        print(f"total {kind:<16} measured {meas * 1e3:8.1f} ms  predicted {pred * 1e3:8.1f} ms  ({pred / meas:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
