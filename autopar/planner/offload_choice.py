"""``offload="auto"``: plan without CPU offload and with it, and keep the faster plan that fits.

Offload is a memory lever with a price (``cost_models.offload``): it frees a stage's optimizer state and
master weights (or its saved activations) at the cost of host transfers and a host step. The other levers
(sharding, ZeRO, recompute, pipelining) are searched inside each plan; this compares the two outcomes by
predicted step time, so offload is chosen only where memory forces it or where it is the cheaper lever
(e.g. where it spares recompute or a ZeRO-3 gather that cost more). Ties go to the plan without offload.
The chosen plan records what it moves, per stage, in ``plan.planner["offload"]`` (``record_offload``);
``runtime.offload`` reads it.

The "auto" candidates offload the optimizer only: activation swapping costs 2 × the saved bytes over PCIe
per microbatch, which recompute (the planner's own lever) usually undercuts; force it with
``offload={"activations": True}``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from autopar.errors import InfeasibleError
from autopar.plan import Plan
from autopar.planner.options import PlanOptions, offloaded

AUTO_CANDIDATES = ("none", {"optimizer": True})


def choose_offload(plan_with: Callable[[PlanOptions], Plan], options: PlanOptions) -> Plan:
    """The fastest feasible plan over ``AUTO_CANDIDATES`` (the first one's error when none fits)."""
    best, first_error = None, None
    for offload in AUTO_CANDIDATES:
        try:
            plan = plan_with(dataclasses.replace(options, offload=offload))
        except InfeasibleError as e:
            first_error = first_error or e
            continue
        if best is None or plan.predicted["step_time"] < best.predicted["step_time"] * (1 - 1e-9):
            best = plan
    if best is None:
        raise first_error
    return best


def record_offload(plan: Plan, options: PlanOptions) -> None:
    """{"optimizer": [stage indices], "activations": [...]} in ``plan.planner["offload"]`` when anything is
    offloaded (a plan without offload keeps no key, so its JSON is unchanged)."""
    moved = {kind: list(range(len(plan.stages))) for kind, on in offloaded(options).items() if on}
    if moved:
        plan.planner["offload"] = moved
