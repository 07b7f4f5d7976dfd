"""The sharding ILP: both back ends (HiGHS from sparse matrices, PuLP+CBC) agree, and the memory row binds."""
import numpy as np
import pytest

from autopar.errors import InfeasibleError
from autopar.passes.ilp import (
    IlpProblem,
    backend,
    evaluate,
    memory_of,
    min_memory,
    raise_if_proven_over_budget,
    solve_ilp,
)


def random_problem(rng, classes=6, budget=None):
    sizes = rng.integers(1, 5, size=classes)
    cost = [rng.uniform(0, 1, n) for n in sizes]
    mem = [rng.uniform(1, 2, n) * 2**30 for n in sizes]
    peak = [rng.uniform(0, 0.5, n) * 2**30 for n in sizes]
    edges = {}
    for c in range(classes - 1):
        m = rng.uniform(0, 1, (sizes[c], sizes[c + 1]))
        m[:, 0] = m[:, 0].mean()  # repeated columns exercise the grouping
        edges[(c, c + 1)] = m
    return IlpProblem(cost, mem, edges, budget, peak)


def brute(problem):
    import itertools

    best = None
    for choice in itertools.product(*[range(len(c)) for c in problem.cost]):
        if problem.budget is not None and memory_of(problem, list(choice)) > problem.budget:
            continue
        value = evaluate(problem, list(choice))
        best = value if best is None else min(best, value)
    return best


@pytest.mark.parametrize("seed", range(8))
def test_backends_agree_with_brute_force(seed):
    rng = np.random.default_rng(seed)
    problem = random_problem(rng)
    problem.budget = 0.5 * (min_memory(problem, which="pulp") + memory_of(problem, [0] * problem.n_classes))
    want = brute(problem)
    for which in ("pulp", "highs"):
        if which == "highs" and backend() != "highs":
            pytest.skip("highspy not installed")
        result = solve_ilp(problem, 30, which=which)
        assert result.objective == pytest.approx(want, rel=1e-6), which
        assert memory_of(problem, result.choice) <= problem.budget * (1 + 1e-9)
    assert min_memory(problem, which="pulp") == pytest.approx(min_memory(problem, which="highs"))


def test_infeasible_budget_names_the_floor():
    problem = random_problem(np.random.default_rng(1))
    floor = min_memory(problem)
    problem.budget = 0.9 * floor
    with pytest.raises(InfeasibleError, match="smallest plan needs"):
        solve_ilp(problem, 30)


@pytest.mark.skipif(backend() != "highs", reason="the proof is HiGHS's dual bound")
@pytest.mark.parametrize("seed", range(4))
def test_a_budget_proven_too_small_raises_what_the_full_solve_raises(seed):
    """The skip before a full solve (the least-memory ILP's dual bound above the budget) raises the very
    error solve_ilp raises, and never where a choice fits: at the floor itself it returns and the solve
    finds a plan (the negative control); with recompute's replay rows too."""
    rng = np.random.default_rng(200 + seed)
    problem = random_problem(rng)
    if seed % 2:
        problem.replay = [[rng.uniform(-1, 3, len(c)) * 2**30 if rng.random() < 0.6 else None
                           for c in problem.cost] for _ in range(2)]
    floor = min_memory(problem)
    problem.budget = 0.99 * floor
    with pytest.raises(InfeasibleError) as full:
        solve_ilp(problem, 30)
    with pytest.raises(InfeasibleError) as early:
        raise_if_proven_over_budget(problem)
    assert str(early.value) == str(full.value)
    problem.budget = floor
    raise_if_proven_over_budget(problem)
    assert memory_of(problem, solve_ilp(problem, 30).choice) <= floor * (1 + 1e-9)


def _with_more_memory(problem, factor):
    """Same objective, every memory coefficient scaled by ``factor`` (≥ 1: a tighter feasible set)."""
    return IlpProblem(problem.cost, [m * factor for m in problem.mem], problem.edges, problem.budget,
                      [p * factor for p in problem.peak])


@pytest.mark.parametrize("seed", range(6))
def test_reused_solutions_are_optimal_for_tighter_problems(seed):
    from autopar.passes.ilp_reuse import SolutionMemo

    rng = np.random.default_rng(seed)
    loose = random_problem(rng)
    loose.budget = 0.5 * (min_memory(loose) + memory_of(loose, [0] * loose.n_classes))
    memo = SolutionMemo()
    memo.store(loose, solve_ilp(loose, 30))
    for factor in (1.0, 1.02, 1.1, 1.3):
        tight = _with_more_memory(loose, factor)
        if min_memory(tight) > tight.budget:
            continue
        reused = memo.lookup(tight)
        if reused is not None:  # answered only when provably optimal: it equals brute force
            assert reused.objective == pytest.approx(brute(tight), rel=1e-6)
            assert memory_of(tight, reused.choice) <= tight.budget
    assert memo.hits >= 1, "the identical problem (factor 1.0) is answered from the memo"


def test_memo_never_answers_a_looser_or_different_problem():
    from autopar.passes.ilp_reuse import SolutionMemo

    rng = np.random.default_rng(3)
    problem = random_problem(rng)
    problem.budget = 0.5 * (min_memory(problem) + memory_of(problem, [0] * problem.n_classes))
    memo = SolutionMemo()
    memo.store(problem, solve_ilp(problem, 30))
    assert memo.lookup(problem) is not None, "the same problem is answered"
    assert memo.lookup(_with_more_memory(problem, 0.9)) is None, "a looser feasible set may have a better optimum"
    other = IlpProblem([c + 1e-3 for c in problem.cost], problem.mem, problem.edges, problem.budget, problem.peak)
    assert memo.lookup(other) is None, "another objective is never answered"


def test_walks_by_objective_answer_as_the_serial_memo_walk():
    """Stages of two objectives interleaved, each at growing memory, one too tight to fit: ``solve_walks``
    (forked workers where it can) gives every problem the serial memo walk's answer, the same reuse count
    and the infeasible one its message. Negative control: walking each problem alone loses the reuse."""
    from autopar.passes.ilp_reuse import SolutionMemo, solve_walks

    rng = np.random.default_rng(5)
    a, b = random_problem(rng, classes=7), random_problem(rng, classes=7)
    for p in (a, b):
        p.budget = 0.5 * (min_memory(p) + memory_of(p, [0] * p.n_classes))
    tight = _with_more_memory(b, 1.0)
    tight.budget = 0.5 * min_memory(b)
    problems = [a, b, _with_more_memory(a, 1.0), _with_more_memory(b, 1.01), tight, _with_more_memory(a, 1.02)]
    memo, serial = SolutionMemo(), []
    for p in problems:
        found = memo.lookup(p)
        if found is None:
            try:
                found = solve_ilp(p, 30)
            except InfeasibleError as e:
                serial.append(str(e))
                continue
            memo.store(p, found)
        serial.append(found)
    results, reused = solve_walks(problems, 30)
    assert reused == memo.hits >= 2
    assert results[4] == serial[4] and "smallest plan needs" in results[4]
    for got, want in zip(results, serial):
        if not isinstance(want, str):
            assert (got.choice, got.objective, got.status) == (want.choice, want.objective, want.status)
    alone = [solve_walks([p], 30)[1] for p in problems if p is not tight]
    assert sum(alone) == 0 < reused, "negative control: no walk of one problem reuses anything"


def _tightening_walk(rng):
    """One objective at budgets that each rule out the last budget's optimum (each needs its own solve), with
    an exact copy of the second problem and of the first one after them (the memo answers both)."""
    from dataclasses import replace

    first = random_problem(rng, classes=7)
    floor = min_memory(first)
    first.budget = memory_of(first, [0] * first.n_classes)
    walk = [first]
    while True:
        used = memory_of(walk[-1], solve_ilp(walk[-1], 30).choice)
        budget = used - 0.05 * (used - floor)
        if budget <= floor or len(walk) == 4:
            break
        walk.append(replace(first, budget=budget))
    assert len(walk) >= 3, "the walk needs several fresh solves"
    return walk + [replace(walk[1]), replace(first)]


def _serial_walk(problems):
    from autopar.passes.ilp_reuse import SolutionMemo

    memo, out = SolutionMemo(), []
    for p in problems:
        found = memo.lookup(p)
        if found is None:
            found = solve_ilp(p, 30)
            memo.store(p, found)
        out.append(found)
    return out, memo.hits


def test_solving_ahead_gives_the_serial_walks_answers():
    """A walk whose every problem tightens memory past the last one's optimum is solved ahead, on both
    cores, and still answers each problem (and counts reuse) exactly as the serial memo walk does."""
    from autopar.passes.ilp_reuse import solve_walks

    problems = _tightening_walk(np.random.default_rng(11))
    want, hits = _serial_walk(problems)
    results, reused = solve_walks(problems, 30)
    assert reused == hits == 2
    for got, expected in zip(results, want):
        assert (got.choice, got.objective, got.status) == (expected.choice, expected.objective, expected.status)


def test_problems_solved_ahead_are_those_the_memo_cannot_answer():
    """``_replay``'s to-solve list: every tightened problem (a changed budget misses the memo), never an
    exact copy of one already listed; once the first is solved, its copy is answered and leaves the list."""
    from autopar.passes.ilp_reuse import _replay, objective_key

    problems = _tightening_walk(np.random.default_rng(11))
    keys, walk = [objective_key(p) for p in problems], list(range(len(problems)))
    fresh = list(range(len(problems) - 2))
    assert _replay(problems, keys, [walk], {})[2] == [fresh]
    _, _, pending = _replay(problems, keys, [walk], {0: solve_ilp(problems[0], 30)})
    assert pending == [fresh[1:]], "the first problem's copy is answered by its solve; the tighter ones are not"


def _point(model, problem, choice):
    """The column vector of a choice: x one-hot, y on the matching (row group, column group), T the transient."""
    from autopar.passes.ilp_model import MS

    values = np.zeros(model.n_cols)
    for c, cols in enumerate(model.x):
        if cols is not None:
            values[cols[choice[c]]] = 1.0
    y_cols = [k for k in range(model.n_cols) if not model.integer[k]]
    rows = [(model.index[model.start[r]:model.start[r + 1]], model.value[model.start[r]:model.start[r + 1]])
            for r in range(model.n_rows)]
    for k in y_cols[:-1] if problem.budget is not None else y_cols:  # y: 1 where both marginals hold it
        touching = [(idx, val) for idx, val in rows if k in idx]
        values[k] = float(all(values[idx[val < 0]].sum() > 0.5 for idx, val in touching))
    if problem.budget is not None:
        values[y_cols[-1]] = max(float(p[choice[c]]) for c, p in enumerate(problem.peak)) / problem.budget
    return values, MS


@pytest.mark.parametrize("seed", range(4))
def test_the_sparse_model_prices_every_choice_like_the_formulation(seed):
    """The one model both back ends solve: at every feasible choice's point, c·v + offset is the objective
    (in ms) and every row holds; at an infeasible choice, the memory row is violated."""
    import itertools

    from autopar.passes.ilp_model import sharding_model

    problem = random_problem(np.random.default_rng(seed), classes=4)
    problem.budget = 0.5 * (min_memory(problem) + memory_of(problem, [0] * problem.n_classes))
    model = sharding_model(problem)
    seen = set()
    for choice in itertools.product(*[range(len(c)) for c in problem.cost]):
        v, ms = _point(model, problem, list(choice))
        assert model.cost @ v + model.offset == pytest.approx(evaluate(problem, list(choice)) * ms, rel=1e-9)
        spans = [slice(model.start[r], model.start[r + 1]) for r in range(model.n_rows)]
        rows = np.array([model.value[s] @ v[model.index[s]] for s in spans])
        holds = bool(np.all(rows >= model.row_lower - 1e-9) and np.all(rows <= model.row_upper + 1e-9))
        assert holds == (memory_of(problem, list(choice)) <= problem.budget * (1 + 1e-12)), choice
        seen.add(holds)
    assert seen == {True, False}, "the budget separates feasible from infeasible choices"


def test_a_forked_child_solves_after_its_parent_did():
    """The planner forks pricing workers after it may have solved in this process (``passes.forked``). HiGHS
    1.16 keeps a thread pool from the parent's MIP that a fork inherits without its threads: without the
    reset in ``passes.ilp_highs`` the child's solve waits forever, past its time limit."""
    import multiprocessing

    if backend() != "highs":
        pytest.skip("highspy not installed")
    problem = random_problem(np.random.default_rng(0), classes=12)
    problem.budget = 0.5 * (min_memory(problem) + memory_of(problem, [0] * problem.n_classes))
    want = solve_ilp(problem, 30, which="highs").objective
    ctx = multiprocessing.get_context("fork")
    answer = ctx.Queue()
    child = ctx.Process(target=lambda: answer.put(solve_ilp(problem, 30, which="highs").objective))
    child.start()
    child.join(60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive, "the forked child's HiGHS solve did not return within 60 s"
    assert answer.get(timeout=5) == pytest.approx(want)


@pytest.mark.parametrize("seed", range(4))
def test_replay_rows_agree_with_brute_force(seed):
    """Recompute's replay rows (one per region, coefficients of either sign, some on fixed classes) are
    charged on top of T by both back ends as ``memory_of`` charges them; a budget the replay breaks for the
    cheapest choice moves it (negative control: the same problem without replay keeps that choice)."""
    rng = np.random.default_rng(100 + seed)
    problem = random_problem(rng)
    problem.cost[0] = problem.cost[0][:1]  # a fixed class: its replay entry is a constant of the row
    problem.mem[0], problem.peak[0] = problem.mem[0][:1], problem.peak[0][:1]
    problem.edges = {k: (m[:1] if k[0] == 0 else m) for k, m in problem.edges.items()}
    n = problem.n_classes
    problem.replay = [[rng.uniform(-1, 3, len(problem.cost[c])) * 2**30 if rng.random() < 0.6 else None
                       for c in range(n)] for _ in range(3)]
    free = solve_ilp(IlpProblem(problem.cost, problem.mem, problem.edges, None, problem.peak), 30).choice
    problem.budget = memory_of(problem, free) - 0.5 * 2**30
    plain = IlpProblem(problem.cost, problem.mem, problem.edges, problem.budget, problem.peak)
    if min_memory(problem, which="pulp") > problem.budget:
        pytest.skip("no choice fits this random budget")
    want = brute(problem)
    for which in ("pulp", "highs"):
        if which == "highs" and backend() != "highs":
            continue
        result = solve_ilp(problem, 30, which=which)
        assert result.objective == pytest.approx(want, rel=1e-6), which
        assert memory_of(problem, result.choice) <= problem.budget * (1 + 1e-9)
    if memory_of(plain, free) <= plain.budget:
        assert solve_ilp(plain, 30).choice == free, "without replay rows the cheapest choice fits"


@pytest.mark.parametrize("seed", range(4))
def test_an_integral_relaxation_is_kept_as_the_exact_optimum(seed):
    """The quick solve (presolve off, the stage DP's prices) keeps the LP relaxation when it comes back
    integral: its objective is then the brute-force optimum itself, not just within the MIP gap."""
    from autopar.passes import ilp_highs
    from autopar.passes.ilp_model import sharding_model

    if backend() != "highs":
        pytest.skip("highspy not installed")
    problem = random_problem(np.random.default_rng(seed), classes=7)
    model = sharding_model(problem)
    status, values = ilp_highs._integral_relaxation(model, 30)
    assert status == "Optimal" and values is not None  # chains of resharding matrices relax integrally
    assert evaluate(problem, model.choice(values)) == pytest.approx(brute(problem), rel=1e-9)
    assert solve_ilp(problem, 30, presolve=False).objective == pytest.approx(brute(problem), rel=1e-9)


def test_a_fractional_relaxation_goes_on_to_the_mip():
    """Negative control: a knapsack the relaxation splits (3/4 of class 0's lean strategy meets the budget
    at cost 0.25; every column fits beside the other class's least, so none is closed) is not kept; the
    quick solve answers with the MIP's integer optimum (cost 1)."""
    from autopar.passes import ilp_highs
    from autopar.passes.ilp_model import sharding_model

    if backend() != "highs":
        pytest.skip("highspy not installed")
    gib = 2.0 ** 30
    problem = IlpProblem([np.array([0.0, 1.0]), np.array([0.0, 1.5])],
                         [np.array([3.0, 1.0]) * gib, np.array([2.0, 1.0]) * gib], {}, budget=4.5 * gib)
    assert ilp_highs._integral_relaxation(sharding_model(problem), 30) == ("", None)
    result = solve_ilp(problem, 30, presolve=False)
    assert result.choice == [1, 0] and result.objective == pytest.approx(1.0)
    assert memory_of(problem, result.choice) <= problem.budget


def _closed(problem) -> list[np.ndarray]:
    from autopar.passes.ilp_model import sharding_model

    model = sharding_model(problem)
    return [np.zeros(1, bool) if cols is None else model.col_upper[cols] == 0 for cols in model.x]


def test_a_column_that_overruns_beside_the_others_least_is_closed_and_the_relaxation_integral():
    """Class 0's fat column (3 GiB) cannot fit beside class 1's least (1 GiB) in a 3.5 GiB budget: it is
    closed, so the relaxation cannot take it at 3/4 (cost 0.25, fractional) and comes back integral at the
    MIP's optimum. Control: with class 1's least at 0.25 GiB the column fits beside it, stays open, and the
    relaxation splits it as before."""
    from autopar.passes import ilp_highs
    from autopar.passes.ilp_model import sharding_model

    if backend() != "highs":
        pytest.skip("highspy not installed")
    gib = 2.0 ** 30
    problem = IlpProblem([np.array([0.0, 1.0]), np.array([0.0, 1.0])],
                         [np.array([3.0, 1.0]) * gib, np.array([2.0, 1.0]) * gib], {}, budget=3.5 * gib)
    assert [list(c) for c in _closed(problem)] == [[True, False], [False, False]]
    status, values = ilp_highs._integral_relaxation(sharding_model(problem), 30)
    assert status == "Optimal" and sharding_model(problem).choice(values) == [1, 0]
    problem.mem[1] = np.array([2.0, 0.25]) * gib
    assert not any(c.any() for c in _closed(problem))
    assert ilp_highs._integral_relaxation(sharding_model(problem), 30) == ("", None)


def _check_closing(seed: int) -> int:
    """Over every choice of a random problem with transients, ZeRO-3 units and a budget that binds: no
    choice that fits takes a closed column, and the solve finds the brute-force optimum. Returns how many
    columns were closed."""
    import itertools

    rng = np.random.default_rng(100 + seed)
    problem = random_problem(rng, classes=5)
    problem.units = [np.where(rng.uniform(size=len(c)) < 0.5, rng.uniform(0, 0.5, len(c)) * 2**30, 0.0)
                     for c in problem.cost]
    problem.budget = 0.5 * (min_memory(problem, which="pulp") + memory_of(problem, [0] * problem.n_classes))
    closed = _closed(problem)
    for choice in itertools.product(*[range(len(c)) for c in problem.cost]):
        if memory_of(problem, list(choice)) <= problem.budget:
            assert not any(closed[c][i] for c, i in enumerate(choice) if len(problem.cost[c]) > 1), choice
    if backend() == "highs":
        assert solve_ilp(problem, 30).objective == pytest.approx(brute(problem), rel=1e-3)
    return sum(int(c.sum()) for c in closed)


def test_closed_columns_are_in_no_choice_that_fits():
    """Exactness of closing overruns (``ilp_model.close_overruns``) on random problems, and not vacuous:
    summed over the seeds, columns are closed."""
    assert sum(_check_closing(seed) for seed in range(6)) > 0
