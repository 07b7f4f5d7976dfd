"""A lower bound on a hand config's predicted step time, from its stages' FLOPs alone (no ILP):

    floor = replay(f_s, b_s) with f_s = L_s / 3 + c, b_s = 2 · L_s / 3 + c,  L_s = scale · F_s / (B · k · R)

for stages (or interleaved chunks) s of a config with B microbatches on stage meshes of k devices: F_s is the
stage's forward + backward FLOPs at the global batch (backward only for ops whose output needs a gradient,
as the intra-op ILP charges them), R the fastest FLOP rate the cluster prices any matmul at (peak × matmul
efficiency, or the top of a measured curve, over every dtype), scale ``compute_time_scale``, c the pipeline's
host time per (chunk, microbatch), and replay ``simulate_schedule`` as ``plan_builder.predict`` runs it.

Why it bounds the plan's ``step_time`` (= makespan + exposed sync + optimizer step, each part ≥ 0):

* every op's ``compute_time`` is at least scale · (its FLOPs · work_fraction) / rate (the roofline takes the
  larger of FLOP and byte time, and host time only adds), its rate is at most R, and a strategy's
  work_fraction is at least 1 / k (it splits the work over at most all mesh axes); so a stage's per-microbatch
  latency, the ILP's price (op times plus resharding) over B, is at least L_s. Attention ops, priced by their
  own kernel model, are left out (counted as 0), which only lowers the bound;
* the plan's forward is latency / 3 and backward 2 · latency / 3 (``plan_builder.make_stage``) plus c each, and
  recompute and transfers only add; the replay is a list schedule in a fixed order, so its makespan does not
  drop when any op takes longer.

``hand_search`` skips a config whose floor already exceeds the best step time found: its plan cannot win.
"""
from __future__ import annotations

import functools

import torch

from autopar.cost_models.compute import (
    attention_kernel,
    attention_rate,
    memory_bound_bandwidth,
    moves_no_data,
    node_flops,
)
from autopar.ir.ops import requires_grad_nodes
from autopar.ir.schedule import simulate_schedule
from autopar.passes.cluster_layers import cluster_layers, find_repeated_blocks
from autopar.passes.intra_op_groups import is_light


def fastest_rate(cluster) -> float:
    """The most FLOP/s ``cluster`` prices any matmul call at, over every dtype and size."""
    rates = [peak * cluster.matmul_efficiency for peak in cluster.peak_flops.values()]
    rates += [rate for curve in cluster.matmul_curve.values() for _, rate in curve]
    return max(rates)


class StepFloor:
    """``floor(ranges, k, B, schedule, virtual)`` for plans of ``graph`` on ``cluster`` whose layers are the
    planner's clustering into ``n_layers`` (``layers=n_layers``, as the hand grids plan)."""

    def __init__(self, graph, cluster, n_layers: int | None = None):
        layers = cluster_layers(graph, find_repeated_blocks(graph), n_layers, is_light)
        trainable = {p.name for p in graph.placeholders if p.kind == "parameter"}
        grad = requires_grad_nodes(graph.gm, trainable)
        nodes = {n.name: n for n in graph.gm.graph.nodes}
        rate = fastest_rate(cluster)
        # seconds of each layer on one device at the global batch, before dividing by B · k
        self.layer_seconds = [getattr(cluster, "compute_time_scale", 1.0) *
                              sum(_op_seconds(nodes[name], name in grad, cluster, rate) for name in names)
                              for names in layers.nodes]
        self.overhead = cluster.microbatch_overhead

    def floor(self, ranges: list[tuple[int, int]], devices: int, microbatches: int, schedule: str = "1f1b",
              virtual: int = 1) -> float:
        """Seconds no plan of these stages (layer ranges, each on ``devices`` devices) can beat (module docstring)."""
        latency = [sum(self.layer_seconds[first:last + 1]) / (microbatches * devices) for first, last in ranges]
        c = self.overhead if (len(ranges) > 1 or microbatches > 1) else 0.0
        forward = [t / 3 + c for t in latency]
        backward = [2 * t / 3 + c for t in latency]
        return _makespan(tuple(forward), tuple(backward), microbatches, schedule if len(ranges) > 1 else "gpipe",
                         virtual)


def _op_seconds(node, needs_grad: bool, cluster, rate: float) -> float:
    """The op's roofline at the global batch on one device at ``rate`` (its FLOP and byte time; attention at its
    kernel's rate); ``compute_time`` of any strategy on k devices is at least this / k (module docstring)."""
    if node.op != "call_function" or moves_no_data(node):
        return 0.0
    forward, backward = node_flops(node)
    flops = forward + (backward if needs_grad else 0.0)
    kernel = attention_kernel(node, cluster)
    if kernel is not None:
        causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
        return flops * (0.5 if causal else 1.0) / (rate * max(1.0, attention_rate(kernel, cluster)))
    values = [a.meta.get("val") for a in node.all_input_nodes] + [node.meta.get("val")]
    moved = sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))
    return max(flops / rate, moved * (3.0 if needs_grad else 1.0) / memory_bound_bandwidth(node, cluster))


@functools.lru_cache(maxsize=4096)
def _makespan(forward: tuple, backward: tuple, microbatches: int, schedule: str, virtual: int) -> float:
    return max(op.end for op in simulate_schedule(list(forward), list(backward), microbatches, schedule, 0.0,
                                                  virtual))
