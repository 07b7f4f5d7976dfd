"""A user's manual stage list (``PlanOptions.stages`` as a list) as the stage DP's ``StageChoice``.

Invariants checked here, each a ``PlanError`` naming the fix: every entry spells ``layers`` [first, last]
and ``submesh`` [nodes, devices_per_node]; the stages cover layers 0..L-1 in order, each once; the first
pp stages' submeshes (the devices, before interleaved chunks repeat them) tile the cluster. In-flight
microbatches follow the schedule (1F1B: pp - s for stage s, at most B; GPipe: all B), and layers the
``recompute`` option forces to "full" are the stages' recomputed layers.
"""
from __future__ import annotations

from autopar.errors import PlanError
from autopar.passes.inter_op import ChosenStage, MeshOption, StageChoice, StageCosts
from autopar.passes.interleave import manual_chunks
from autopar.planner.options import PlanOptions


def manual_stages(costs: StageCosts, options: PlanOptions, candidates: list[int]) -> StageChoice:
    """A user's stage list: layers and submesh given; the logical mesh defaults to the submesh's shape."""
    out = []
    n = len(options.stages)
    for s, entry in enumerate(options.stages):
        try:
            first, last = (int(x) for x in entry["layers"])
            physical = tuple(int(x) for x in entry["submesh"])
        except (KeyError, TypeError, ValueError):
            raise PlanError(f"stage {s} of the manual stage list must look like {{'layers': [first, last], "
                            f"'submesh': [nodes, devices_per_node]}}, got {entry!r}") from None
        logical = tuple(entry.get("mesh", physical))
        f = n - s if options.schedule != "gpipe" else candidates[-1]
        out.append(ChosenStage(first, last, MeshOption(physical, logical), f))
    v = options.virtual_stages or 1
    _check_manual(out, costs, v)
    B = candidates[-1] if options.microbatches is None else options.microbatches
    gpipe = options.schedule == "gpipe"
    forced = lambda s: tuple(n for n in range(s.first, s.last + 1) if costs.modes[n] == "full")  # noqa: E731
    out = [s._replace(inflight=B if gpipe else min(s.inflight, B), recompute=forced(s)) for s in out]
    return StageChoice(B, manual_chunks(out, v, B, costs.cluster.memory_per_device) if v > 1 else out, 0.0, virtual=v)


def _check_manual(stages: list[ChosenStage], costs: StageCosts, virtual: int = 1) -> None:
    L, D = costs.layers.count, costs.cluster.num_devices
    covered = [layer for s in stages for layer in range(s.first, s.last + 1)]
    if covered != list(range(L)):
        raise PlanError(f"manual stages must cover layers 0..{L - 1} in order, each once; got layers {covered}")
    used = sum(s.option.size for s in stages[:len(stages) // virtual])
    if used != D:
        raise PlanError(f"manual stages use {used} devices but the cluster has {D}; the submeshes must tile it")
