"""``autopar.launch``: run ``fn(rank, *args)`` on n local processes over gloo, or once under torchrun.

Under ``torchrun`` (RANK and WORLD_SIZE set) the process group is initialized from the environment and
``fn`` runs in this process. Otherwise n processes are started on this machine. Every process group gets
``timeout`` seconds per collective, so a dead rank makes the others fail instead of hanging. Each rank's
return value comes back to the caller (rank order).

Failures (spawned case). The c10d store lives in this (the parent) process, so it outlives any rank; the
parent records each child's exit code in it as it reaps the child, and every rank registers with
``autopar.runtime.faults``, so a rank whose collective fails names the rank that died. Once a rank fails,
the others get ``grace`` seconds (``min(timeout, 10)``) to stop on their own, then are killed; ``launch``
then raises within that time:
  * the exception of the rank that failed first, re-raised as is (a note lists every rank's end), or
  * ``LaunchError`` (a ``CommunicationError``) when a rank died without a Python exception (os._exit, a
    signal, out of memory): "rank 2 died (exit code 1); other ranks stopped: rank 0: ...", with
    ``.dead_ranks`` and ``.rank_errors`` ({rank: that rank's own error text}).

Start-up. Ranks are forked from multiprocessing's fork server, which imports torch and autopar once per
calling process: a rank then starts in a fraction of a second, where a spawned one spends seconds of CPU
importing torch (the calling process itself is never forked: its threads, process group or CUDA context
stay its own). The caller's environment at each launch is the rank's (``_worker`` sets it); variables that
torch reads while it is imported are those of the first launch. Where the platform has no fork server,
ranks are spawned.
"""
from __future__ import annotations

import atexit
import datetime
import inspect
import multiprocessing.connection
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.errors import ClusterError, CommunicationError, LaunchError, UsageError
from autopar.runtime import faults
from autopar.runtime.devices import local_gpu_index

_MAX_GRACE_S = 10.0
_STARTUP_TIMEOUT_S = 600.0
_OUT_DIR_VAR = "AUTOPAR_LAUNCH_OUT"
_BOOTSTRAP_DIR: list[str] = []  # set once per process (_bootstrap_dir)
_NO_MAIN_GUARD = ("autopar.launch was called again while a spawned rank was importing your script: the "
                  "call runs at import time. Fix: put it under `if __name__ == \"__main__\":` (spawned "
                  "processes import the main script, see the multiprocessing docs on safe importing)")


def launch(fn, nprocs: int, *args, backend: str = "gloo", timeout: float = 60.0,
           store_host: str = "127.0.0.1") -> list:
    """Run ``fn(rank, *args)`` on ``nprocs`` ranks; returns the list of their results (see module doc).
    ``store_host``: the address the rendezvous store listens on (loopback: no other machine can reach
    it; the store has no authentication)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        return [_run_under_torchrun(fn, args, backend, timeout)]
    _refuse_inside_a_starting_rank()
    _check_launch_arguments(fn, nprocs, backend, timeout, args)
    with tempfile.TemporaryDirectory(prefix="autopar-launch-") as out_dir:
        store = _store_listening_on(store_host, timeout)
        faults.mark_supervised(store)
        ctx = _start_method()
        env = dict(os.environ)
        procs = [ctx.Process(target=_worker, name=f"autopar-rank{rank}",
                             args=(rank, fn, nprocs, store_host, store.port, backend, timeout, args, out_dir, env))
                 for rank in range(nprocs)]
        _start(procs)
        killed = _supervise(procs, store, grace=min(timeout, _MAX_GRACE_S))
        if killed or any(p.exitcode != 0 for p in procs):
            raise _failure(procs, out_dir, killed)
        return [_read_result(out_dir, r) for r in range(nprocs)]


def _store_listening_on(host: str, timeout: float):
    """The parent's TCPStore, listening on ``host`` only: a TCPStore given a host name still listens on
    every interface, so the socket is bound here and handed over (the store then owns its descriptor)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(128)
    store = dist.TCPStore(host, listener.getsockname()[1], None, True, timeout=datetime.timedelta(seconds=timeout),
                          wait_for_workers=False, master_listen_fd=listener.fileno(), use_libuv=True)
    listener.detach()
    return store


def _start_method():
    """The fork server (see the module doc), told to import torch and autopar before it forks the first rank,
    and told where a rank reports a missing ``__main__`` guard (``_bootstrap_dir``); spawn where there is none.
    Not plain fork: the caller may hold threads, a process group or a CUDA context that a fork would copy."""
    if "forkserver" not in mp.get_all_start_methods():
        _bootstrap_dir()
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    if not _BOOTSTRAP_DIR:  # the server starts with this process's environment at its first launch
        _bootstrap_dir()
        ctx.set_forkserver_preload(["torch", "torch.distributed", "autopar"])
    return ctx


def _bootstrap_dir() -> str:
    """A directory for this process's lifetime where a starting rank that finds launch called at import time
    leaves a note (``bootstrap-<pid>.txt``); its path is in the environment every rank starts with."""
    if not _BOOTSTRAP_DIR:
        _BOOTSTRAP_DIR.append(tempfile.mkdtemp(prefix="autopar-launch-"))
        atexit.register(shutil.rmtree, _BOOTSTRAP_DIR[0], True)
        os.environ[_OUT_DIR_VAR] = _BOOTSTRAP_DIR[0]
    return _BOOTSTRAP_DIR[0]


def _start(procs: list) -> None:
    """Start every child; if one cannot start, kill those that did (never leave orphans)."""
    try:
        for p in procs:
            p.start()
    except BaseException:
        _kill({r: p for r, p in enumerate(procs) if p.pid is not None}, "killed by launch")
        raise


def _refuse_inside_a_starting_rank() -> None:
    """A script without the ``__main__`` guard re-runs ``launch`` in every starting child as it imports the
    script; say so, to the child's stderr and to the parent (which otherwise sees bare exit codes)."""
    if not getattr(mp.current_process(), "_inheriting", False):
        return
    out_dir = os.environ.get(_OUT_DIR_VAR)
    if out_dir and os.path.isdir(out_dir):
        with open(os.path.join(out_dir, f"bootstrap-{os.getpid()}.txt"), "w") as f:
            f.write(_NO_MAIN_GUARD)
    raise UsageError(_NO_MAIN_GUARD)


def _check_launch_arguments(fn, nprocs, backend: str, timeout, args: tuple) -> None:
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise UsageError(f"launch: nprocs must be a positive int (the number of ranks), got {nprocs!r}")
    if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
        raise UsageError(f"launch: timeout must be a positive number of seconds (how long a collective may "
                         f"wait), got {timeout!r}")
    if not isinstance(backend, str) or backend.lower() not in ("gloo", "nccl", "mpi", "ucc", "xccl"):
        raise UsageError(f"launch: backend={backend!r} is not a torch.distributed backend; use 'gloo' (CPUs, the "
                         f"default) or 'nccl' (CUDA GPUs)")
    _check_callable_with_rank(fn, args)
    if backend == "nccl" and not torch.cuda.is_available():
        raise ClusterError("launch: backend 'nccl' needs CUDA GPUs, but torch.cuda.is_available() is False; "
                           "use backend='gloo' (the default) on CPU, e.g. with autopar.Cluster.local(n)")
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise UsageError(f"launch: {getattr(fn, '__qualname__', fn)!r} is defined in an interactive session "
                          f"(a notebook or the Python prompt), which spawned processes cannot import; put it "
                          f"in a .py file and import it from there")
    try:
        pickle.dumps(fn)
    except Exception as e:
        raise UsageError(f"launch: fn must be a module-level function that spawned processes can import "
                          f"(not a lambda or a nested function), got {getattr(fn, '__qualname__', fn)!r} "
                          f"({type(e).__name__}: {e}); define it at the top level of a .py file") from None


def _check_callable_with_rank(fn, args: tuple) -> None:
    """launch calls ``fn(rank, *args)``: refuse what cannot take that call, before any process starts."""
    if not callable(fn):
        raise UsageError(f"launch: fn must be a function that takes the rank (fn(rank, *args)), got {fn!r}")
    try:
        inspect.signature(fn).bind(0, *args)
    except TypeError as e:
        raise UsageError(f"launch calls fn(rank, *args) on each rank, and "
                          f"{getattr(fn, '__qualname__', fn)}{_signature(fn)} cannot take {1 + len(args)} "
                          f"positional argument(s) ({e}); add the rank as its first parameter") from None
    except ValueError:  # no signature to read (a builtin): let the call itself decide
        pass


def _signature(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _save_result(result, path: str, rank: int) -> None:
    """The rank's return value, for the parent; a module or anything unpicklable is a UsageError."""
    if any(isinstance(leaf, torch.nn.Module) for leaf in _leaves(result)):
        raise UsageError(f"launch: rank {rank}'s fn returned a {_module_in(result)}, which cannot leave its "
                         f"process (its tensors are this rank's shards, its process group ends with the rank); "
                         f"return plain data instead, e.g. pm.full_state_dict(), the losses, or None")
    try:
        torch.save(result, path)
    except Exception as e:
        raise UsageError(f"launch: rank {rank}'s return value (a {type(result).__name__}) cannot be sent back to "
                         f"the caller ({type(e).__name__}: {e}); return plain data (tensors, numbers, strings, "
                         f"lists and dicts of them)") from None


def _leaves(value, depth: int = 0):
    """The values inside nested dicts, lists, tuples and sets (torch's pytree treats a set as a leaf)."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple, set)) and depth <= 8:
        for v in value:
            yield from _leaves(v, depth + 1)
    else:
        yield value


def _module_in(result) -> str:
    return next(type(leaf).__name__ for leaf in _leaves(result) if isinstance(leaf, torch.nn.Module))


def _read_result(out_dir: str, rank: int):
    try:
        return torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=False)
    except Exception as e:
        raise UsageError(f"launch: rank {rank}'s return value cannot be read back ({type(e).__name__}: {e}); "
                         f"return plain data (tensors, numbers, strings, lists and dicts of them)") from None


def _init(rank: int, world: int, backend: str, timeout: float, store=None) -> None:
    os.environ["AUTOPAR_TIMEOUT"] = str(timeout)  # autopar.compile's groups use the same timeout
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // world))
    if backend == "nccl" and torch.cuda.is_available():  # one GPU per rank; NCCL's object collectives use it too
        torch.cuda.set_device(local_gpu_index(rank))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout),
                            store=store)


def _run_under_torchrun(fn, args: tuple, backend: str, timeout: float):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _init(rank, world, backend, timeout)
    try:  # private, but the only handle on the store torchrun's rendezvous created; without it no rank is named
        faults.register(dist.distributed_c10d._get_default_store(), rank, world)
    except Exception:
        pass
    try:
        return fn(rank, *args)
    except Exception as e:
        explained = faults.explain(e)
        if explained is e:
            raise
        raise explained from e
    finally:
        faults.unregister()
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker(rank: int, fn, world: int, host: str, port: int, backend: str, timeout: float, args: tuple,
            out_dir: str, env: dict) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's from its first launch
    os.environ.update(env)
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        store = dist.TCPStore(host, port, world, False, timeout=datetime.timedelta(seconds=timeout))
        _wait_for_every_rank(store, rank, world)
        _init(rank, world, backend, timeout, store)
        faults.register(store, rank, world)
        _save_result(fn(rank, *args), os.path.join(out_dir, f"rank{rank}.pt"), rank)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent before this process ends
        _fail(rank, out_dir, e)
    faults.unregister()
    if dist.is_initialized():  # fn may have destroyed it
        dist.destroy_process_group()


def _wait_for_every_rank(store, rank: int, world: int) -> None:
    """Ranks start at different times (imports take seconds on a busy machine); meet in the store first,
    so that start-up skew does not count against the collective ``timeout`` of the rendezvous."""
    store.set(f"autopar/started/{rank}", "1")
    store.wait([f"autopar/started/{r}" for r in range(world)], datetime.timedelta(seconds=_STARTUP_TIMEOUT_S))


def _fail(rank: int, out_dir: str, error: BaseException) -> None:
    """Report ``error`` to the peers and the parent, print it, and end this process (exit code 1) without
    tearing down process groups, whose destructors may wait on dead peers."""
    explained = faults.explain(error)
    faults.report_failure(explained)
    text = "".join(traceback.format_exception(error))
    if explained is not error:
        text += f"\n{type(explained).__name__}: {explained}\n"
    try:
        blob = pickle.dumps(explained)
    except Exception:
        blob = None
    record = {"type": type(explained).__name__, "message": str(explained), "traceback": text, "time": time.time(),
              "exception": blob, "communication": isinstance(explained, CommunicationError)}
    with open(os.path.join(out_dir, f"rank{rank}.err"), "wb") as f:
        pickle.dump(record, f)
    sys.stderr.write(f"[autopar rank {rank}] {text}")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def _supervise(procs: list, store, grace: float) -> dict[int, str]:
    """Reap children as they end (recording exit codes in the store); once one fails, give the rest
    ``grace`` seconds, then kill them. Returns {rank: why it was killed}."""
    pending = dict(enumerate(procs))
    failed_at = None
    try:
        while pending:
            wait = 1.0 if failed_at is None else max(0.0, failed_at + grace - time.monotonic())
            multiprocessing.connection.wait([p.sentinel for p in pending.values()], timeout=wait)
            for rank, p in list(pending.items()):
                if p.exitcode is None:
                    continue
                p.join()
                del pending[rank]
                _record_exit(store, rank, p.exitcode)
                if p.exitcode != 0 and failed_at is None:
                    failed_at = time.monotonic()
            if failed_at is not None and pending and time.monotonic() >= failed_at + grace:
                return _kill(pending, f"was still running {grace:.0f} s after another rank failed (stuck?); "
                                          f"killed by launch")
    except BaseException:  # KeyboardInterrupt included: never leave orphans behind
        _kill(pending, "killed by launch")
        raise
    return {}


def _record_exit(store, rank: int, code: int) -> None:
    try:
        faults.record_exit(store, rank, code)
    except Exception:
        pass


def _kill(pending: dict, why: str) -> dict[int, str]:
    for p in pending.values():
        p.kill()
    for p in pending.values():
        p.join()
    return {rank: why for rank in pending}


def _failure(procs: list, out_dir: str, killed: dict[int, str]) -> BaseException:
    """The exception ``launch`` raises. Blame, in order: ranks that died without a Python exception;
    the first rank that raised its own (non-communication) error; ranks still running when every
    failure was a communication error (stuck); else the first error."""
    if any(os.path.exists(os.path.join(_bootstrap_dir(), f"bootstrap-{p.pid}.txt")) for p in procs):
        return UsageError(_NO_MAIN_GUARD)
    records = {r: _read_record(out_dir, r) for r in range(len(procs))}
    status = {r: _status(r, p.exitcode, records[r], killed) for r, p in enumerate(procs)}
    rank_errors = {r: rec["message"] for r, rec in records.items() if rec is not None}
    died = [r for r, p in enumerate(procs) if p.exitcode != 0 and records[r] is None and r not in killed]
    raised = [r for _, r in sorted((rec["time"], r) for r, rec in records.items() if rec is not None)]
    own = [r for r in raised if not records[r]["communication"]]
    causes = died or (own[:1] if own else sorted(killed)) or raised[:1]
    if not died and causes[0] in records and records[causes[0]] is not None:
        error = _unpickle(records[causes[0]])
        if error is not None:
            _add_note(error, causes[0], status, records[causes[0]]["traceback"])
            error.rank_errors = rank_errors
            return error
    head = " and ".join(f"rank {r} {status[r]}" for r in causes)
    others = "; ".join(f"rank {r}: {status[r]}" for r in range(len(procs)) if r not in causes)
    error = LaunchError(f"{head}; other ranks stopped: {others or 'none'}")
    error.dead_ranks, error.rank_errors = causes, rank_errors
    return error


def _add_note(error: BaseException, rank: int, status: dict[int, str], remote_traceback: str) -> None:
    if hasattr(error, "add_note"):  # Python >= 3.11
        every = "; ".join(f"rank {r}: {s}" for r, s in status.items())
        error.add_note(f"raised on rank {rank} of {len(status)} (autopar.launch); every rank: {every}\n"
                       f"rank {rank}'s traceback:\n{remote_traceback}")


def _status(rank: int, code: int, record: dict | None, killed: dict[int, str]) -> str:
    """How one rank ended, in one clause (its full error is in ``rank_errors``)."""
    if rank in killed:
        return killed[rank]
    if record is not None:
        return f"{record['type']}: {record['message'].split('; other ranks stopped')[0]}"
    if code == 0:
        return "finished"
    return f"died ({faults.exit_text(code)}) without a Python exception (os._exit, a signal, or out of memory)"


def _read_record(out_dir: str, rank: int) -> dict | None:
    path = os.path.join(out_dir, f"rank{rank}.err")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _unpickle(record: dict) -> BaseException | None:
    try:
        return pickle.loads(record["exception"]) if record["exception"] else None
    except Exception:
        return None
