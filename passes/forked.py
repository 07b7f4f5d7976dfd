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
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

_TASK = None  # the callable a forked worker runs (inherited through fork, never pickled)
_IN_WORKER = False  # set in every worker this module forks: a worker computes its items itself


def _mark_worker() -> None:
    global _IN_WORKER
    _IN_WORKER = True


def can_fork() -> bool:
    import torch.distributed as dist

    return ((os.cpu_count() or 1) > 1 and sys.platform.startswith("linux") and not _IN_WORKER
            and not multiprocessing.current_process().daemon
            and not (dist.is_available() and dist.is_initialized()))


def _run_task(item):
    return _TASK(item)


def parallel_map(fn, items: list, progress: str = "") -> list:
    """``[fn(x) for x in items]``, on every core through forked workers when that is safe. Items are
    handed out in the given order, one at a time, so callers put the longest first (a long item started
    last would leave the other cores idle). A progress bar on stderr (tqdm; hidden when stderr is not a
    terminal) counts finished items. An exception raised by ``fn`` is raised as the plain loop would raise
    it (the first in item order).

    Workers are a ``concurrent.futures.ProcessPoolExecutor``'s, not a ``multiprocessing.Pool``'s: a pool
    whose worker dies (killed, out of memory) replaces it and waits forever for the task it held, and its
    ``terminate`` kills workers that may hold its result queue's lock, then waits on that lock. The
    executor reports a dead worker (``BrokenProcessPool``) and is never terminated; the items are then
    computed here, so the answer never depends on how it was computed."""
    from tqdm import tqdm

    bar = dict(total=len(items), desc=progress, disable=None if progress else True, leave=False)
    workers = min(len(items), os.cpu_count() or 1)
    if workers < 2 or not can_fork():
        return [fn(x) for x in tqdm(items, **bar)]
    global _TASK
    _TASK = fn  # the workers fork as the items are submitted, inheriting it
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                 initializer=_mark_worker) as pool:
            try:
                return list(tqdm(pool.map(_run_task, items), **bar))
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
    except BrokenProcessPool:
        return [fn(x) for x in tqdm(items, **bar)]
    finally:
        _TASK = None


def _send_result(fn, conn) -> None:
    """A ``Beside`` worker's body: (True, fn()) or (False, its exception) down ``conn``; (False, None) where
    the answer does not pickle (the caller then computes it itself)."""
    _mark_worker()
    try:
        outcome = (True, fn())
    except Exception as e:  # noqa: BLE001 - handed back, raised by ``result()``
        outcome = (False, e)
    try:
        conn.send(outcome)
    except Exception:  # noqa: BLE001 - an answer that does not pickle: computed by the caller instead
        conn.send((False, None))
    conn.close()


class Beside:
    """``fn()`` computed in a forked worker while this process goes on; ``result()`` waits for it.

    Without a safe fork, ``result()`` computes ``fn()`` here on first call; it does so too where the worker
    died or its answer did not pickle, so the answer never depends on how it was computed. ``fn`` returns
    plain data. The worker is a bare process with a pipe, not a pool: ``cancel`` kills it whatever it is
    doing, and no lock of this process is shared with it (``parallel_map``'s docstring says why that
    matters)."""

    def __init__(self, fn):
        self._fn, self._proc, self._conn = fn, None, None
        if can_fork():
            context = multiprocessing.get_context("fork")
            self._conn, child = context.Pipe(duplex=False)
            self._proc = context.Process(target=_send_result, args=(fn, child), daemon=True)
            self._proc.start()
            child.close()

    def result(self):
        if self._proc is None:
            return self._fn()
        try:
            ok, value = self._conn.recv()
        except (EOFError, OSError):  # the worker died before answering
            ok, value = False, None
        finally:
            self.cancel()
        if ok:
            return value
        if value is None:
            return self._fn()
        raise value

    def cancel(self) -> None:
        """Stop the worker (its result is no longer wanted)."""
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join()
            self._conn.close()
            self._proc = None
