"""Exact re-solves of the planner's answer where the stage DP's scaled prices are furthest off.

The stage DP (``passes.inter_op``) prices every microbatch count B by scaling whole-model solutions made
at two small reference microbatches b₀ linearly to b = N/B. Costs that do not grow with the microbatch
(op launches, collective start-ups, per-microbatch host time) are then charged once per sample when
scaled up and under-charged when scaled down, and a small reference cannot represent a layout that splits
a large microbatch widely. Three answers are checked by solving them exactly instead, each kept only when
its exact prediction is faster than the exact prediction of the DP's plan (both are exact re-solves, so
they compare):

  ``or_single_stage``     one stage on the whole cluster mesh at B = 1 (solved in a forked worker beside
                          the DP: it does not depend on it);
  ``or_even_split``       the repeated blocks split evenly over the DP's pp device groups, 1F1B at the plan's B
                          (the hand layout of Megatron-LM): the DP ranks layer ranges by scaled prices, and
                          an uneven split it prefers by less than their error can run slower exactly (Llama
                          1.3B on 2 L4s: 13/11 blocks, or 4 interleaved chunks, over the even 12/12);
  ``fewer_microbatches``  the DP's stages at B/2, B/4, ...: B trades activation memory and, in a
                          pipeline, the bubble against the per-microbatch costs, so the DP's prices lean
                          to more microbatches than pay (SC'21 GPT-3.6B on 64 A100s: one stage at B = 8,
                          1.774 s per step, where B = 1 runs 1.690 s); the exact prediction replays the
                          schedule, bubble included.
  ``more_microbatches``   a pipeline's DP stages at 2B, each on the logical mesh of its submesh that the
                          DP's table prices cheapest there: scaled down from a reference many times larger, a
                          stage's price at B loses the per-op fixed costs, so the DP can also lean to fewer
                          microbatches than pay (GPT-3 15B on 32 A100-40GB: 8 stages of 1 × 4 at B = 128,
                          36.9 s by the DP's prices, 40.5 s exactly, where dp2 × tp2 stages at B = 256 run
                          39.3 s exactly).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from autopar.errors import InfeasibleError
from autopar.ir.schedule import inflight
from autopar.passes.cluster_layers import even_block_stages
from autopar.passes.inter_op import ChosenStage, StageChoice
from autopar.passes.interleave import dp_schedule
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


def or_even_split(plan: Plan, choice: StageChoice, layers, blocks, options,
                  solve: Callable[[StageChoice], Plan]) -> Plan:
    """``plan``, or the repeated blocks split evenly over its pp device groups (``even_block_stages``), 1F1B
    at its B, solved exactly by ``solve`` where that is predicted faster by more than a relative ``TIE`` (a
    tie keeps the DP's answer, so a plan the check does not beat stays byte-identical). Not tried where the
    user fixed the stages or asked for interleaving, or where ``even_choice`` finds nothing else to try."""
    if isinstance(options.stages, (list, tuple)) or options.schedule == "interleaved":
        return plan
    if choice.virtual > 1 and even_block_stages(layers, blocks, len(choice.stages)) == _ranges(choice):
        return plan  # interleaved chunks that split the blocks evenly: Megatron's interleaved layout already
    pp = len(choice.stages) // choice.virtual
    even = even_choice(dataclasses.replace(choice, microbatches=plan.microbatches),
                       even_block_stages(layers, blocks, pp), dp_schedule(options.schedule))
    candidate = feasible(lambda: solve(even)) if even is not None else None
    if candidate is None or candidate.predicted["step_time"] * (1 + TIE) >= plan.predicted["step_time"]:
        return plan
    candidate.planner["dp_choice_step_time"] = float(plan.predicted["step_time"])
    candidate.planner["even_split"] = True
    return candidate


def even_choice(choice: StageChoice, ranges: list[tuple[int, int]] | None, schedule: str) -> StageChoice | None:
    """The stages ``ranges`` on the choice's one mesh option at its B, un-interleaved, each offloading its
    optimizer where the choice's stage that holds its first layer does; None where there is nothing else to
    try: no ranges, stages on different mesh options (no one mesh to split over), or the choice's stages are
    those ranges."""
    options = {s.option for s in choice.stages}
    if not ranges or len(options) != 1 or _ranges(choice) == ranges:
        return None
    live = inflight(schedule, len(ranges), choice.microbatches)
    option = options.pop()
    offloads = lambda k: any(s.offload for s in choice.stages if s.first <= k <= s.last)  # noqa: E731
    return dataclasses.replace(choice, virtual=1, notes={}, stages=[
        ChosenStage(k, i, option, live[j], offload=offloads(k)) for j, (k, i) in enumerate(ranges)])


def _ranges(choice: StageChoice) -> list[tuple[int, int]]:
    return [(s.first, s.last) for s in choice.stages]


def more_microbatches(plan: Plan, choice: StageChoice, candidates: list[int],
                      solve_at: Callable[[int], Plan | None]) -> Plan:
    """``plan``, or ``solve_at(2B)`` (the DP's stages at twice the DP's B, ``inter_op.restaged``; None where they
    do not fit) where 2B is a candidate and that is predicted faster by more than a relative ``TIE``. Not tried
    where ``fewer_microbatches`` already moved the plan to fewer microbatches (the exact prices fell with B
    there), the choice is interleaved (its chunks are no DP stages) or one stage (no bubble for more microbatches
    to shrink: they add per-microbatch costs only)."""
    if not more_wanted(choice, candidates) or plan.microbatches != choice.microbatches:
        return plan
    candidate = solve_at(2 * choice.microbatches)
    if candidate is None or candidate.predicted["step_time"] * (1 + TIE) >= plan.predicted["step_time"]:
        return plan
    candidate.planner["dp_microbatches"] = choice.microbatches
    candidate.planner["dp_choice_step_time"] = float(plan.predicted["step_time"])
    return candidate


def more_wanted(choice: StageChoice, candidates: list[int]) -> bool:
    """Whether ``more_microbatches`` asks for the choice's stages at 2B, unless ``fewer_microbatches`` moved the
    plan first: 2B is a candidate and the choice is an un-interleaved pipeline."""
    return 2 * choice.microbatches in candidates and choice.virtual == 1 and len(choice.stages) >= 2
