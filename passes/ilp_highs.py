"""HiGHS back end: a ``SparseModel`` (``ilp_model``) handed to highspy as row-wise sparse matrices.

Invariant of every solve (the stage DP's quick prices, ``presolve=False``, and the exact stage solves): its
answer is an optimum of the model within ``MIP_GAP``. It first solves the LP relaxation (integrality dropped);
when every integer column comes back within ``INTEGRAL`` of 0 or 1 that vertex is an integer solution whose
objective is the relaxation's, a lower bound of every integer solution's, so it is an exact optimum (gap 0).
Only a fractional relaxation goes on to the MIP. The sharding models' relaxations are integral almost always
(Llama-3-8B's pricing: every unconstrained solve), and the LP alone takes a tenth of the MIP's time, which
spends the rest on root work (probing, cliques, heuristics) after the same LP (a 135-class exact solve of
Llama-2-70B's: 2.6 CPU s as a MIP with presolve, 0.3 s as its integral relaxation).

Why not through PuLP: PuLP builds one Python object per variable and constraint; for our models
(thousands of edge variables, solved dozens of times by the stage DP) that took longer than HiGHS's own
solve. ``ilp_pulp`` solves the same model with PuLP's bundled CBC; a test checks that both agree.
"""
from __future__ import annotations

import os

import numpy as np

from autopar.passes.ilp_model import SparseModel

try:
    import highspy
except ImportError:  # pragma: no cover - exercised where highspy is not installed
    highspy = None

MIP_GAP = 1e-3  # relative gap: plans within 0.1 % of the optimum; HiGHS default is 1e-4
INTEGRAL = 1e-9  # a relaxation's integer column this close to 0 or 1 counts as integral
# HiGHS's primal heuristics (sub-MIPs RINS and RENS, feasibility jump, the rest by effort) off: the sharding
# models are solved at the root, with one or two classes fractional where memory binds, so branching on them
# finds the integer optimum itself; the heuristics were a third of the time of those solves (GPT-39B on 64
# V100s: pricing solves 3.3 -> 2.1 CPU s, exact stage solves 3.6 -> 2.8; every answer within MIP_GAP).
NO_PRIMAL_HEURISTICS = {"mip_heuristic_run_rins": False, "mip_heuristic_run_rens": False,
                        "mip_heuristic_run_feasibility_jump": False, "mip_heuristic_effort": 0.0}


def _reset_scheduler_after_fork() -> None:
    """Drop the thread pool a forked child inherited without its threads (module docstring)."""
    highspy.Highs.resetGlobalScheduler(True)


if highspy is not None and hasattr(highspy.Highs, "resetGlobalScheduler"):
    os.register_at_fork(after_in_child=_reset_scheduler_after_fork)


def available() -> bool:
    return highspy is not None


def solve(model: SparseModel, time_limit: float, presolve: bool = True) -> tuple[str, np.ndarray | None]:
    """(HiGHS model status, column values or None when no primal solution was found).

    presolve=False skips HiGHS's presolve. The sharding models are solved at the root (their LP relaxation
    is integral or nearly), where presolve is most of the time: without it a solve takes about half as long
    and returns a solution within the same ``MIP_GAP``, though not always the same one among near-equal
    layouts. The stage DP's pricing solves use it (``inter_op``); exact solves keep presolve. Both try the
    LP relaxation first and keep it when integral (module docstring): an exact optimum either way."""
    if model.n_cols:
        status, values = _integral_relaxation(model, time_limit)
        if values is not None:
            return status, values
    status, values, _ = solve_bounded(model, time_limit, presolve)
    return status, values


def _integral_relaxation(model: SparseModel, time_limit: float) -> tuple[str, np.ndarray | None]:
    """("Optimal", the LP relaxation's solution) when it is optimal and integral, else ("", None)."""
    _, values = relaxation(model, time_limit)
    if values is None or not is_integral(model, values):
        return "", None
    return "Optimal", values


def relaxation(model: SparseModel, time_limit: float) -> tuple[float, np.ndarray | None]:
    """(objective, column values) of the LP relaxation (integrality dropped), a lower bound of every integer
    solution's objective; (inf, None) when it is not solved to optimality (infeasible, or out of time)."""
    h = _highs(time_limit, presolve=False)
    lp = _highs_lp(model)
    lp.integrality_ = []
    h.passModel(lp)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return np.inf, None
    return float(h.getInfo().objective_function_value), np.asarray(h.getSolution().col_value)


def is_integral(model: SparseModel, values: np.ndarray) -> bool:
    """Every integer column of ``values`` within ``INTEGRAL`` of an integer."""
    ints = values[np.asarray(model.integer, dtype=bool)]
    return not np.any(np.abs(ints - np.round(ints)) > INTEGRAL)


def solve_bounded(model: SparseModel, time_limit: float,
                  presolve: bool = True) -> tuple[str, np.ndarray | None, float]:
    """``solve``, and a proven lower bound of the objective (HiGHS's MIP dual bound; -inf when none)."""
    if not model.n_cols:  # every class has one strategy: nothing to decide
        return "Optimal", np.zeros(0), model.offset
    h = _highs(time_limit, presolve)
    h.passModel(_highs_lp(model))
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    values = np.asarray(h.getSolution().col_value) if info.primal_solution_status else None
    bound = info.mip_dual_bound if status == highspy.HighsModelStatus.kOptimal else -np.inf
    return h.modelStatusToString(status), values, float(bound)


def _highs(time_limit: float, presolve: bool):
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", MIP_GAP)
    for option, value in NO_PRIMAL_HEURISTICS.items():
        h.setOptionValue(option, value)
    if not presolve:
        h.setOptionValue("presolve", "off")
    return h


def _highs_lp(model: SparseModel):
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = model.n_cols, model.n_rows
    lp.col_cost_ = model.cost
    lp.col_lower_, lp.col_upper_ = model.col_lower, model.col_upper
    lp.row_lower_, lp.row_upper_ = model.row_lower, model.row_upper
    lp.offset_ = model.offset
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = model.start
    lp.a_matrix_.index_ = model.index if model.n_rows else []
    lp.a_matrix_.value_ = model.value if model.n_rows else []
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                       for i in model.integer]
    return lp
