"""Exact re-solves of the planner's answer where the stage DP's scaled prices are furthest off.

The stage DP (``passes.inter_op``) prices every microbatch count B by scaling whole-model solutions made
at two small reference microbatches b₀ linearly to b = N/B. Costs that do not grow with the microbatch
(op launches, collective start-ups, per-microbatch host time) are then charged once per sample when
scaled up and under-charged when scaled down, and a small reference cannot represent a layout that splits
a large microbatch widely. Two answers are checked by solving them exactly instead, each kept only when
its exact prediction is faster than the exact prediction of the DP's plan (both are exact re-solves, so
they compare):

  ``or_single_stage``     one stage on the whole cluster mesh at B = 1 (solved in a forked worker beside
                          the DP: it does not depend on it);
  ``fewer_microbatches``  the DP's stages at B/2, B/4, ...: B trades activation memory and, in a
                          pipeline, the bubble against the per-microbatch costs, so the DP's prices lean
                          to more microbatches than pay (SC'21 GPT-3.6B on 64 A100s: one stage at B = 8,
                          1.774 s per step, where B = 1 runs 1.690 s); the exact prediction replays the
                          schedule, bubble included.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from autopar.errors import InfeasibleError
from autopar.ir.schedule import inflight
from autopar.passes.inter_op import StageChoice
from autopar.plan import Plan


def feasible(solve: Callable[[], Plan]) -> Plan | None:
    """``solve()``, or None when it finds nothing within memory (an InfeasibleError)."""
    try:
        return solve()
    except InfeasibleError:
        return None


TIE = 1e-9


def or_single_stage(pipelined: Plan, single: Callable[[], Plan | None]) -> Plan:
    """The faster (predicted) of the DP's plan and ``single()`` (None: infeasible); ``single()`` on a tie
    (within a relative ``TIE``: the two sum the same costs in different orders).

    Ties go to the single stage: where the DP's answer is itself one stage, the two are the same layout,
    and ``single()`` solves it without truncating repeated layers, so its memory includes what a
    one-microbatch step releases before its peak (``plan_builder._released_in_one_step``), which a
    truncated solution cannot place."""
    candidate = single()
    if candidate is None:
        return pipelined
    if candidate.predicted["step_time"] <= pipelined.predicted["step_time"] * (1 + TIE):
        candidate.planner["dp_choice_step_time"] = float(pipelined.predicted["step_time"])
        return candidate
    return pipelined


def same_stages_at(choice: StageChoice, microbatches: int, schedule: str) -> StageChoice:
    """The DP's (un-interleaved) stages at another B: each stage's in-flight count recomputed for it."""
    live = inflight(schedule, len(choice.stages), microbatches)
    return dataclasses.replace(choice, microbatches=microbatches,
                               stages=[s._replace(inflight=live[j]) for j, s in enumerate(choice.stages)])


def fewer_microbatches(plan: Plan, candidates: list[int], solve_at: Callable[[int], Plan | None]) -> Plan:
    """``plan``'s stages solved exactly at half its microbatches, then half again, while each B is a
    candidate, fits (``solve_at(B)`` is None when it does not) and is predicted faster than the last.
    Invariant: the result is ``plan`` or a plan of the same stages predicted strictly faster. The walk
    stops at the first that is not: fewer microbatches hold more activations per microbatch, widen a
    pipeline's bubble, and past the best B the per-microbatch savings no longer pay for either."""
    best, B = plan, plan.microbatches // 2
    while B in candidates:
        candidate = solve_at(B)
        if candidate is None or candidate.predicted["step_time"] >= best.predicted["step_time"]:
            break
        candidate.planner["dp_microbatches"] = plan.microbatches
        candidate.planner["dp_choice_step_time"] = float(plan.predicted["step_time"])
        best, B = candidate, B // 2
    return best
