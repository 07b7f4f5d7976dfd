"""Reusing an ILP solution for a later problem with the same objective and a tighter memory row, exactly.

A pipeline's middle stages are often the same blocks on the same submesh: their ILPs have identical
objectives (cost vectors and resharding matrices) and differ only in memory, because under 1F1B stage s
keeps n - s microbatches' activations in flight. Solving each costs about as much as the first.

Claim: let S be optimal for problem P1 over its feasible set F1, and let P2 have the same objective
with F2 ⊆ F1. If S ∈ F2, then S is optimal for P2 (no point of F2 beats S, since none of F1 does).
F2 ⊆ F1 holds when P2's budget is at most P1's (P1 unbounded counts as infinite), every memory and
transient coefficient of P2 is at least P1's, element by element, and their replay rows are equal.
Membership S ∈ F2 is checked by evaluating S's peak memory under P2. With a relative MIP gap g, S is
within g of P1's optimum, which is no larger than P2's, so the guarantee carries over. Only solutions
the solver proved (status "Optimal") are kept.

So the driver solves identical stages in order of growing memory (fewest microbatches in flight
first) and each later stage is either answered here or solved afresh and remembered.
"""
from __future__ import annotations

import hashlib

import numpy as np

from autopar.passes.ilp import IlpProblem, IlpResult, memory_of


def objective_key(problem: IlpProblem) -> str:
    """A digest of the objective: every cost vector and resharding matrix with its endpoints."""
    digest = hashlib.sha1()
    for vector in problem.cost:
        digest.update(np.ascontiguousarray(vector, dtype=float).tobytes() + b"|")
    for (c, d), matrix in sorted(problem.edges.items()):
        digest.update(f"{c},{d},{matrix.shape}:".encode())
        digest.update(np.ascontiguousarray(matrix, dtype=float).tobytes())
    return digest.hexdigest()


def _tighter_or_equal(new: IlpProblem, old: IlpProblem) -> bool:
    """F(new) ⊆ F(old): budget no larger and every memory coefficient no smaller."""
    if old.budget is not None and (new.budget is None or new.budget > old.budget):
        return False
    if len(new.mem) != len(old.mem) or (new.peak is None) != (old.peak is None) \
            or (new.units is None) != (old.units is None):
        return False
    if new.units is not None and not all(np.all(a >= b) for a, b in zip(new.units, old.units)):
        return False
    if any(a.shape != b.shape or np.any(a < b) for a, b in zip(new.mem, old.mem)):
        return False
    if not _same_replay(new.replay, old.replay):
        return False
    return old.peak is None or all(np.all(a >= b) for a, b in zip(new.peak, old.peak))


def _same_replay(new, old) -> bool:
    """Replay rows equal (identical stages' are: they count one microbatch); anything else is not reused."""
    if new is None or old is None:
        return new is None and old is None
    return len(new) == len(old) and all(
        len(a) == len(b) and all((x is None and y is None) or (x is not None and y is not None and np.array_equal(x, y))
                                 for x, y in zip(a, b)) for a, b in zip(new, old))


class SolutionMemo:
    """Proven-optimal results by objective; ``lookup`` returns one that is provably optimal for
    ``problem`` too (see the module docstring), or None."""

    def __init__(self):
        self._entries: dict[str, list[tuple[IlpProblem, IlpResult]]] = {}
        self.hits = 0

    def lookup(self, problem: IlpProblem) -> IlpResult | None:
        for old, result in reversed(self._entries.get(objective_key(problem), [])):
            fits = problem.budget is None or memory_of(problem, result.choice) <= problem.budget
            if fits and _tighter_or_equal(problem, old):
                self.hits += 1
                return IlpResult(list(result.choice), result.objective, result.status, 0.0, result.n_variables)
        return None

    def store(self, problem: IlpProblem, result: IlpResult) -> None:
        if result.status == "Optimal":
            self._entries.setdefault(objective_key(problem), []).append((problem, result))
