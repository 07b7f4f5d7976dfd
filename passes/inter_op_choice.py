"""Pass 5b, inter_op_choice: the stage DP's answer read off the priced tables (``inter_op.StageCosts``).

Invariant: ``choose_stages`` returns the cheapest DP answer over the candidate microbatch counts B, the
smallest B among costs equal within a relative ``TIE``, exactly as an unbounded search in any order would;
``restaged`` keeps the DP's stages (layers and submeshes) and re-chooses only each stage's logical mesh at
another B. The tables themselves (per-layer prices, memory, recompute and offload picks) are
``inter_op``'s; this module only reads them (``costs`` is an ``inter_op.StageCosts``, left unannotated:
``inter_op`` imports this module).
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from autopar.errors import InfeasibleError, PlanError
from autopar.ir.units import fmt_bytes
from autopar.passes.inter_op_meshes import MeshOption
from autopar.passes.stage_dp import DPResult, option_for, stage_dp

INF = float("inf")
TIE = 1e-9  # DP costs this close (relative) are equal: the smaller B wins (``choose_stages``)


class ChosenStage(NamedTuple):
    """One stage of the DP's answer: layers first..last (inclusive) on ``option``, keeping ``inflight``
    microbatches alive (1F1B: min(stages from here to the end, B); GPipe: B), recomputing ``recompute``,
    stepping its optimizer on the host when ``offload``."""

    first: int
    last: int
    option: MeshOption
    inflight: int
    recompute: tuple[int, ...] = ()  # the layers whose activations backward recomputes (``recompute``)
    budget: float | None = None  # bytes its exact solve may use (None: the device's); interleaved chunks share one
    offload: bool = False  # its optimizer state and master weights in host memory (``stage_offload``)


@dataclasses.dataclass(frozen=True)
class StageChoice:
    """The DP's answer: microbatches B, the stages in pipeline order (each with the layers it recomputes),
    and the DP's objective."""

    microbatches: int
    stages: list[ChosenStage]
    cost: float
    virtual: int = 1  # interleaved 1F1B: model chunks per device (``passes.interleave``)
    notes: dict = dataclasses.field(default_factory=dict)  # what the interleave pass priced


def choose_stages(costs, global_batch: int, candidates: list[int], schedule: str,
                  stages: int | None, excluded: set[tuple] = frozenset()) -> StageChoice:
    """Run the DP for every candidate B and keep the cheapest, the smallest B among costs equal within a
    relative ``TIE`` (rounding: a single stage costs B·t = (N/b₀)·t₀ + sync at every B, so the linear prices
    tie, and the larger microbatch is the one whose matmuls run faster); InfeasibleError when nothing fits.

    The largest B is tried first and each DP gets the best cost so far as its ``bound`` (``stage_dp``): a
    pipeline's cost grows with (B − 1) times its slowest stage, so a good plan found at a large B cuts
    short the search at every other B. The answer is the one the unbounded search in any order returns.

    excluded: (B, first layer, last layer, MeshOption, in-flight) cells ruled out (their exact solve
    did not fit); the DP treats them as not fitting. Where nothing fits, the DP runs once more with the
    ZeRO-3 variants offered (``StageCosts.offer_zero3``), and where still nothing does, once more with the
    solutions that split samples over devices (``StageCosts.offer_sample_splits``)."""
    L, D = costs.layers.count, costs.cluster.num_devices
    if stages is not None and stages > min(L, D):  # no budget would make these fit: say what would
        raise PlanError(f"stages={stages} needs at least {stages} layers and {stages} devices, and the plan "
                              f"has {L} layers over {D} devices; plan at most {min(L, D)} stages"
                              + (f", or pass layers={stages}" if L < stages else ""))
    costs.prepare()
    best = _cheapest(costs, global_batch, candidates, schedule, stages, excluded)
    if best is None and costs.offer_zero3():
        best = _cheapest(costs, global_batch, candidates, schedule, stages, excluded)
    if best is None and costs.offer_sample_splits():
        best = _cheapest(costs, global_batch, candidates, schedule, stages, excluded)
    if best is None:
        budget = costs.cluster.memory_per_device
        raise InfeasibleError(f"no pipeline of the {L} layers over {costs.cluster.num_devices} devices fits "
                              f"{fmt_bytes(budget)} per device with microbatches {candidates}; use more devices "
                              f"or memory, or more microbatches")
    sizes = [o.size for o in costs.options]
    found, B, table = best
    out = []
    for s, (k, i, j) in enumerate(found.stages):  # DPStage(first, last, size_index)
        f = min(len(found.stages) - s, B) if schedule != "gpipe" else B
        m = option_for(table, sizes, k, i, j, min(f, table.shape[3]))
        cell = (B, k, i, m, min(f, table.shape[3]))
        out.append(ChosenStage(k, i, costs.options[m], f, costs.recompute_of(*cell), offload=costs.offload_of(*cell)))
    return StageChoice(B, out, found.cost)


def _cheapest(costs, global_batch: int, candidates: list[int], schedule: str, stages: int | None,
              excluded: set[tuple]) -> tuple[DPResult, int, np.ndarray] | None:
    """(DP result, B, its table) of the cheapest B (``choose_stages``), or None when nothing fits."""
    best: tuple[DPResult, int, np.ndarray] | None = None
    L, sizes = costs.layers.count, [o.size for o in costs.options]
    for B in sorted(candidates, reverse=True):
        max_f = min(L, B) if schedule != "gpipe" else B
        table = costs.table(global_batch, B, max_f)
        for b, k, i, option, f in excluded:
            if b == B:
                table[k, i, costs.options.index(option), min(f, max_f) - 1] = INF
        bound = best[0].cost * (1 + TIE) if best is not None else INF
        found = stage_dp(table, sizes, costs.cluster.num_devices, B, schedule=schedule, stages=stages, bucket=0.01,
                         hops=costs.hops_at(global_batch // B), bound=bound)
        if found is not None and (best is None or found.cost <= bound):
            best = (found, B, table)
    return best


def restaged(costs, choice: StageChoice, global_batch: int, microbatches: int,
             schedule: str) -> StageChoice | None:
    """The DP's (un-interleaved) stages at another B, each on the logical mesh of its own submesh that this B's
    table prices cheapest (with that entry's recompute and offload), those meshes priced at their
    ``own_reference`` too; None where some stage fits on none. The logical mesh is re-chosen because the best
    one moves with the microbatch: a (data, tensor) mesh splits the batch only at microbatches its data axis
    divides."""
    L = costs.layers.count
    max_f = microbatches if schedule == "gpipe" else min(L, microbatches)
    physical = {stage.option.physical for stage in choice.stages}
    costs.add_own_references([m for m, o in enumerate(costs.options) if o.physical in physical], global_batch)
    table = costs.table(global_batch, microbatches, max_f)
    live = [microbatches if schedule == "gpipe" else min(len(choice.stages) - s, microbatches)
            for s in range(len(choice.stages))]
    out = []
    for stage, f in zip(choice.stages, live):
        f = min(f, max_f)
        same = [m for m, o in enumerate(costs.options) if o.physical == stage.option.physical]
        m = min(same, key=lambda m: table[stage.first, stage.last, m, f - 1])
        if not math.isfinite(table[stage.first, stage.last, m, f - 1]):
            return None
        cell = (microbatches, stage.first, stage.last, m, f)
        out.append(ChosenStage(stage.first, stage.last, costs.options[m], f, costs.recompute_of(*cell),
                               offload=costs.offload_of(*cell)))
    return StageChoice(microbatches, out, choice.cost)
