"""Hand-written layouts for models Megatron-LM does not cover: Wide-ResNet (DP × PP) and MoE (DP × EP × PP).

    from autopar.baselines.hand_grids import best_hand, wrn_pins, moe_pins
    search = best_hand(model, cluster, batch, moe_pins, n_experts=16)  # .best, .scored, .memory_binds

A ``HandLayout`` (dp, ep, pp, microbatches) is turned into autopar plan options exactly as
``megatron_configs`` does for GPT (manual stages + pins, activations placed by the same ILP, scored by the
same cost model), so "hand" means: the weight layout a practitioner writes by hand today.

* Wide-ResNet, the PP-DP baseline of Alpa §8.2: pp pipeline stages, each data parallel over dp devices
  (every weight replicated, images and labels split on the batch); ep = 1. The model's layers (autopar's
  default layer clustering) are cut into pp contiguous stages of near-equal FLOPs, or of near-equal
  parameter bytes (``split``: a practitioner balances time by profiling, as GPipe does, or memory when the
  late, wide layers do not fit); the grid holds both.
* MoE, DeepSpeed-MoE / GShard / Megatron expert-parallel style: each stage's (dp, ep) mesh splits the batch
  over all dp·ep devices; every expert weight is Shard(0) over ep (each device of an ep group holds E/ep
  experts), every other weight is replicated; the MoE experts op (``autopar::moe_experts``) keeps its tokens
  split on both axes (its output pinned to the batch spec), which on the ep axis only the all-to-all
  dispatch gives (kernel ``expert_all_to_all``: tokens travel to their experts' devices and back; with a
  capacity factor only where each device's tokens are whole routing groups, ``all_to_all_fits``, else the
  expert split is the ILP's choice); pp
  stages of equal layer counts (pp divides the layer count; a layer is one block, or two when there are
  more than 16). ``moe_pins`` names the project's GShard example's tensors, ``mixtral_pins`` a Hugging
  Face MoE causal LM's (experts ``*experts*``, inputs ``input_ids``/``labels``).

Stage submeshes and microbatches follow ``megatron_configs``: dp·ep devices inside a node when they fit,
else whole nodes; microbatches = pp·2^k splitting the global batch into whole samples per device.
The logical mesh is (dp, ep) with ep on the inner (node-local) axis, or (1, dp) when ep = 1.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterator

from autopar.baselines.hand_search import (
    UNBOUNDED_MEMORY,
    HandSearch,
    Scored,
    capture_once,
    precapture,
    score_options,
    search_hand,
)
from autopar.baselines.megatron_configs import MAX_MICROBATCHES, stage_submesh
from autopar.cost_models.experts import MOE_OP
from autopar.ir.ops import OpView

EP_DEGREES = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HandLayout:
    """dp batch replicas × ep expert shards × pp pipeline stages (devices = dp·ep·pp), 1F1B over microbatches."""

    dp: int
    ep: int = 1
    pp: int
    microbatches: int
    split: str = "flops"  # how stages are balanced: "flops" or "params" (see module docstring)

    @property
    def devices(self) -> int:
        return self.dp * self.ep * self.pp

    @property
    def mesh(self) -> list[int]:
        return [self.dp, self.ep] if self.ep > 1 else [1, self.dp]

    def __str__(self) -> str:
        ep = f"·ep{self.ep}" if self.ep > 1 else ""
        split = " (param-balanced)" if self.split == "params" and self.pp > 1 else ""
        return f"dp{self.dp}{ep}·pp{self.pp}·B{self.microbatches}{split}"


def _axis(size: int, placement: str) -> str:
    return placement if size > 1 else "R"


def batch_spec(layout: HandLayout) -> str:
    """The inputs' spec: dim 0 split over every axis of the stage mesh."""
    return "".join(_axis(size, "S(0)") for size in layout.mesh)


def wrn_pins(layout: HandLayout) -> dict[str, str]:
    """Data parallel: every weight replicated, images and labels split on the batch."""
    return {"p_*": "RR", "images": batch_spec(layout), "labels": batch_spec(layout)}


MOE_DISPATCH_GLOB = "moe_experts*"  # the MoE experts op's nodes (torch.export names them moe_experts, _1, ...)


def moe_pins(layout: HandLayout, experts: tuple[str, ...] = ("p_blocks_*_ffn_w_in", "p_blocks_*_ffn_w_out"),
             inputs: tuple[str, ...] = ("idx", "targets")) -> dict[str, str]:
    """Data + expert parallel with all-to-all dispatch: weights replicated but the experts', split by expert
    over ep (the last matching glob wins in ``PlanOptions.pin``, so the expert globs follow "p_*"); the
    experts op's tokens split like the batch (module docstring)."""
    expert_spec = _axis(layout.dp, "R") + _axis(layout.ep, "S(0)") if layout.ep > 1 else "RR"
    pins = {"p_*": "RR", **{glob: expert_spec for glob in experts}, **{name: batch_spec(layout) for name in inputs}}
    if layout.ep > 1:
        pins[MOE_DISPATCH_GLOB] = batch_spec(layout)
    return pins


def mixtral_pins(layout: HandLayout) -> dict[str, str]:
    """``moe_pins`` for a Hugging Face MoE causal LM (``examples.hf_causal_lm.CausalLMLoss``)."""
    return moe_pins(layout, experts=("p_*experts*",), inputs=("input_ids", "labels"))


def hand_grid(n_devices: int, n_layers: int, devices_per_node: int, global_batch: int, n_experts: int = 1,
              pp_must_divide_layers: bool = False, max_microbatches: int = MAX_MICROBATCHES,
              splits: tuple[str, ...] = ("flops",)) -> Iterator[HandLayout]:
    """Every layout with dp·ep·pp = n_devices, ep ∈ {1, 2, 4, 8} ≤ devices_per_node dividing n_experts,
    pp ≤ n_layers (dividing it when asked), stages that tile nodes, microbatches = pp·2^k with
    global_batch % (microbatches·dp·ep) == 0, and each stage split of ``splits`` (one when pp = 1).
    Ordered by (pp, ep, split, microbatches)."""
    for pp in [p for p in range(1, n_layers + 1) if n_devices % p == 0]:
        if pp_must_divide_layers and n_layers % pp:
            continue
        for ep in [e for e in EP_DEGREES if e <= devices_per_node and n_experts % e == 0]:
            if (n_devices // pp) % ep:
                continue
            dp = n_devices // (pp * ep)
            width = dp * ep
            if width > devices_per_node and width % devices_per_node:
                continue
            for split in splits if pp > 1 else splits[:1]:
                microbatches = pp
                while microbatches <= max_microbatches and global_batch % (microbatches * width) == 0:
                    yield HandLayout(dp=dp, ep=ep, pp=pp, microbatches=microbatches, split=split)
                    microbatches *= 2


def all_to_all_fits(op, layout: HandLayout) -> bool:
    """Whether the MoE experts op ``op`` (captured at the global batch) can dispatch by all-to-all under
    ``layout``: with a capacity factor each device's tokens of a microbatch must be whole routing groups
    (the drop decision is per group); otherwise the experts are left to the ILP (its gathered split)."""
    view = OpView(op)
    tokens, group = view.in_shapes[0][0], view.arg(9) if view.arg(8) is not None else 0
    parts = layout.microbatches * layout.dp * layout.ep
    return tokens % parts == 0 and (not group or (tokens // parts) % group == 0)


def balanced_ranges(costs: list[float], parts: int) -> list[tuple[int, int]]:
    """Contiguous [first, last] ranges of ``costs`` in ``parts`` pieces minimizing the largest piece's sum
    (the linear partition problem, by DP over prefix sums: O(parts · n²))."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = [[float("inf")] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    bounds, j = [n], n
    for k in range(parts, 0, -1):
        j = cut[k][j]
        bounds.append(j)
    bounds = bounds[::-1]
    return [(a, b - 1) for a, b in zip(bounds, bounds[1:])]


def layer_weights(graph) -> dict[str, list[float]]:
    """Per layer of autopar's default layer clustering (what the driver uses): "flops", its forward +
    backward FLOPs, and "params", the bytes of the parameters it owns (a parameter belongs to the first
    layer that reads it, ``Layers.of_node``)."""
    from autopar.cost_models.compute import node_flops
    from autopar.passes.cluster_layers import cluster_layers, find_repeated_blocks
    from autopar.passes.intra_op_groups import is_light

    layers = cluster_layers(graph, find_repeated_blocks(graph), None, is_light)
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    flops = [sum(sum(node_flops(nodes[name])) for name in names) for names in layers.nodes]
    params = [0.0] * layers.count
    for p in graph.placeholders:
        if p.kind == "parameter" and p.name in layers.of_node:
            params[layers.of_node[p.name]] += math.prod(p.shape) * p.dtype.itemsize
    return {"flops": flops, "params": params}


def hand_options(layout: HandLayout, ranges: list[tuple[int, int]], devices_per_node: int, pins: dict) -> dict:
    """Keyword options of ``autopar.plan`` for ``layout`` with stages over the given layer ranges."""
    submesh = stage_submesh(layout.dp * layout.ep, devices_per_node)
    stages = [{"layers": [first, last], "submesh": submesh, "mesh": layout.mesh} for first, last in ranges]
    return {"layers": ranges[-1][1] + 1, "stages": stages, "microbatches": layout.microbatches,
            "schedule": "1f1b", "pin": pins}


def best_hand(model, cluster, batch, pins_for, n_experts: int = 1, patience: int = 2,
              log=None, precision: str = "fp32", time_limit: float = 60.0) -> HandSearch:
    """``search_hand`` over ``hand_grid`` (pins from ``pins_for(layout)``) scored by autopar's cost model,
    every layout under the same ``precision`` policy as the autopar plan it is compared with.

    Stages: with n_experts > 1 (MoE) the default layers are cut evenly and pp must divide their count;
    otherwise they are cut by ``balanced_ranges`` of their FLOPs or of their parameter bytes."""
    graph, recapture = capture_once(model, batch, precision)
    weights = layer_weights(graph)
    n_layers = len(weights["flops"])
    moe = n_experts > 1
    grid = list(hand_grid(cluster.num_devices, n_layers, cluster.devices_per_node, batch[0].shape[0],
                          n_experts, pp_must_divide_layers=moe, splits=("flops",) if moe else ("flops", "params")))
    precapture(graph, recapture, {c.microbatches for c in grid})

    def ranges(layout: HandLayout) -> list[tuple[int, int]]:
        if moe:
            per = n_layers // layout.pp
            return [(s * per, (s + 1) * per - 1) for s in range(layout.pp)]
        return balanced_ranges(weights[layout.split], layout.pp)

    roomy = cluster.with_memory(UNBOUNDED_MEMORY)

    moe_ops = [n for n in graph.gm.graph.nodes if str(n.target) == MOE_OP]

    def score(layout: HandLayout, unbounded: bool = False) -> Scored:
        pins = pins_for(layout)
        if not all(all_to_all_fits(op, layout) for op in moe_ops):  # includes a model without the op
            pins.pop(MOE_DISPATCH_GLOB, None)
        options = hand_options(layout, ranges(layout), cluster.devices_per_node, pins)
        options["precision"] = precision
        return score_options(graph, roomy if unbounded else cluster, layout, options, recapture, time_limit,
                             model_name=type(model).__name__)

    return search_hand(grid, score, lambda c: (c.dp, c.ep, c.pp, c.split), patience, log, cost=lambda c: c.pp)
