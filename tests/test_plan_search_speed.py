"""The planner's speed-ups return what the plain search returns (fast tier: no process groups, no capture).

Each vectorized, cached or pruned path is checked against a direct evaluation of its definition on small
random cases: the recompute tables against trying ``prefixes(k, i)`` one by one, and the forked helpers
against plain calls.
"""
from types import SimpleNamespace

import numpy as np
import pytest

from autopar.passes.recompute import LayerRecompute


def _reference_tables(rec: LayerRecompute, latency, memory, scale: float, budget: float):
    """The first fitting prefix of every entry, found by trying each prefix in turn (the definition)."""
    L, _, F = memory.shape
    f = np.arange(1, F + 1)
    best_lat, best_p = np.full(memory.shape, np.inf), np.full(memory.shape, -1)
    for k in range(L):
        for i in range(k, L):
            for p, (_, save, fwd, replay) in enumerate(rec.prefixes(k, i)):
                mem = memory[k, i] - f * scale * save + scale * replay
                take = (best_p[k, i] < 0) & (mem <= budget)
                best_lat[k, i][take] = latency[k, i] + scale * fwd
                best_p[k, i][take] = p
    return best_lat, best_p >= 0, best_p


def _random_case(rng, L: int, F: int, modes: list[str]):
    act = rng.uniform(1.0, 10.0, L)
    costs = SimpleNamespace(t=rng.uniform(1.0, 3.0, L), comm=rng.uniform(0.0, 1.0, L), sync=rng.uniform(0.0, 0.2, L),
                            act=act, peak=rng.uniform(0.0, 12.0, L))
    rec = LayerRecompute(costs, np.full(L, 1 / 3), keep=rng.uniform(0.0, 2.0, L), modes=modes)
    lower = np.tril(np.ones((L, L), dtype=bool), -1)
    latency = np.where(lower, np.inf, rng.uniform(1.0, 10.0, (L, L)))
    memory = np.where(lower[:, :, None], np.inf, rng.uniform(5.0, 60.0, (L, L, F)))
    return rec, latency, memory


@pytest.mark.parametrize("seed", range(6))
def test_recompute_tables_match_prefix_by_prefix(seed):
    rng = np.random.default_rng(seed)
    L, F = 7, 4
    modes = [str(m) for m in rng.choice(["auto", "auto", "none", "full"], L)] if seed % 2 else ["auto"] * L
    rec, latency, memory = _random_case(rng, L, F, modes)
    for scale, budget in ((1.0, 30.0), (0.5, 12.0), (2.0, 50.0)):
        lat, fits, prefix = rec.tables(latency, memory, scale, budget)
        want_lat, want_fits, want_prefix = _reference_tables(rec, latency, memory, scale, budget)
        assert np.array_equal(fits, want_fits) and np.array_equal(prefix, want_prefix)
        assert np.array_equal(lat, want_lat)  # bit-identical, not just close
        assert fits.any() and not fits.all()  # the case exercises both outcomes


def _square_and_pid(x):
    import os

    return x * x, os.getpid()


def test_forked_helpers_return_what_the_plain_calls_return():
    import os

    from autopar.passes.forked import Beside, can_fork, parallel_map

    items = [5, 3, 8, 1]
    got = parallel_map(_square_and_pid, items)
    assert [v for v, _ in got] == [x * x for x in items]  # in the items' order, whatever finished first
    beside = Beside(lambda: _square_and_pid(7))
    value, pid = beside.result()
    assert value == 49 and (pid != os.getpid()) == can_fork()  # computed in a worker exactly when forking is safe
    unwanted = Beside(lambda: _square_and_pid(2))
    unwanted.cancel()  # a result nobody waits for leaves no worker behind
    assert unwanted._proc is None


def _fails_on_three(x):
    if x == 3:
        raise ValueError(f"item {x}")
    return x


def test_forked_helpers_raise_a_worker_exception_in_item_order_and_survive_a_dead_worker():
    """An exception in one item is raised as the plain loop would (the first in item order) and leaves no
    worker behind; a worker killed mid-map makes the items computed here, not a hang; a worker's exception
    comes back through ``Beside.result``, and an answer that does not pickle is computed by the caller.
    Control: the items without the failing one map plainly."""
    import multiprocessing
    import os
    import threading

    import pytest

    from autopar.passes.forked import Beside, can_fork, parallel_map

    with pytest.raises(ValueError, match="item 3"):
        parallel_map(_fails_on_three, [1, 3, 4, 3, 5])
    assert parallel_map(_fails_on_three, [1, 4, 5]) == [1, 4, 5]
    assert not multiprocessing.active_children()
    here = os.getpid()
    assert parallel_map(lambda x: _dies_in_a_worker(x, here), [1, 2, 3]) == [1, 2, 3]
    with pytest.raises(ValueError, match="item 3"):
        Beside(lambda: _fails_on_three(3)).result()
    assert Beside(lambda: threading.Lock()).result() is not None  # a lock does not pickle: computed here
    nested = parallel_map(lambda x: (parallel_map(_fails_on_three, [x, x + 1]), os.getpid()), [4, 5, 6])
    assert [v for v, _ in nested] == [[4, 5], [5, 6], [6, 7]], "a worker maps its items itself, then goes on"
    assert Beside(lambda: (can_fork(), parallel_map(_fails_on_three, [1, 2]))).result() == (False, [1, 2])
    died = Beside(lambda: _dies_in_a_worker(5, here))
    assert died.result() == 5 and (died._proc is None)
    assert not multiprocessing.active_children() and can_fork() in (True, False)


def _dies_in_a_worker(x, parent_pid):
    """x, except in a forked worker, which it kills (SIGKILL) on item 2 or 5."""
    import os
    import signal

    if os.getpid() != parent_pid and x in (2, 5):
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def _tiny_graph():
    """x [4, 8] -> relu -> sum, with meta values (no capture): enough for signatures."""
    import torch
    import torch.fx as fx

    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 8, device="meta")
    relu = graph.call_function(torch.ops.aten.relu.default, (x,))
    relu.meta["val"] = torch.empty(4, 8, device="meta")
    graph.output(relu)
    return x, relu


def test_cached_signatures_follow_the_values_they_describe():
    import torch

    from autopar.ir.ops import _signature, node_signature

    x, relu = _tiny_graph()
    first = node_signature(relu)
    assert first == _signature(relu) and node_signature(relu) is first  # the second call is the cached string
    x.meta["val"] = torch.empty(2, 8, device="meta")  # a pass relabels the input (rescale, precision)
    assert node_signature(relu) == _signature(relu) != first
    relu.args = (x, )  # rewired arguments (a new tuple) invalidate the entry too
    assert node_signature(relu) == _signature(relu)
    x.meta["val"] = torch.empty(4, 8, device="meta")
    assert node_signature(relu) == first  # equal inputs again: the same signature as before


def _choose(tables, sizes, devices, bounded: bool):
    """The best (cost, B, stages) over candidate B: the plain search (ascending, strict improvement) or the
    planner's (descending, each DP bounded by the best so far; ties go to the smaller B)."""
    from autopar.passes.stage_dp import stage_dp

    best = None
    for B in sorted(tables, reverse=bounded):
        table, hops = tables[B]
        bound = best[0] if bounded and best is not None else np.inf
        found = stage_dp(table, sizes, devices, B, bucket=0.01, hops=hops, bound=bound)
        if found is not None and (best is None or (found.cost, B) < best[:2]):
            best = (found.cost, B, found.stages)
    return best


@pytest.mark.parametrize("seed", range(10))
def test_bounded_stage_dp_over_microbatches_returns_the_plain_choice(seed):
    from test_stage_dp import random_table

    rng = np.random.default_rng(seed)
    layers, sizes, devices = int(rng.integers(3, 7)), [1, 2, 2, 4], 4
    tables = {}
    for B in (1, 2, 4, 8, 16):
        scale = (16 / B) ** rng.uniform(0.7, 1.0)  # smaller microbatches: cheaper stages, more of them
        table = random_table(rng, layers, sizes, max_f=min(layers, B), holes=0.4) * scale
        tables[B] = (table, np.concatenate([[0.0], rng.uniform(0, 0.3, layers - 1)]))
    plain, bounded = _choose(tables, sizes, devices, False), _choose(tables, sizes, devices, True)
    assert plain is not None and bounded == plain  # same B, same stages, bit-identical cost


def test_a_bound_below_every_plan_prunes_and_above_it_changes_nothing():
    from test_stage_dp import random_table

    from autopar.passes.stage_dp import stage_dp

    table = random_table(np.random.default_rng(3), 5, [1, 2, 4], max_f=5, holes=0.2)
    free = stage_dp(table, [1, 2, 4], 4, 8, bucket=0.01)
    assert stage_dp(table, [1, 2, 4], 4, 8, bucket=0.01, bound=free.cost) == free  # a tie is still found
    pruned = stage_dp(table, [1, 2, 4], 4, 8, bucket=0.01, bound=0.5 * free.cost)
    assert pruned is None or pruned.cost > 0.5 * free.cost


@pytest.mark.parametrize("seed", range(6))
def test_a_solve_without_presolve_stays_within_the_gap(seed):
    """The stage DP's pricing solves skip HiGHS's presolve (``ilp_highs.solve``); their answers stay within
    the solver's relative gap of the brute-force optimum, memory row included. Negative control: the worst
    choice is outside that gap."""
    import itertools

    from autopar.passes import ilp_highs
    from autopar.passes.ilp import backend, evaluate, memory_of, min_memory, solve_ilp
    from tests.test_ilp import brute, random_problem

    if backend() != "highs":
        pytest.skip("highspy not installed")
    problem = random_problem(np.random.default_rng(seed), classes=7)
    problem.budget = 0.5 * (min_memory(problem) + memory_of(problem, [0] * problem.n_classes))
    want = brute(problem)
    result = solve_ilp(problem, 30, presolve=False)
    assert memory_of(problem, result.choice) <= problem.budget * (1 + 1e-9)
    assert want <= result.objective <= want * (1 + ilp_highs.MIP_GAP) + 1e-12
    worst = max(evaluate(problem, list(c)) for c in itertools.product(*[range(len(v)) for v in problem.cost]))
    assert worst > want * (1 + ilp_highs.MIP_GAP)
