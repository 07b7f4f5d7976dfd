"""Planner work on every core: forked workers for independent solves (pure helpers, no pass of their own).

Planning is CPU-bound Python and HiGHS, so threads do not help; forked processes do. A fork inherits the
graphs and caches for free, and only results (plain data) travel back by pickle. Forking is used only when
it is safe: Linux, more than one core, not inside a pool's worker already (which may not start workers),
and no torch.distributed process group (forking a process whose communication threads are live is not).
Otherwise everything runs in this process, in the same order, so the results never depend on how they
were computed.
"""
from __future__ import annotations

import multiprocessing
import os
import sys

_TASK = None  # the callable a forked worker runs (inherited through fork, never pickled)


def can_fork() -> bool:
    import torch.distributed as dist

    return ((os.cpu_count() or 1) > 1 and sys.platform.startswith("linux")
            and not multiprocessing.current_process().daemon
            and not (dist.is_available() and dist.is_initialized()))


def _run_task(item):
    return _TASK(item)


def parallel_map(fn, items: list, progress: str = "") -> list:
    """``[fn(x) for x in items]``, on every core through forked workers when that is safe. Items are
    handed out in the given order, one at a time, so callers put the longest first (a long item started
    last would leave the other cores idle). A progress bar on stderr (tqdm; hidden when stderr is not a
    terminal) counts finished items."""
    from tqdm import tqdm

    bar = dict(total=len(items), desc=progress, disable=None if progress else True, leave=False)
    workers = min(len(items), os.cpu_count() or 1)
    if workers < 2 or not can_fork():
        return [fn(x) for x in tqdm(items, **bar)]
    global _TASK
    _TASK = fn
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            return list(tqdm(pool.imap(_run_task, items, chunksize=1), **bar))
    finally:
        _TASK = None


class Beside:
    """``fn()`` computed in a forked worker while this process goes on; ``result()`` waits for it.

    Without a safe fork, ``result()`` computes ``fn()`` here on first call. ``fn`` returns plain data
    (it is pickled back); exceptions it should report are turned into return values by the caller's
    ``fn``, since not every exception survives pickling."""

    def __init__(self, fn):
        self._fn, self._pool, self._async = fn, None, None
        if can_fork():
            global _TASK
            _TASK = lambda _: fn()  # noqa: E731
            try:
                self._pool = multiprocessing.get_context("fork").Pool(1)
                self._async = self._pool.apply_async(_run_task, (None,))
            finally:
                _TASK = None

    def result(self):
        if self._async is None:
            return self._fn()
        try:
            return self._async.get()
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Stop the worker (its result is no longer wanted)."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None
