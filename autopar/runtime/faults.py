"""Name the rank that died when a collective fails, so no rank hangs or fails with a bare socket error.

With gloo, a rank's death makes its peers' next collective fail at once ("Connection reset by peer"),
but the error does not say which rank died; with any backend a hung peer makes collectives time out.
This module turns both into ``CommunicationError("rank 2 died (...); other ranks stopped: ...")``.

Evidence, read from the c10d store (keys under ``autopar/faults/``), most definite first:
  * ``exit/<r>``: the exit code of rank r, written by ``autopar.launch``'s parent as it reaps a child
    (``supervised`` says a launcher does that);
  * ``proc/<r>``: "host pid" of rank r, written by ``register``; a peer on this host whose pid is gone or
    a zombie is dead;
  * ``hb/<r>``: a counter a daemon thread of rank r bumps every ``HEARTBEAT_S`` seconds; a counter that
    stands still for ``STALE_BEATS`` beats means the rank is gone (the only evidence across hosts);
  * ``fail/<r>``: the one-line reason rank r stopped, written before it raises. A gone rank with a
    report stopped *because of* another failure (or raised its own error); one without died.

Invariants: ``guard`` adds no store traffic on the success path (a Python call and a ``try``); the
diagnosis waits at most ``STALE_BEATS * HEARTBEAT_S`` seconds (2 s), plus a store round trip per rank;
a failure for which no rank is found dead stays what it was, except a timeout, which becomes a
``CommunicationError`` saying that a peer may be stuck. ``autopar.launch`` registers every rank it starts
(and, under torchrun, the rank it runs in).
"""
from __future__ import annotations

import functools
import os
import re
import socket
import threading
import time

import torch.distributed as dist

from autopar.errors import AutoparError, CommunicationError

HEARTBEAT_S = 0.5
STALE_BEATS = 4
_PREFIX = "autopar/faults/"
_EXIT_RECORD_WAIT_S = 1.0
_COMM_ERROR_HINTS = ("connection reset", "connection closed", "connection refused", "broken pipe", "timed out",
                     "timeout", "socket", "peer")


class _Registration:
    """This process's rank, world size, its own store client, and the heartbeat thread."""

    def __init__(self, store, rank: int, world: int):
        self.rank, self.world = rank, world
        self.store = dist.PrefixStore(_PREFIX, store)
        self.host = socket.gethostname()
        self.stop = threading.Event()
        self.store.set(f"proc/{rank}", f"{self.host} {os.getpid()}")
        beat_store = dist.PrefixStore(_PREFIX, store.clone()) if hasattr(store, "clone") else self.store
        self.thread = threading.Thread(target=self._beat, args=(beat_store,), daemon=True,
                                       name=f"autopar-heartbeat-{rank}")
        self.thread.start()

    def _beat(self, store) -> None:
        key, published = f"hb/{self.rank}", None
        while not self.stop.wait(HEARTBEAT_S):
            try:
                store.add(key, 1)
                if _DOING[0] != published:  # what this rank is doing, for a peer stuck in a one-rank call
                    published = _DOING[0]
                    store.set(f"at/{self.rank}", published)
            except Exception:  # the store is gone: nothing left to tell
                return


_REG: _Registration | None = None


def register(store, rank: int, world: int) -> None:
    """Publish this rank's host and pid in ``store`` (a c10d store every rank shares) and start beating."""
    global _REG
    unregister()
    _REG = _Registration(store, rank, world)


def unregister() -> None:
    """Stop the heartbeat before a clean exit (peers that still need this rank then see its exit code,
    or, without a launcher, a heartbeat that stands still)."""
    global _REG
    if _REG is not None:
        _REG.stop.set()
        try:
            _REG.store.set(f"at/{_REG.rank}", f"returned from its function (its last autopar call: {_LAST[0]})")
        except Exception:  # the store is gone: nothing left to tell
            pass
        _REG = None


# ---- which autopar call each rank is in: a collective called on some ranks only ------------------------
_DOING = ["has made no autopar call yet"]
_LAST = ["none"]
_INSIDE = [False]


def collective_call(name: str):
    """Decorator of an autopar call every rank must make (``pm.save``, ``pm.train_step``, ...): while it
    runs, the heartbeat publishes "in <name>" (no store traffic on the call's own path); a failure inside
    it, when some peer is not in the same call, becomes a CommunicationError saying so (``one_rank_call``)."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            if _INSIDE[0]:  # a call inside another (export gathers the state): the outer one counts
                return fn(*args, **kwargs)
            _DOING[0], _INSIDE[0] = f"is in {name}", True
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                explained = _explain_one_rank_call(e, name)
                if explained is e:
                    raise
                raise explained from e
            finally:
                _DOING[0], _LAST[0], _INSIDE[0] = f"is outside autopar's calls (its last: {name})", name, False
        return run
    return wrap


def _explain_one_rank_call(error: BaseException, name: str) -> BaseException:
    """A CommunicationError naming the peers that are not in ``name`` when ``error`` is a failure of
    torch.distributed (or already explained as one); else ``error``."""
    if _REG is None or (isinstance(error, AutoparError) or not isinstance(error, (RuntimeError, CommunicationError))):
        return error
    error = explain(error, name)
    if _died_inside_its_function(getattr(error, "dead_ranks", [])):  # its last published call may be stale
        return error
    elsewhere = one_rank_call(f"is in {name}")
    if not elsewhere:
        return error
    peers = "; ".join(f"rank {r} {doing}" for r, doing in sorted(elsewhere.items()))
    explained = CommunicationError(
        f"{name} is a collective that every rank must call, but rank {_REG.rank} called it alone: {peers}. Fix: "
        f"call {name} on every rank (not under `if rank == 0:`); it writes each file once by itself")
    report_failure(explained)
    return explained


def _died_inside_its_function(dead_ranks: list[int]) -> bool:
    """True when a peer found dead had not returned from its function: its death, not a call the others
    skipped, is the cause (a peer that returned while this rank waited in a collective is a one-rank call)."""
    try:
        doing = _read_all(_REG.store, "at", [r for r in dead_ranks if r >= 0])
    except Exception:  # the store is gone: the death found is the best evidence
        return bool(dead_ranks)
    return any(not doing.get(r, "").startswith("returned from its function") for r in dead_ranks)


def one_rank_call(mine: str) -> dict[int, str]:
    """{peer: what it is doing} for the peers not in the call ``mine``, after one heartbeat's wait (each
    rank publishes its call with its heartbeat)."""
    time.sleep(2 * HEARTBEAT_S)
    peers = [r for r in range(_REG.world) if r != _REG.rank]
    try:
        doing = _read_all(_REG.store, "at", peers)
    except Exception:  # the store is gone: no evidence either way
        return {}
    return {r: doing.get(r, "has made no autopar call yet") for r in peers if doing.get(r) != mine}


def mark_supervised(store) -> None:
    """Called by ``autopar.launch``'s parent before starting ranks: exit codes will be recorded."""
    dist.PrefixStore(_PREFIX, store).set("supervised", "1")


def record_exit(store, rank: int, exitcode: int) -> None:
    """Called by ``autopar.launch``'s parent for each child it reaps: the definite evidence."""
    dist.PrefixStore(_PREFIX, store).set(f"exit/{rank}", str(exitcode))


def report_failure(error: BaseException) -> None:
    """Tell peers why this rank stops (before it raises), so they blame the rank that caused it: a
    ``CommunicationError`` marks this rank as stopped by someone else, any other error as a cause."""
    if _REG is None:
        return
    kind = "comm" if isinstance(error, CommunicationError) else "error"
    text = f"{type(error).__name__}: {_first_line(error)}"[:500]
    try:
        _REG.store.set(f"fail/{_REG.rank}", f"{kind} {text}")
    except Exception:  # the store is gone; peers will see this rank's process end instead
        pass


def is_communication_failure(error: BaseException) -> bool:
    """True for what a collective raises when a peer died or hung (gloo, NCCL, store errors)."""
    if isinstance(error, (CommunicationError, dist.DistError)):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(h in text for h in _COMM_ERROR_HINTS)


def guard(what: str, group_key: str | None, fn, /, *args, **kwargs):
    """Run one torch.distributed call ``fn(*args, **kwargs)``; a communication failure becomes a
    ``CommunicationError`` naming the dead rank(s) (see module docstring). Other errors pass unchanged.
    The first three are positional-only so that ``fn``'s own keywords (``op=``, ``group=``) pass through."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        explained = explain(e, _collective_name(what, group_key))
        if explained is e:
            raise
        raise explained from e


def _collective_name(op: str, group_key: str | None) -> str:
    if group_key is None:
        return op
    from autopar.runtime import groups

    try:
        return f"{op} on group {group_key} (ranks {', '.join(map(str, groups.members(group_key)))})"
    except KeyError:
        return f"{op} on group {group_key}"


def explain(error: BaseException, during: str = "a collective") -> BaseException:
    """``error`` if it is not a communication failure (or already explained), else the CommunicationError
    that names the dead ranks; the reason is also reported to peers (``fail/<rank>``)."""
    if isinstance(error, CommunicationError) or not is_communication_failure(error):
        return error
    if not dist.is_initialized():
        return CommunicationError(
            f"{during} failed: torch.distributed has no process group (it did not start, was destroyed, "
            f"or this module was built in another process). Fix: call train_step/forward inside the autopar.launch or "
            f"torchrun job that compiled the module, before destroy_process_group ({_first_line(error)})")
    me = _REG.rank if _REG is not None else dist.get_rank()
    causes, stopped = find_dead_ranks()
    if not causes and "time" not in str(error).lower():
        return error  # no rank died and nothing timed out: a genuine error of the call, keep it as is
    explained = CommunicationError(describe(me, during, error, causes, stopped))
    explained.dead_ranks = sorted(causes)
    report_failure(explained)
    return explained


def find_dead_ranks(wait_s: float | None = None) -> tuple[dict[int, str], dict[int, str]]:
    """(causes, stopped): peers that died or raised their own error, {rank: how}, and peers that stopped
    because of a failure elsewhere, {rank: their report}. Polls the evidence (module docstring) until a
    cause shows up or ``wait_s`` (default ``STALE_BEATS * HEARTBEAT_S``) passes; then heartbeats decide."""
    if _REG is None:
        return {}, {}
    wait_s = STALE_BEATS * HEARTBEAT_S if wait_s is None else wait_s
    peers = [r for r in range(_REG.world) if r != _REG.rank]
    try:
        first_beats = _read_all(_REG.store, "hb", peers)
        deadline = time.monotonic() + wait_s
        # once a process is seen gone, give a launcher that records exit codes a moment to record its one
        exit_wait = _EXIT_RECORD_WAIT_S if _REG.store.check(["supervised"]) else 0.0
        exit_deadline = None
        while True:
            exits = _exits(peers)
            gone = {**_gone_local_pids(peers), **exits}
            causes, stopped = _classify(gone, _read_all(_REG.store, "fail", list(gone)))
            if causes and exit_deadline is None:
                exit_deadline = time.monotonic() + exit_wait
            if (causes and (set(causes) <= set(exits) or time.monotonic() >= exit_deadline)) \
                    or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if not causes:
            beats = _read_all(_REG.store, "hb", peers)
            causes = {r: f"its heartbeat stood still for {wait_s:.1f} s" for r in first_beats
                      if r not in gone and beats.get(r) == first_beats[r]}
    except Exception as e:  # the store lives in the launcher or rank 0: its loss is itself the evidence
        return {-1: f"the c10d store is unreachable ({_first_line(e)}): the launcher or rank 0 died"}, {}
    return causes, stopped


def _classify(gone: dict[int, str], reports: dict[int, str]) -> tuple[dict[int, str], dict[int, str]]:
    causes, stopped = {}, {}
    for r, how in gone.items():
        kind, _, text = reports.get(r, "").partition(" ")
        if kind == "comm":
            stopped[r] = text
        elif kind == "error":
            causes[r] = f"raised {text}"
        else:
            causes[r] = how
    return causes, stopped


def _exits(peers: list[int]) -> dict[int, str]:
    codes = _read_all(_REG.store, "exit", peers)
    return {r: exit_text(int(c)) for r, c in codes.items()}


def exit_text(code: int) -> str:
    if code < 0:
        import signal

        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}" + (" (it returned while peers still needed it)" if code == 0 else "")


def _gone_local_pids(peers: list[int]) -> dict[int, str]:
    """Peers on this host whose process no longer runs (gone, or a zombie not yet reaped)."""
    out = {}
    for r, text in _read_all(_REG.store, "proc", peers).items():
        host, pid = text.split()
        if host == _REG.host and not _process_running(int(pid)):
            out[r] = f"process {pid} on {host} is gone"
    return out


def _process_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): fall back to signal 0
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def _read_all(store, kind: str, ranks: list[int]) -> dict[int, str]:
    out = {}
    for r in ranks:
        key = f"{kind}/{r}"
        if store.check([key]):
            out[r] = store.get(key).decode()
    return out


def describe(me, during: str, error: BaseException, causes: dict[int, str], stopped: dict[int, str]) -> str:
    """One message: who died and how, what this rank was doing, which ranks stop because of it, the fix."""
    cause = _first_line(error)
    if not causes:
        return (f"{during} failed on rank {me} ({cause}) and no peer is known to have died: a peer may be "
                f"stuck (a deadlock, or slower than the timeout). Fix: check every rank's log; raise "
                f"autopar.launch's or autopar.compile's timeout if a step legitimately takes longer")
    names = " and ".join(how if r < 0 else f"rank {r} failed ({how})" if how.startswith("raised") else
                         f"rank {r} died ({how})" for r, how in sorted(causes.items()))
    world = _REG.world if _REG is not None else 0
    others = ", ".join(f"{r}" + (" (this rank)" if r == me else "") + (" (already exited)" if r in stopped else "")
                       for r in range(world) if r not in causes)
    return (f"{names} while rank {me} was in {during} ({cause}); other ranks stopped: {others or 'none'}. "
            f"Fix: see the dead rank's own output for why it died (an exception, out of memory, a signal); "
            f"restart the job, resuming from the last pm.save checkpoint")


def _first_line(error: BaseException) -> str:
    """The informative part of a backend error: gloo prefixes a source location and appends advice."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    text = re.sub(r"\s*\[[\d.:a-f]+\]:\d+", "", text)
    return text.split(". This is typically")[0].rstrip(".")
