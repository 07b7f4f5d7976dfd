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
first) and each later stage is either answered here or solved afresh and remembered. Stages of
different objectives never answer each other, so ``solve_walks`` splits the walk by objective and solves
on every core, solving ahead the later problems the memo cannot answer yet while cores are left.
"""
from __future__ import annotations

import hashlib
import os

import numpy as np

from autopar.errors import InfeasibleError
from autopar.passes.forked import can_fork, parallel_map
from autopar.passes.ilp import IlpProblem, IlpResult, memory_of, solve_ilp


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

    def lookup(self, problem: IlpProblem, key: str | None = None) -> IlpResult | None:
        """``key``: the problem's ``objective_key``, when the caller has it already."""
        for old, result in reversed(self._entries.get(key or objective_key(problem), [])):
            fits = problem.budget is None or memory_of(problem, result.choice) <= problem.budget
            if fits and _tighter_or_equal(problem, old):
                self.hits += 1
                return IlpResult(list(result.choice), result.objective, result.status, 0.0, result.n_variables)
        return None

    def store(self, problem: IlpProblem, result: IlpResult, key: str | None = None) -> None:
        if result.status == "Optimal":
            self._entries.setdefault(key or objective_key(problem), []).append((problem, result))


def solve_walks(problems: list[IlpProblem], time_limit: float) -> tuple[list[IlpResult | str], int]:
    """Each problem answered exactly as one ``SolutionMemo`` walk over ``problems`` in order answers it.
    Returns (per problem its result, or the InfeasibleError message of its solve; how many were answered
    from the memo).

    The solves run on every core (``forked.parallel_map``) in rounds. A memo only ever answers a problem
    from an earlier one of the same objective, so the walk splits by objective key; each round replays every
    walk with the solves known so far (``_replay``: memo look-ups, no solve) and solves, side by side, the
    first problem each walk cannot answer, plus, while cores are left, the walks' next problems that the
    memo as it stands cannot answer either (solved ahead: a long walk of one objective at tightening memory,
    a pipeline's identical middle stages, is otherwise one core's work), first those whose feasible set is
    not inside their walk's first problem's (that problem's solution can never answer them). A problem
    solved ahead whose walk turns out to answer it from the memo keeps the memo's answer, so the answers
    and the reuse count are the serial walk's whatever the cores; only the work spent ahead can be lost."""
    keys = [objective_key(problem) for problem in problems]
    walks: dict[str, list[int]] = {}
    for j, key in enumerate(keys):
        walks.setdefault(key, []).append(j)
    order = sorted(walks.values(), key=lambda walk: -sum(len(c) for c in problems[walk[0]].cost))
    cores = (os.cpu_count() or 1) if can_fork() else 1
    solved: dict[int, IlpResult | str] = {}
    while True:
        answers, hits, pending = _replay(problems, keys, order, solved)
        if not any(pending):
            return answers, hits
        batch = [walk[0] for walk in pending if walk]
        ahead = [j for walk in pending for j in walk[1:]] if cores > 1 else []
        ahead.sort(key=lambda j: _tighter_or_equal(problems[j], problems[_head(pending, j)]))
        batch += ahead[:max(0, cores - len(batch))]
        batch.sort(key=lambda j: -sum(len(c) for c in problems[j].cost))
        for j, result in zip(batch, parallel_map(lambda j: _solve(problems[j], time_limit), batch)):
            solved[j] = result


def _head(pending: list[list[int]], j: int) -> int:
    """The problem its walk needs first, of the walk that lists problem j."""
    return next(walk[0] for walk in pending if j in walk)


def _solve(problem: IlpProblem, time_limit: float) -> IlpResult | str:
    try:
        return solve_ilp(problem, time_limit)
    except InfeasibleError as e:  # a message travels back from a worker; the caller raises it
        return str(e)


def _replay(problems: list[IlpProblem], keys: list[str], order: list[list[int]],
            solved: dict[int, IlpResult | str]) -> tuple[list[IlpResult | str], int, list[list[int]]]:
    """The serial memo walks with the solves in ``solved``: (answers so far, memo hits, per walk the
    problems still to solve: the first one the walk needs, then those after it that its memo as it stands
    cannot answer and that are not the same problem as one before them)."""
    answers: list[IlpResult | str] = [""] * len(problems)
    memo, pending = SolutionMemo(), []
    for walk in order:
        todo: list[int] = []
        for j in walk:
            result = memo.lookup(problems[j], keys[j])
            if result is not None and not todo:
                answers[j] = result
            elif result is None and not todo and j in solved:
                answers[j] = solved[j]
                if not isinstance(solved[j], str):
                    memo.store(problems[j], solved[j], keys[j])
            elif result is None and j not in solved and not any(_same(problems[j], problems[i]) for i in todo):
                todo.append(j)
        pending.append(todo)
    return answers, memo.hits, pending


def _same(a: IlpProblem, b: IlpProblem) -> bool:
    """Same objective (the caller's walk) and each feasible set inside the other: one solve answers both."""
    return _tighter_or_equal(a, b) and _tighter_or_equal(b, a)
