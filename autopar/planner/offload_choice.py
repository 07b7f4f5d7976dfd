"""``offload="auto"``: CPU offload of the optimizer chosen per stage by the stage DP, and compared whole.

Offload is a memory lever with a price (``cost_models.offload``): it frees a stage's optimizer state and
master weights at the cost of host transfers and a host step. Where the planner searches stages
(``stages`` None or a count above 1), the stage DP prices every candidate stage with and without its
optimizer on the host (``passes.stage_offload``) beside the other levers (layouts, ZeRO, recompute,
pipelining), so one search picks offload for the stages whose memory binds and not for the others; each
offloaded stage is solved exactly with ``TrainingSpec.host_optimizer`` (``stage_training``) and the plan
records them (``offloaded_stages``). "auto" then compares that plan with the plan that offloads every stage
(``AUTO_CANDIDATES``) and keeps the faster feasible one, ties to the per-stage plan: the DP prices the host
step per microbatch (o/B, as it prices the gradient sync) where the step pays the largest one once, and it
prices offloaded stages from layouts solved with the state on the device, so on Mist's L4 points
(``benchmarks/vs_hand/offload_per_stage.py``) offloading every stage was predicted 2.5-5 % faster than
the DP's own choice. Where no stage is searched (``stages=1``, a manual stage list) the two plans are
without offload and with it on every stage. Either way ``plan.planner["offload"]`` = {"optimizer": [stage
indices]} names what moves, and ``runtime.offload`` reads it.

The "auto" choice offloads the optimizer only: activation swapping costs 2 × the saved bytes over PCIe
per microbatch, which recompute (the planner's own lever) usually undercuts; force it with
``offload={"activations": True}``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from autopar.cost_models.memory import TrainingSpec
from autopar.errors import InfeasibleError
from autopar.plan import Plan
from autopar.planner.options import PlanOptions, offloaded

EVERY_STAGE = {"optimizer": True}
AUTO_CANDIDATES = {True: (("auto", True), (EVERY_STAGE, False)),      # stages searched: (offload, per stage)
                   False: (("none", False), (EVERY_STAGE, False))}


def searches_stages(options: PlanOptions) -> bool:
    """Whether the stage DP chooses the stages (and so prices offload per stage)."""
    return options.stages is None or (isinstance(options.stages, int) and options.stages > 1)


def stage_training(training: TrainingSpec, stage) -> TrainingSpec:
    """The training spec a chosen stage is solved with: the plan's, with its optimizer on the host when the DP
    offloaded it (``ChosenStage.offload``)."""
    return dataclasses.replace(training, host_optimizer=True) if stage.offload else training


def offloaded_stages(stages) -> dict:
    """{"offload": {"optimizer": [indices of the stages the DP offloaded]}}, or {} when none did."""
    moved = [s for s, stage in enumerate(stages) if stage.offload]
    return {"offload": {"optimizer": moved}} if moved else {}


def choose_offload(plan_with: Callable[[PlanOptions, bool], Plan], options: PlanOptions) -> Plan:
    """The fastest feasible plan over ``AUTO_CANDIDATES`` (the first one's error when none fits);
    ``plan_with(options, per_stage)`` plans one of them."""
    best, first_error = None, None
    for offload, per_stage in AUTO_CANDIDATES[searches_stages(options)]:
        try:
            plan = plan_with(dataclasses.replace(options, offload=offload), per_stage)
        except InfeasibleError as e:
            first_error = first_error or e
            continue
        if best is None or plan.predicted["step_time"] < best.predicted["step_time"] * (1 - 1e-9):
            best = plan
    if best is None:
        raise first_error
    return best


def record_offload(plan: Plan, options: PlanOptions) -> None:
    """A forced ``offload`` in ``plan.planner["offload"]``: every stage (a plan without offload keeps no key, so
    its JSON is unchanged; "auto" records what the DP chose, ``offloaded_stages``)."""
    moved = {kind: list(range(len(plan.stages))) for kind, on in offloaded(options).items() if on}
    if moved:
        plan.planner["offload"] = moved
