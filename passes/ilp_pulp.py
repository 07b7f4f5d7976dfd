"""PuLP back end: the same ``SparseModel`` (``ilp_model``) as a PuLP problem, solved by the CBC PuLP bundles.

The path when highspy is not installed, and a second solver the tests compare against (the design names
PuLP). One PuLP variable per column and one constraint per row, read straight from the CSR matrix, so
the two back ends cannot drift apart.
"""
from __future__ import annotations

import math

import numpy as np
import pulp

from autopar.passes.ilp_model import SparseModel

_OK = ("Optimal", "Not Solved")  # "Not Solved": CBC stopped at the time limit, possibly with a solution


def solve(model: SparseModel, time_limit: float, presolve: bool = True) -> tuple[str, np.ndarray | None]:
    """(PuLP status, column values or None when CBC found no integer solution). ``presolve`` is HiGHS's
    (``ilp_highs.solve``); CBC keeps its own presolve either way."""
    if not model.n_cols:  # every class has one strategy: nothing to decide
        return "Optimal", np.zeros(0)
    problem = pulp.LpProblem("autopar_ilp", pulp.LpMinimize)
    v = [_variable(k, model) for k in range(model.n_cols)]
    problem += pulp.lpDot(model.cost.tolist(), v) + model.offset
    for r in range(model.n_rows):
        lo, hi = model.start[r], model.start[r + 1]
        expr = pulp.LpAffineExpression([(v[k], float(a)) for k, a in zip(model.index[lo:hi], model.value[lo:hi])])
        _add_row(problem, expr, float(model.row_lower[r]), float(model.row_upper[r]), r)
    status = pulp.LpStatus[problem.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit))]
    values = np.array([var.value() if var.value() is not None else math.nan for var in v])
    if status not in _OK or not _integral_solution(model, values):
        return status, None
    return status, values


def _variable(k: int, model: SparseModel):
    upper = None if math.isinf(model.col_upper[k]) else float(model.col_upper[k])
    cat = "Integer" if model.integer[k] else "Continuous"
    return pulp.LpVariable(f"v{k}", lowBound=float(model.col_lower[k]), upBound=upper, cat=cat)


def _add_row(problem, expr, lo: float, hi: float, r: int) -> None:
    if lo == hi:
        problem += expr == hi, f"r{r}"
        return
    if not math.isinf(hi):
        problem += expr <= hi, f"r{r}_hi"
    if not math.isinf(lo):
        problem += expr >= lo, f"r{r}_lo"


def _integral_solution(model: SparseModel, values: np.ndarray) -> bool:
    """Every one-hot block holds a chosen strategy (CBC returns no values when it found no solution)."""
    return all(cols is None or np.nanmax(values[cols]) > 0.5 for cols in model.x)
