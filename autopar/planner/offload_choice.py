"""``offload="auto"``: CPU offload of the optimizer chosen per stage by the stage DP, and compared whole.

Offload is a memory lever with a price (``cost_models.offload``): it frees a stage's optimizer state and master
weights at the cost of host transfers and a host step. Where the planner searches stages (``stages`` None or a
count above 1), the stage DP prices every candidate stage with and without its optimizer on the host
(``passes.stage_offload``) beside the other levers (layouts, ZeRO, recompute, pipelining), so one search picks
offload for the stages whose memory binds and not for the others; each offloaded stage is solved exactly with
``TrainingSpec.host_optimizer`` (``stage_training``) and the plan records them (``offloaded_stages``). "auto"
then compares that plan with the plan that offloads every stage and, when the DP offloaded some stage, with the
plan without offload, and keeps the fastest feasible one (``choose_offload``; ties to no offload, then to the
per-stage plan): the DP prices the host step per microbatch (o/B, as it prices the gradient sync) where the step
pays the largest one once, and it prices offloaded stages from layouts solved with the state on the device, so
on Mist's L4 points (``benchmarks/vs_hand/offload_per_stage.py``) offloading every stage was predicted 2.5-5 %
faster than the DP's own choice, and on GPT-3 15B / 32 A100-40GB the DP offloaded one stage where the exact plan
without offload is faster (40.5 s vs 42.4 s predicted). Where no stage is searched (``stages=1``, a manual stage
list) the two plans are without offload and with it on every stage. Either way ``plan.planner["offload"]`` =
{"optimizer": [stage indices]} names what moves, and ``runtime.offload`` reads it.

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
CANDIDATES = {"none": ("none", False), "per stage": ("auto", True), "every stage": (EVERY_STAGE, False)}
PREFERENCE = tuple(CANDIDATES)  # (offload, per stage) by name; ties go to the earlier


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
    """The fastest feasible candidate plan, ties to the earlier in ``PREFERENCE``; when none fits, the error of
    the plan with every stage offloaded (its memory floor is the least, so its hint tells the user how far
    off the budget is); ``plan_with(options, per_stage)`` plans one. Stages searched: the DP's per-stage plan
    and every stage offloaded, plus the plan without offload when the DP offloaded some stage (its per-stage prices can
    rank an offloaded stage first where the exact solve prices it slower); otherwise none and every stage."""
    plans, errors = {}, {}
    for name in ("per stage", "every stage") if searches_stages(options) else ("none", "every stage"):
        errors[name] = _plan_into(plans, name, plan_with, options)
    if plans.get("per stage") is not None and "offload" in plans["per stage"].planner:
        errors["none"] = _plan_into(plans, "none", plan_with, options)
    feasible = [plans[name] for name in PREFERENCE if plans.get(name) is not None]
    if not feasible:
        raise errors.get("every stage") or next(e for e in errors.values() if e is not None)
    fastest = min(plan.predicted["step_time"] for plan in feasible)
    return next(plan for plan in feasible if plan.predicted["step_time"] <= fastest * (1 + 1e-9))


def _plan_into(plans: dict, name: str, plan_with, options: PlanOptions) -> InfeasibleError | None:
    """Plans the candidate ``name`` into ``plans`` (None where it does not fit); returns its InfeasibleError."""
    offload, per_stage = CANDIDATES[name]
    try:
        plans[name] = plan_with(dataclasses.replace(options, offload=offload), per_stage)
    except InfeasibleError as e:
        plans[name] = None
        return e
    return None


def record_offload(plan: Plan, options: PlanOptions) -> None:
    """A forced ``offload`` in ``plan.planner["offload"]``: every stage (a plan without offload keeps no key, so
    its JSON is unchanged; "auto" records what the DP chose, ``offloaded_stages``)."""
    moved = {kind: list(range(len(plan.stages))) for kind, on in offloaded(options).items() if on}
    if moved:
        plan.planner["offload"] = moved
