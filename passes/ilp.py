"""The sharding ILP's front: the problem (``IlpProblem``), solving it, and what follows from a solution.

The formulation, as math with each constraint family tagged by the function that builds it, is in
``ilp_model``, which builds it once as sparse matrices; ``ilp_highs`` (HiGHS, the default when highspy
is installed) and ``ilp_pulp`` (PuLP's bundled CBC) solve that same model. This module picks the back
end, turns a solution vector into a strategy per class, and explains infeasibility: when no plan fits
the memory budget it solves the least-memory model and names the smallest budget that would fit.
Every solve has a time limit; the best integer solution found by then is used.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from autopar.errors import InfeasibleError, budget_unit_hint
from autopar.ir.units import fmt_bytes
from autopar.passes import ilp_highs, ilp_pulp
from autopar.passes.ilp_model import memory_unit, min_memory_model, sharding_model

PROVEN_MARGIN = 1e-6  # above HiGHS's feasibility tolerance on the budget row (scaled to 1): a sure overrun


@dataclasses.dataclass
class IlpProblem:
    """cost[c], mem[c], peak[c]: vectors over class c's strategies; edges[(c, d)]: |S_c|×|S_d| matrices.
    units[c]: bytes of ZeRO-3 units a strategy keeps gathered (a second transient, added to peak's; see
    ``ilp_model``), or None when no class has any. replay[r][c]: what strategies of class c add to the
    replay of recomputed region r (None where nothing; ``ilp_model.replay_rows``), or None without recompute."""

    cost: list[np.ndarray]
    mem: list[np.ndarray]
    edges: dict[tuple[int, int], np.ndarray]
    budget: float | None = None
    peak: list[np.ndarray] | None = None
    units: list[np.ndarray] | None = None
    replay: list[list[np.ndarray | None]] | None = None

    @property
    def n_classes(self) -> int:
        return len(self.cost)


@dataclasses.dataclass
class IlpResult:
    choice: list[int]
    objective: float
    status: str
    seconds: float
    n_variables: int


def backend(requested: str = "auto") -> str:
    """"highs" (highspy) when installed, else "pulp" (PuLP with its bundled CBC). ``requested`` forces one."""
    if requested == "auto":
        return "highs" if ilp_highs.available() else "pulp"
    if requested not in ("highs", "pulp") or (requested == "highs" and not ilp_highs.available()):
        raise ValueError(f"ILP backend {requested!r} is not available; use 'pulp' or install highspy")
    return requested


def _solve(model, time_limit: float, which: str, presolve: bool = True):
    return (ilp_highs if backend(which) == "highs" else ilp_pulp).solve(model, time_limit, presolve)


def solve_ilp(problem: IlpProblem, time_limit: float = 60.0, which: str = "auto", presolve: bool = True) -> IlpResult:
    """Solve the ILP; raises InfeasibleError (naming the smallest feasible budget) if memory cannot fit.
    presolve=False: a quicker solve within the same gap (``ilp_highs.solve``), for prices, not plans."""
    start = time.perf_counter()
    model = sharding_model(problem)
    status, values = _solve(model, time_limit, which, presolve)
    choice = model.choice(values)
    if choice is None:
        _explain_no_solution(problem, status, time_limit, which)
    n_vars = sum(len(c) for c in problem.cost if len(c) > 1) + model.n_y
    return IlpResult(choice, evaluate(problem, choice), status, time.perf_counter() - start, n_vars)


def _explain_no_solution(problem: IlpProblem, status: str, time_limit: float, which: str) -> None:
    """Raise the most useful InfeasibleError: the smallest budget that fits, when memory is the cause."""
    if problem.budget is not None:
        floor = min_memory(problem, which=which)
        if floor > problem.budget * (1 + 1e-9):
            raise InfeasibleError(_infeasible_message(problem.budget, floor))
    raise InfeasibleError(f"the sharding ILP found no solution ({status}) within {time_limit:.0f} s; "
                          f"raise the solver time limit or the memory budget")


def evaluate(problem: IlpProblem, choice: list[int]) -> float:
    """The objective of a given choice (used to report, and to check the solver's answer)."""
    total = sum(float(problem.cost[c][choice[c]]) for c in range(problem.n_classes))
    total += sum(float(m[choice[c], choice[d]]) for (c, d), m in problem.edges.items())
    return total


def memory_of(problem: IlpProblem, choice: list[int]) -> float:
    """Peak bytes per device of a choice: allocated state plus the largest transient."""
    state = sum(float(problem.mem[c][choice[c]]) for c in range(problem.n_classes))
    return state + transient_of(problem, choice) + units_of(problem, choice) + replay_of(problem, choice)


def replay_of(problem: IlpProblem, choice: list[int]) -> float:
    """The largest replay of a recomputed region a choice makes (0 without recompute)."""
    if not problem.replay:
        return 0.0
    return max(0.0, max(sum(float(v[choice[c]]) for c, v in enumerate(row) if v is not None)
                        for row in problem.replay))


def units_of(problem: IlpProblem, choice: list[int]) -> float:
    """The gathered ZeRO-3 units a choice keeps whole at once (0 without units)."""
    if problem.units is None:
        return 0.0
    return max((float(problem.units[c][choice[c]]) for c in range(problem.n_classes)), default=0.0)


def transient_of(problem: IlpProblem, choice: list[int]) -> float:
    if problem.peak is None:
        return 0.0
    return max((float(problem.peak[c][choice[c]]) for c in range(problem.n_classes)), default=0.0)


def min_memory(problem: IlpProblem, time_limit: float = 30.0, which: str = "auto") -> float:
    """The least peak memory any choice needs: min Σ_c m_c·x_c + T, T ≥ p_c·x_c (no edges, so small)."""
    if problem.peak is None:
        return sum(float(m.min()) for m in problem.mem)
    model = min_memory_model(problem)
    return memory_of(problem, model.choice(_solve(model, time_limit, which)[1]))


def raise_if_proven_over_budget(problem: IlpProblem, time_limit: float = 30.0) -> None:
    """The InfeasibleError ``solve_ilp`` would raise (naming ``min_memory``'s floor), without its full
    solve, when the least-memory ILP proves that no choice fits the budget: its dual bound, a lower bound
    of every choice's memory, is above it. Returns when not proven (no budget, or no HiGHS)."""
    if problem.budget is None or problem.peak is None or backend() != "highs":
        return
    model = min_memory_model(problem)
    _, values, bound = ilp_highs.solve_bounded(model, time_limit)
    if values is not None and bound * memory_unit(problem, None) > problem.budget * (1 + PROVEN_MARGIN):
        raise InfeasibleError(_infeasible_message(problem.budget, memory_of(problem, model.choice(values))))


def _infeasible_message(budget: float, floor: float) -> str:
    return (f"no sharding fits the memory budget: {fmt_bytes(budget)} per device, but the smallest plan "
            f"needs {fmt_bytes(floor)} ({floor:.0f} bytes). Fix: give each device at least that much "
            f"(memory_per_device), use more devices, or add pipeline stages." + budget_unit_hint(budget))
