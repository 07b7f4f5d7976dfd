"""The sharding ILP of ``passes/ilp.py`` handed to HiGHS as sparse matrices, without PuLP.

Why not PuLP here: PuLP builds one Python object per variable and constraint; for our models (thousands
of edge variables, solved dozens of times by the stage DP) that took longer than HiGHS's own solve. The
formulation is the same — ``ilp.py``'s docstring is the reference, and PuLP (with its bundled CBC) stays
the fallback when highspy is not installed; a test checks that both back ends agree.

Column layout: x (one block per class with several strategies, binary), then y (one block per edge
between two such classes, over the edge matrix's distinct row and column groups, continuous in [0, 1]),
then T (the peak transient, continuous ≥ 0) when a memory budget is set.
"""
from __future__ import annotations

import numpy as np

try:
    import highspy
except ImportError:  # pragma: no cover - exercised where highspy is not installed
    highspy = None

MS = 1e3  # seconds are written in ms, as in ilp.py
MIP_GAP = 1e-3  # relative gap: plans within 0.1 % of the optimum; HiGHS default is 1e-4


class _Model:
    """Accumulates columns and rows; ``solve`` passes them to HiGHS in row-wise CSR form."""

    def __init__(self):
        self.cost, self.lower, self.upper, self.integer = [], [], [], []
        self.rows: list[tuple[np.ndarray, np.ndarray, float, float]] = []
        self.offset = 0.0

    def columns(self, cost, lower: float, upper: float, integer: bool) -> np.ndarray:
        cost = np.asarray(cost, dtype=float).ravel()
        start = len(self.cost)
        self.cost += cost.tolist()
        self.lower += [lower] * len(cost)
        self.upper += [upper] * len(cost)
        self.integer += [integer] * len(cost)
        return np.arange(start, start + len(cost))

    def row(self, cols, vals, lo: float, hi: float) -> None:
        self.rows.append((np.asarray(cols, dtype=np.int64), np.asarray(vals, dtype=float), lo, hi))

    def solve(self, time_limit: float):
        if not self.cost:  # every class has one strategy: nothing to decide
            return "Optimal", np.zeros(0)
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = len(self.cost), len(self.rows)
        lp.col_cost_ = np.asarray(self.cost)
        lp.col_lower_, lp.col_upper_ = np.asarray(self.lower), np.asarray(self.upper)
        lp.row_lower_ = np.array([r[2] for r in self.rows])
        lp.row_upper_ = np.array([r[3] for r in self.rows])
        lp.offset_ = self.offset
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.concatenate([[0], np.cumsum([len(r[0]) for r in self.rows])]).astype(np.int32)
        lp.a_matrix_.index_ = np.concatenate([r[0] for r in self.rows]).astype(np.int32) if self.rows else []
        lp.a_matrix_.value_ = np.concatenate([r[1] for r in self.rows]) if self.rows else []
        lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                           for i in self.integer]
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("time_limit", float(time_limit))
        h.setOptionValue("mip_rel_gap", MIP_GAP)
        h.passModel(lp)
        h.run()
        status = h.getModelStatus()
        values = np.asarray(h.getSolution().col_value) if h.getInfo().primal_solution_status else None
        return h.modelStatusToString(status), values


def _x_columns(model: _Model, problem, objective: bool) -> list:
    """x blocks (None for single-strategy classes), one-strategy rows; returns the column index arrays."""
    x = []
    for c in range(problem.n_classes):
        n = len(problem.cost[c])
        if n == 1:
            x.append(None)
            model.offset += float(problem.cost[c][0]) * MS if objective else 0.0
            continue
        cols = model.columns(problem.cost[c] * MS if objective else np.zeros(n), 0.0, 1.0, True)
        model.row(cols, np.ones(n), 1.0, 1.0)
        x.append(cols)
    return x


def _edges(model: _Model, problem, x: list) -> int:
    """Edge terms with grouped y (see ilp._edge_marginals); returns the number of y columns."""
    n_y = 0
    for (c, d), matrix in problem.edges.items():
        matrix = matrix * MS
        if x[c] is None and x[d] is None:
            model.offset += float(matrix[0, 0])
        elif x[c] is None:
            model.cost = _add(model.cost, x[d], matrix[0])
        elif x[d] is None:
            model.cost = _add(model.cost, x[c], matrix[:, 0])
        else:
            n_y += _grouped_edge(model, matrix, x[c], x[d])
    return n_y


def _add(cost: list, cols: np.ndarray, values: np.ndarray) -> list:
    for col, v in zip(cols, values):
        cost[col] += float(v)
    return cost


def _grouped_edge(model: _Model, matrix: np.ndarray, xc: np.ndarray, xd: np.ndarray) -> int:
    rows, row_of = np.unique(matrix, axis=0, return_inverse=True)
    reduced, col_of = np.unique(rows, axis=1, return_inverse=True)
    row_of, col_of = row_of.ravel(), col_of.ravel()
    if reduced.shape[0] == 1:
        model.cost = _add(model.cost, xd, reduced[0][col_of])
        return 0
    if reduced.shape[1] == 1:
        model.cost = _add(model.cost, xc, reduced[:, 0][row_of])
        return 0
    n_rows, n_cols = reduced.shape
    y = model.columns(reduced, 0.0, 1.0, False).reshape(n_rows, n_cols)
    for a in range(n_rows):
        members = xc[row_of == a]
        model.row(np.concatenate([y[a], members]), np.concatenate([np.ones(n_cols), -np.ones(len(members))]), 0, 0)
    for b in range(n_cols):
        members = xd[col_of == b]
        model.row(np.concatenate([y[:, b], members]), np.concatenate([np.ones(n_rows), -np.ones(len(members))]), 0, 0)
    return y.size


def _memory(model: _Model, problem, x: list, budget: float | None, objective_weight: float = 0.0) -> None:
    """The memory row and the peak-transient rows (T ≥ p_c·x_c); T also enters the objective with
    ``objective_weight`` (used to minimize memory). Bytes are measured in units of the budget (or of the
    largest class memory), so the solver's absolute tolerance is a relative one on the budget."""
    unit = budget or max(float(max(m.max() for m in problem.mem)), 1.0)
    peak = model.columns([objective_weight], 0.0, np.inf, False)[0]
    fixed = 0.0
    cols, vals = [peak], [1.0]
    for c in range(problem.n_classes):
        if x[c] is None:
            fixed += float(problem.mem[c][0]) / unit
            if problem.peak is not None:
                model.lower[peak] = max(model.lower[peak], float(problem.peak[c][0]) / unit)
            continue
        cols += x[c].tolist()
        vals += (problem.mem[c] / unit).tolist()
        if problem.peak is not None:
            model.row(np.concatenate([x[c], [peak]]), np.concatenate([problem.peak[c] / unit, [-1.0]]), -np.inf, 0.0)
    if budget is not None:
        model.row(cols, vals, -np.inf, 1.0 - fixed)
    if objective_weight:
        for col, v in zip(cols[1:], vals[1:]):
            model.cost[col] += objective_weight * v
        model.offset += objective_weight * fixed


def solve_highs(problem, time_limit: float) -> tuple[str, list[int] | None, int]:
    """(status, choice per class or None, number of y columns) of the sharding ILP."""
    model = _Model()
    x = _x_columns(model, problem, objective=True)
    n_y = _edges(model, problem, x)
    if problem.budget is not None:
        _memory(model, problem, x, problem.budget)
    status, values = model.solve(time_limit)
    return status, _choice(x, values), n_y


def min_memory_highs(problem, time_limit: float) -> list[int] | None:
    """The choice with the least peak memory (Σ state + the largest transient); edges play no part."""
    model = _Model()
    x = _x_columns(model, problem, objective=False)
    _memory(model, problem, x, None, objective_weight=1.0)
    return _choice(x, model.solve(time_limit)[1])


def _choice(x: list, values) -> list[int] | None:
    if values is None:
        return None
    return [0 if cols is None else int(np.argmax(values[cols])) for cols in x]
