r"""The sharding ILP (Alpa §4.2) built once, as sparse matrices; ``ilp_highs`` and ``ilp_pulp`` solve it.

Over *classes* (groups of nodes that share one strategy choice) with strategy counts |S_c|, a cost vector
t_c (seconds), a memory vector m_c (bytes), a transient vector p_c (bytes) and, per pair of connected
classes, a resharding matrix R_{cd} (seconds):

    minimize    Σ_c t_c · x_c  +  Σ_{(c,d)} Σ_{ab} R̃_{cd}[a,b] · y_{cd}[a,b]
    subject to  Σ_i x_c[i] = 1                          ∀c         (one strategy)        one_strategy
                Σ_b y_{cd}[a,b] = Σ_{i ∈ a} x_c[i]      ∀(c,d),a   (edge ↔ source)       edge_marginals
                Σ_a y_{cd}[a,b] = Σ_{j ∈ b} x_d[j]      ∀(c,d),b   (edge ↔ destination)  edge_marginals
                T ≥ Σ_i p_c[i] · x_c[i]                 ∀c         (peak transient)      memory_rows
                U ≥ Σ_i u_c[i] · x_c[i]                 ∀c         (gathered units)      memory_rows
                W ≥ Σ_c Σ_i w_{rc}[i] · x_c[i]          ∀r         (recompute replay)    replay_rows
                Σ_c m_c · x_c + T + U + W ≤ M                       (memory)              memory_rows
                x_c ∈ {0,1},  y_{cd} ∈ [0,1],  T, U, W ≥ 0

R̃_{cd} is R_{cd} with equal rows merged into row groups a and equal columns into column groups b: exact,
since with x one-hot the grouped sums are one-hot too, and it shrinks y by the strategies sharing a
layout. m_c is what stays allocated (parameter state, activations saved for backward); p_c the class's
transient (its largest local output and that output's gradient, alive together in backward), so T is the
chosen plan's largest transient and the memory row bounds the peak. u_c (``problem.units``, only when some
class has ZeRO-3 columns: ``intra_op_zero``) is what a column keeps gathered of level-3 parameters; units
are alive across other classes' ops, so U adds to T instead of competing with it. w_{rc}
(``problem.replay``, only with recompute: ``intra_op._class_replay``) is what class c adds to the replay of
recomputed region r: backward re-creates the region's saved tensors while the groups after it have freed
theirs, so W, the largest replay, adds to T as well (a region's backward has its own transients). y needs
no integrality: with x one-hot, the marginals leave one feasible y (the product of the two one-hot vectors).

Folding (exact): a class with one strategy gets no column; its cost and its edges' costs become the
objective's constant or linear terms on the other side; its memory moves to the row's right-hand side
and its transient to T's lower bound. An edge whose merged matrix has one row or one column depends on
one side only and becomes linear terms there. The least-memory model (``min_memory_model``) keeps only
one_strategy and memory_rows (with replay_rows), with objective Σ_c m_c·x_c + T + U + W.

Closing (exact, ``close_overruns``): with a budget, x_c[i] is fixed at 0 where column i overruns M beside
the least state every other class needs (with T ≥ p_c[i] and U ≥ u_c[i]). No integer solution takes such a
column, but the relaxation would, at a fraction, wherever memory binds: the memory row alone does not know
that each other class adds at least its least m_d. Closed, the relaxation is integral more often (GPT-39B's
exact stage solves on 64 V100s: 3 of 11 became integral) and the root's bound is tighter.

Units: the objective in ms (``MS``); memory rows in units of the budget M (or of the largest class memory
when there is none), so a solver's absolute tolerance is relative to the budget.

Column layout: x (one block per class with several strategies, binary), then y (one block per edge
between two such classes, continuous), then T when memory rows are built, then U when there are units,
then W when there are replay rows. Row
order follows the build order. Both orders are fixed: a MIP solver's path depends on them, and plans must
not change by accident.

Adding a constraint family: write one function ``family(builder, problem, x)`` that calls
``builder.columns`` for any new variables and ``builder.row`` for each row (and ``builder.add_cost`` /
``builder.offset`` for objective terms), tag it in the formulation above, and call it from
``sharding_model`` (and ``min_memory_model`` if it constrains memory). Both back ends solve it unchanged.
"""
from __future__ import annotations

import dataclasses

import numpy as np

MS = 1e3  # the objective is written in ms
OVERRUN_SLACK = 1e-9  # a column is closed only when it overruns the budget by more than this (relative)


@dataclasses.dataclass(frozen=True)
class SparseModel:
    """min c·v + offset  s.t.  row_lower ≤ A v ≤ row_upper,  col_lower ≤ v ≤ col_upper,  v_k ∈ ℤ where integer[k].

    A is row-wise sparse (CSR): row r holds ``index[start[r]:start[r+1]]`` with ``value[...]``.
    ``x[c]``: the column indices of class c's one-hot block (None for a folded single-strategy class).
    """

    cost: np.ndarray
    offset: float
    start: np.ndarray
    index: np.ndarray
    value: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray
    col_lower: np.ndarray
    col_upper: np.ndarray
    integer: np.ndarray
    x: tuple
    n_y: int

    @property
    def n_cols(self) -> int:
        return len(self.cost)

    @property
    def n_rows(self) -> int:
        return len(self.row_lower)

    def choice(self, values) -> list[int] | None:
        """The strategy per class a solution vector picks (None when there is no solution)."""
        if values is None:
            return None
        return [0 if cols is None else int(np.argmax(values[cols])) for cols in self.x]


class ModelBuilder:
    """Accumulates columns and rows in build order; ``freeze`` returns the ``SparseModel``."""

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

    def add_cost(self, cols, values) -> None:
        for col, v in zip(cols, values):
            self.cost[col] += float(v)

    def freeze(self, x: list, n_y: int) -> SparseModel:
        lengths = [len(r[0]) for r in self.rows]
        return SparseModel(
            cost=np.asarray(self.cost, dtype=float), offset=self.offset,
            start=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
            index=np.concatenate([r[0] for r in self.rows]).astype(np.int32) if self.rows else np.zeros(0, np.int32),
            value=np.concatenate([r[1] for r in self.rows]) if self.rows else np.zeros(0),
            row_lower=np.array([r[2] for r in self.rows], dtype=float),
            row_upper=np.array([r[3] for r in self.rows], dtype=float),
            col_lower=np.asarray(self.lower, dtype=float), col_upper=np.asarray(self.upper, dtype=float),
            integer=np.asarray(self.integer, dtype=bool), x=tuple(x), n_y=n_y)


def sharding_model(problem) -> SparseModel:
    """The sharding ILP of ``problem`` (an ``ilp.IlpProblem``); memory rows only when it has a budget."""
    builder = ModelBuilder()
    x = one_strategy(builder, problem, objective=True)
    n_y = edge_marginals(builder, problem, x)
    if problem.budget is not None:
        memory_rows(builder, problem, x, problem.budget)
    return builder.freeze(x, n_y)


def min_memory_model(problem) -> SparseModel:
    """min Σ_c m_c·x_c + T over one_strategy and the transient rows (edges play no part)."""
    builder = ModelBuilder()
    x = one_strategy(builder, problem, objective=False)
    memory_rows(builder, problem, x, None, objective_weight=1.0)
    return builder.freeze(x, 0)


def one_strategy(builder: ModelBuilder, problem, objective: bool) -> list:
    """x blocks (None for single-strategy classes, folded into the offset) and their one-hot rows."""
    x = []
    for c in range(problem.n_classes):
        n = len(problem.cost[c])
        if n == 1:
            x.append(None)
            builder.offset += float(problem.cost[c][0]) * MS if objective else 0.0
            continue
        cols = builder.columns(problem.cost[c] * MS if objective else np.zeros(n), 0.0, 1.0, True)
        builder.row(cols, np.ones(n), 1.0, 1.0)
        x.append(cols)
    return x


def edge_marginals(builder: ModelBuilder, problem, x: list) -> int:
    """Edge terms with grouped y (folded where a side is fixed or the cost is one-sided); returns |y|."""
    n_y = 0
    for (c, d), matrix in problem.edges.items():
        matrix = matrix * MS
        if x[c] is None and x[d] is None:
            builder.offset += float(matrix[0, 0])
        elif x[c] is None:
            builder.add_cost(x[d], matrix[0])
        elif x[d] is None:
            builder.add_cost(x[c], matrix[:, 0])
        else:
            n_y += _grouped_edge(builder, matrix, x[c], x[d])
    return n_y


def _grouped_edge(builder: ModelBuilder, matrix: np.ndarray, xc: np.ndarray, xd: np.ndarray) -> int:
    rows, row_of = np.unique(matrix, axis=0, return_inverse=True)
    reduced, col_of = np.unique(rows, axis=1, return_inverse=True)
    row_of, col_of = row_of.ravel(), col_of.ravel()
    if reduced.shape[0] == 1:
        builder.add_cost(xd, reduced[0][col_of])
        return 0
    if reduced.shape[1] == 1:
        builder.add_cost(xc, reduced[:, 0][row_of])
        return 0
    n_rows, n_cols = reduced.shape
    y = builder.columns(reduced, 0.0, 1.0, False).reshape(n_rows, n_cols)
    for a in range(n_rows):
        members = xc[row_of == a]
        builder.row(np.concatenate([y[a], members]), np.concatenate([np.ones(n_cols), -np.ones(len(members))]), 0, 0)
    for b in range(n_cols):
        members = xd[col_of == b]
        builder.row(np.concatenate([y[:, b], members]), np.concatenate([np.ones(n_rows), -np.ones(len(members))]),
                    0, 0)
    return y.size


def memory_rows(builder: ModelBuilder, problem, x: list, budget: float | None, objective_weight: float = 0.0) -> None:
    """The T column, the transient rows (T ≥ p_c·x_c), the U column and its rows where the problem has units,
    and, given a budget, the memory row. T, U and the state Σ m_c·x_c enter the objective with
    ``objective_weight`` (the least-memory model)."""
    unit = memory_unit(problem, budget)
    peak = builder.columns([objective_weight], 0.0, np.inf, False)[0]
    fixed = 0.0
    cols, vals = [peak], [1.0]
    for c in range(problem.n_classes):
        if x[c] is None:
            fixed += float(problem.mem[c][0]) / unit
            if problem.peak is not None:
                builder.lower[peak] = max(builder.lower[peak], float(problem.peak[c][0]) / unit)
            continue
        cols += x[c].tolist()
        vals += (problem.mem[c] / unit).tolist()
        if problem.peak is not None:
            builder.row(np.concatenate([x[c], [peak]]), np.concatenate([problem.peak[c] / unit, [-1.0]]), -np.inf, 0.0)
    gathered = gathered_units(builder, problem, x, unit, objective_weight)
    gathered += replay_rows(builder, problem, x, unit, objective_weight)
    if budget is not None:
        close_overruns(builder, problem, x, budget)
        builder.row(cols + gathered, vals + [1.0] * len(gathered), -np.inf, 1.0 - fixed)
    if objective_weight:
        builder.add_cost(cols[1:], [objective_weight * v for v in vals[1:]])
        builder.offset += objective_weight * fixed


def close_overruns(builder: ModelBuilder, problem, x: list, budget: float) -> None:
    """x_c[i] = 0 where column i cannot fit beside the least every other class needs (exact: no integer
    solution takes it):

        m_c[i] + Σ_{d≠c} min m_d + max(p_c[i], max_d min p_d) + max(u_c[i], max_d min u_d) > M.

    The one-hot rows make Σ_d min m_d a floor of the state only in integers; the memory row alone lets the
    relaxation take a column that overruns by itself at a fraction, which leaves it fractional wherever
    memory binds (and a solver's presolve sees x ≥ 0, not that floor)."""
    least = [float(m.min()) for m in problem.mem]
    total = sum(least)
    transient = max((float(p.min()) for p in problem.peak), default=0.0) if problem.peak is not None else 0.0
    units = getattr(problem, "units", None)
    unit_floor = max((float(u.min()) for u in units), default=0.0) if units is not None else 0.0
    for c in range(problem.n_classes):
        if x[c] is None:
            continue
        need = total - least[c] + problem.mem[c]
        if problem.peak is not None:
            need = need + np.maximum(problem.peak[c], transient)
        if units is not None:
            need = need + np.maximum(units[c], unit_floor)
        for col in x[c][need > budget * (1 + OVERRUN_SLACK)]:
            builder.upper[col] = 0.0


def memory_unit(problem, budget: float | None) -> float:
    """Bytes per unit of the memory columns and rows (the budget, else the largest state entry)."""
    return budget or max(float(max(m.max() for m in problem.mem)), 1.0)


def gathered_units(builder: ModelBuilder, problem, x: list, unit: float, objective_weight: float) -> list:
    """The U column and its rows U ≥ u_c·x_c (a fixed class's entry a lower bound); [U], or [] without units."""
    if getattr(problem, "units", None) is None:
        return []
    units = builder.columns([objective_weight], 0.0, np.inf, False)[0]
    for c in range(problem.n_classes):
        if x[c] is None:
            builder.lower[units] = max(builder.lower[units], float(problem.units[c][0]) / unit)
        elif problem.units[c].any():
            builder.row(np.concatenate([x[c], [units]]), np.concatenate([problem.units[c] / unit, [-1.0]]),
                        -np.inf, 0.0)
    return [units]


def replay_rows(builder: ModelBuilder, problem, x: list, unit: float, objective_weight: float) -> list:
    """The W column and one row W ≥ Σ_c w_rc·x_c per recomputed region r (a fixed class's entry is a
    constant); [W], or [] without recompute."""
    if not getattr(problem, "replay", None):
        return []
    replay = builder.columns([objective_weight], 0.0, np.inf, False)[0]
    for row in problem.replay:
        cols, vals, constant = [replay], [-1.0], 0.0
        for c, vector in enumerate(row):
            if vector is None:
                continue
            if x[c] is None:
                constant += float(vector[0]) / unit
            else:
                cols += x[c].tolist()
                vals += (vector / unit).tolist()
        builder.row(cols, vals, -np.inf, -constant)
    return [replay]
