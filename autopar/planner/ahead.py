"""Exact checks solved ahead, in forked workers, while the driver solves the DP's own stages.

Invariant: each worker computes exactly what the sequential walk would ask for at that point (``fewer_microbatches``'s
first half-B plan, ``more_microbatches``'s 2B plan), from inputs fixed before the DP's plan is solved, so a plan
is byte-identical whether the check ran beside or in turn (``forked.Beside`` computes it in this process when
forking is not safe). A worker whose answer the walk does not ask for is stopped unread.

On two cores the DP's stages are solved on both (``ilp_reuse.solve_walks``) but built on one (the chunk
builds), so a worker started before them fills the idle core: GPT-39B on 64 V100s (B = 512, 8 stages) asks
for both, and its 2B plan, solved after the others in turn, was a sequential 1.4 CPU s.
"""
from __future__ import annotations

from autopar.passes.forked import Beside
from autopar.passes.inter_op import StageChoice
from autopar.planner.exact_checks import more_wanted


def half_ahead(microbatches: int, candidates: list[int], solve_at) -> Beside | None:
    """``solve_at(B // 2)`` beside: ``fewer_microbatches`` asks for that plan whenever half the B is a candidate
    and B's own stages fit, so solving it beside costs no work the sequential walk would not do, and halves
    the wall time of the two. None when half the B is no candidate (nothing would be asked)."""
    half = microbatches // 2
    return Beside(lambda: solve_at(half)) if half in candidates else None


def twice_ahead(choice: StageChoice, candidates: list[int], solve_at) -> Beside | None:
    """``solve_at(2B)`` beside where ``more_microbatches`` would ask for it unless ``fewer_microbatches`` moves the
    plan first (then it is stopped unread: its core was idle while the DP's stages were built); None where it
    would never be asked."""
    if not more_wanted(choice, candidates):
        return None
    return Beside(lambda: solve_at(2 * choice.microbatches))


def cancel(*workers: Beside | None) -> None:
    """Stop each worker still running (its answer was read already, or is no longer wanted)."""
    for worker in workers:
        if worker is not None:
            worker.cancel()
