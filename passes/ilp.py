r"""The sharding ILP (Alpa §4.2), over *classes*: groups of nodes that share one strategy choice.

Given classes c with strategy counts |S_c|, a cost vector t_c (seconds), a memory vector m_c (bytes)
and, per pair of connected classes, a resharding matrix R_{cd} (seconds):

    minimize    Σ_c t_c · x_c  +  Σ_{(c,d)} Σ_{ij} R_{cd}[i,j] · y_{cd}[i,j]
    subject to  Σ_i x_c[i] = 1                          ∀c        (one strategy)        _one_strategy
                Σ_j y_{cd}[i,j] = x_c[i]                ∀(c,d),i  (edge ↔ source)       _edge_marginals
                Σ_i y_{cd}[i,j] = x_d[j]                ∀(c,d),j  (edge ↔ destination)  _edge_marginals
                Σ_c m_c · x_c + T ≤ M                              (memory)              _memory_row
                T ≥ Σ_i p_c[i] · x_c[i]                 ∀c        (peak transient)      _memory_row
                x_c ∈ {0,1},  y_{cd} ∈ [0,1],  T ≥ 0

m_c is what stays allocated (parameter state, activations saved for backward); p_c the transient of the
class (its largest local output and that output's gradient, alive together during backward), so T is
the largest transient of the chosen plan and the memory row bounds the peak.

y needs no integrality: with x one-hot, the marginals leave exactly one feasible y (the product of the
two one-hot vectors). Classes with a single strategy get no variables; their edges fold into linear
terms on the other side. Solver: HiGHS given sparse matrices directly (``ilp_highs``) when highspy is
installed, else PuLP with the CBC it bundles; always with a time limit, returning the best integer
solution found when it hits the limit.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pulp

from autopar.errors import InfeasibleError, budget_unit_hint
from autopar.ir.units import fmt_bytes
from autopar.passes import ilp_highs

MS = 1e3  # the objective is written in ms; memory rows in units of the budget (see _memory_row)


@dataclasses.dataclass
class IlpProblem:
    """cost[c], mem[c], peak[c]: vectors over class c's strategies; edges[(c, d)]: |S_c|×|S_d| matrices."""

    cost: list[np.ndarray]
    mem: list[np.ndarray]
    edges: dict[tuple[int, int], np.ndarray]
    budget: float | None = None
    peak: list[np.ndarray] | None = None

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


def solver(time_limit: float):
    """HiGHS when available (faster), else PuLP's bundled CBC; both with ``time_limit`` seconds."""
    if "HiGHS" in pulp.listSolvers(onlyAvailable=True):
        return pulp.HiGHS(msg=False, timeLimit=time_limit)
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit)


def backend(requested: str = "auto") -> str:
    """"highs" (HiGHS through highspy, built as sparse matrices: ``ilp_highs``) when installed, else
    "pulp" (PuLP with its bundled CBC). ``requested`` forces one."""
    if requested == "auto":
        return "highs" if ilp_highs.highspy is not None else "pulp"
    if requested not in ("highs", "pulp") or (requested == "highs" and ilp_highs.highspy is None):
        raise ValueError(f"ILP backend {requested!r} is not available; use 'pulp' or install highspy")
    return requested


def solve_ilp(problem: IlpProblem, time_limit: float = 60.0, which: str = "auto") -> IlpResult:
    """Solve the ILP; raises InfeasibleError (naming the smallest feasible budget) if memory cannot fit."""
    start = time.perf_counter()
    if backend(which) == "highs":
        status, choice, n_y = ilp_highs.solve_highs(problem, time_limit)
        if choice is None:
            _explain_no_solution(problem, status, time_limit, which)
        n_vars = sum(len(c) for c in problem.cost if len(c) > 1) + n_y
        return IlpResult(choice, evaluate(problem, choice), status, time.perf_counter() - start, n_vars)
    return _solve_pulp(problem, time_limit, start)


def _explain_no_solution(problem: IlpProblem, status: str, time_limit: float, which: str) -> None:
    """Raise the most useful InfeasibleError: the smallest budget that fits, when memory is the cause."""
    if problem.budget is not None:
        floor = min_memory(problem, which=which)
        if floor > problem.budget * (1 + 1e-9):
            raise InfeasibleError(_infeasible_message(problem.budget, floor))
    raise InfeasibleError(f"the sharding ILP found no solution ({status}) within {time_limit:.0f} s; "
                          f"raise the solver time limit or the memory budget")


def _solve_pulp(problem: IlpProblem, time_limit: float, start: float) -> IlpResult:
    model = pulp.LpProblem("autopar_sharding", pulp.LpMinimize)
    x = _one_strategy(model, problem)
    objective = [pulp.lpDot((problem.cost[c] * MS).tolist(), x[c]) for c in range(problem.n_classes) if len(x[c]) > 1]
    constant = sum(float(problem.cost[c][0]) * MS for c in range(problem.n_classes) if len(x[c]) == 1)
    n_y, terms, constant_edges = _edge_marginals(model, problem, x)
    model += pulp.lpSum(objective + terms) + constant + constant_edges
    _memory_row(model, problem, x)
    status = model.solve(solver(time_limit))
    if pulp.LpStatus[status] not in ("Optimal", "Not Solved") or not _has_solution(x):
        _explain_no_solution(problem, pulp.LpStatus[status], time_limit, "pulp")
    choice = [_argmax(xc) for xc in x]
    objective_value = evaluate(problem, choice)
    n_vars = sum(len(xc) for xc in x if len(xc) > 1) + n_y
    return IlpResult(choice, objective_value, pulp.LpStatus[status], time.perf_counter() - start, n_vars)


def _one_strategy(model, problem: IlpProblem) -> list[list]:
    x = []
    for c in range(problem.n_classes):
        n = len(problem.cost[c])
        if n == 1:
            x.append([1])
            continue
        xc = [pulp.LpVariable(f"x_{c}_{i}", cat="Binary") for i in range(n)]
        model += pulp.lpSum(xc) == 1
        x.append(xc)
    return x


def _edge_marginals(model, problem: IlpProblem, x) -> tuple[int, list, float]:
    """Edge terms. Rows (columns) of a matrix that are equal are merged first: y lives on the distinct
    (row group, column group) pairs, with marginals Σ_j y[a, j] = Σ_{i ∈ a} x_c[i]. Exact, since with x
    one-hot the grouped sums are one-hot too; it shrinks y by the strategies that share a layout."""
    terms, constant, n_y = [], 0.0, 0
    for (c, d), matrix in problem.edges.items():
        matrix = matrix * MS
        if len(x[c]) == 1 and len(x[d]) == 1:
            constant += float(matrix[0, 0])
        elif len(x[c]) == 1:
            terms.append(pulp.lpDot(matrix[0].tolist(), x[d]))
        elif len(x[d]) == 1:
            terms.append(pulp.lpDot(matrix[:, 0].tolist(), x[c]))
        else:
            rows, row_of = np.unique(matrix, axis=0, return_inverse=True)
            cols, col_of = np.unique(rows, axis=1, return_inverse=True)
            if cols.shape[0] == 1 or cols.shape[1] == 1:  # the cost depends on one side only
                terms.append(_one_sided(cols, row_of.ravel(), col_of.ravel(), x[c], x[d]))
                continue
            n_y += cols.size
            terms.append(_grouped_y(model, f"{c}_{d}", cols, row_of.ravel(), col_of.ravel(), x[c], x[d]))
    return n_y, terms, constant


def _group_sums(x, group_of, n_groups) -> list:
    return [pulp.lpSum(x[i] for i in range(len(x)) if group_of[i] == g) for g in range(n_groups)]


def _one_sided(reduced: np.ndarray, row_of, col_of, xc, xd):
    if reduced.shape[0] == 1:
        return pulp.lpDot(reduced[0][col_of].tolist(), xd)
    return pulp.lpDot(reduced[:, 0][row_of].tolist(), xc)


def _grouped_y(model, tag: str, reduced: np.ndarray, row_of, col_of, xc, xd):
    n_rows, n_cols = reduced.shape
    xr, xk = _group_sums(xc, row_of, n_rows), _group_sums(xd, col_of, n_cols)
    y = [[pulp.LpVariable(f"y_{tag}_{a}_{b}", lowBound=0, upBound=1) for b in range(n_cols)] for a in range(n_rows)]
    for a in range(n_rows):
        model += pulp.lpSum(y[a]) == xr[a]
    for b in range(n_cols):
        model += pulp.lpSum(y[a][b] for a in range(n_rows)) == xk[b]
    return pulp.lpSum(float(reduced[a, b]) * y[a][b] for a in range(n_rows) for b in range(n_cols) if reduced[a, b])


def _memory_row(model, problem: IlpProblem, x) -> None:
    """Bytes in units of the budget: the solver's absolute tolerance becomes relative to it."""
    if problem.budget is None:
        return
    unit = problem.budget
    fixed = sum(float(problem.mem[c][0]) for c in range(problem.n_classes) if len(x[c]) == 1) / unit
    variable = [pulp.lpDot((problem.mem[c] / unit).tolist(), x[c]) for c in range(problem.n_classes)
                if len(x[c]) > 1]
    peak = pulp.LpVariable("peak_transient", lowBound=0)
    _peak_rows(model, problem, x, peak, unit)
    model += pulp.lpSum(variable) + fixed + peak <= 1.0


def _peak_rows(model, problem: IlpProblem, x, peak, unit: float) -> None:
    for c in range(problem.n_classes) if problem.peak is not None else ():
        if len(x[c]) == 1:
            model += peak >= float(problem.peak[c][0]) / unit
        else:
            model += peak >= pulp.lpDot((problem.peak[c] / unit).tolist(), x[c])


def _replicated_memory(problem: IlpProblem) -> float:
    """A quick upper bound: the most memory any one strategy per class could take."""
    state = sum(float(m.max()) for m in problem.mem)
    return state + (max((float(p.max()) for p in problem.peak), default=0.0) if problem.peak is not None else 0.0)


def _has_solution(x) -> bool:
    return all(len(xc) == 1 or any((v.value() or 0) > 0.5 for v in xc) for xc in x)


def _argmax(xc) -> int:
    if len(xc) == 1:
        return 0
    return int(np.argmax([v.value() or 0.0 for v in xc]))


def evaluate(problem: IlpProblem, choice: list[int]) -> float:
    """The objective of a given choice (used to report, and to check the solver's answer)."""
    total = sum(float(problem.cost[c][choice[c]]) for c in range(problem.n_classes))
    total += sum(float(m[choice[c], choice[d]]) for (c, d), m in problem.edges.items())
    return total


def memory_of(problem: IlpProblem, choice: list[int]) -> float:
    """Peak bytes per device of a choice: allocated state plus the largest transient."""
    state = sum(float(problem.mem[c][choice[c]]) for c in range(problem.n_classes))
    return state + transient_of(problem, choice)


def transient_of(problem: IlpProblem, choice: list[int]) -> float:
    if problem.peak is None:
        return 0.0
    return max((float(problem.peak[c][choice[c]]) for c in range(problem.n_classes)), default=0.0)


def min_memory(problem: IlpProblem, time_limit: float = 30.0, which: str = "auto") -> float:
    """The least peak memory any choice needs: min Σ_c m_c·x_c + T, T ≥ p_c·x_c (no edges, so small)."""
    if problem.peak is None:
        return sum(float(m.min()) for m in problem.mem)
    if backend(which) == "highs":
        return memory_of(problem, ilp_highs.min_memory_highs(problem, time_limit))
    model = pulp.LpProblem("autopar_min_memory", pulp.LpMinimize)
    x = _one_strategy(model, problem)
    unit = max(float(max(m.max() for m in problem.mem)), 1.0)
    state = [pulp.lpDot((problem.mem[c] / unit).tolist(), x[c]) for c in range(problem.n_classes) if len(x[c]) > 1]
    fixed = sum(float(problem.mem[c][0]) for c in range(problem.n_classes) if len(x[c]) == 1) / unit
    peak = pulp.LpVariable("peak_transient", lowBound=0)
    _peak_rows(model, problem, x, peak, unit)
    model += pulp.lpSum(state) + fixed + peak
    model.solve(solver(time_limit))
    return memory_of(problem, [_argmax(xc) for xc in x])


def _infeasible_message(budget: float, floor: float) -> str:
    return (f"no sharding fits the memory budget: {fmt_bytes(budget)} per device, but the smallest plan "
            f"needs {fmt_bytes(floor)} ({floor:.0f} bytes). Fix: give each device at least that much "
            f"(memory_per_device), use more devices, or add pipeline stages." + budget_unit_hint(budget))
