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
