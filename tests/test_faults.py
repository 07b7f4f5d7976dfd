"""Faults end runs promptly and say why: a dead rank is named by every other rank, a stuck rank makes its
peers time out instead of hanging, ranks refuse to run different plans, and a plan is deterministic.

Four launches: a script that calls launch at import time (its ranks' error reaches the caller); 4 ranks
train the GPT example and rank 2 calls ``os._exit(1)`` at step 2; 2 ranks where rank 1 never joins a
collective (2 s timeout); 2 ranks where rank 1 passes another plan to ``compile``. The heartbeat path
(ranks on other hosts, where no pid can be probed) is checked in-process on a TCPStore.
"""
import datetime
import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.errors import CommunicationError, LaunchError, PlanError
from autopar.runtime import collectives, faults, groups
from tests.models import make_mlp, make_small_gpt

DEADLINE_S = 60


def train_until_rank_2_dies(rank: int, death_file: str) -> None:
    model, batch = make_small_gpt()
    pm = autopar.compile(model, autopar.Cluster.local(4, mesh_shape=(2, 2)), batch)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    for step in range(5):
        if step == 2 and rank == 2:
            with open(death_file, "w") as f:
                f.write(str(time.time()))
            os._exit(1)
        pm.train_step(*batch)
        opt.step()
        opt.zero_grad()


@pytest.fixture(scope="module")
def dead_rank(tmp_path_factory):
    death_file = str(tmp_path_factory.mktemp("faults") / "death")
    start = time.monotonic()
    try:
        autopar.launch(train_until_rank_2_dies, 4, death_file, timeout=DEADLINE_S)
    except Exception as e:  # the tests inspect it
        error = e
    else:
        error = None
    ended = time.time()
    with open(death_file) as f:
        died_at = float(f.read())
    return {"error": error, "elapsed": time.monotonic() - start, "detection": ended - died_at}


def test_a_dead_rank_is_named_by_every_other_rank(dead_rank):
    error = dead_rank["error"]
    assert isinstance(error, LaunchError), repr(error)
    assert str(error).startswith("rank 2 died (exit code 1)"), str(error)
    assert error.dead_ranks == [2]
    assert sorted(error.rank_errors) == [0, 1, 3], "every survivor must report its own error"
    for rank, message in error.rank_errors.items():
        assert "rank 2 died (" in message and "other ranks stopped" in message, (rank, message)


def test_every_rank_stops_within_the_deadline_after_the_death(dead_rank):
    """From rank 2's death to launch's error (survivors' diagnoses, exits, the parent's report); typically
    about a second. The compile before it depends on the machine's load, so it is not timed."""
    assert dead_rank["detection"] < DEADLINE_S, dead_rank


STUCK_S = 300  # longer than any start-up of two ranks under load: a launch that waited for it took longer


def stuck_peer(rank: int) -> None:
    groups.build_groups([np.arange(2).reshape(1, 2)], datetime.timedelta(seconds=2))
    if rank == 1:
        time.sleep(STUCK_S)  # alive (its heartbeat goes on) but never joins the all-reduce
    collectives._all_reduce(torch.ones(3), groups.group_key(0, 1))


def test_a_stuck_rank_makes_its_peers_time_out_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(LaunchError) as err:
        autopar.launch(stuck_peer, 2, timeout=2)
    elapsed = time.monotonic() - start
    message = str(err.value)
    assert message.startswith("rank 1 was still running") and "killed by launch" in message, message
    assert "no peer is known to have died" in err.value.rank_errors[0], err.value.rank_errors
    assert elapsed < STUCK_S, f"{elapsed:.0f} s: launch waited for the stuck rank instead of stopping it"


UNGUARDED_SCRIPT = """import autopar


def rank_itself(rank):
    return rank


autopar.launch(rank_itself, 2)
"""


def test_a_script_calling_launch_at_import_time_is_told_to_add_the_main_guard(tmp_path):
    """End to end: every starting rank imports the script and so calls launch again; the caller's error says
    why (a rank's note through the launch's bootstrap directory), not only that ranks died."""
    script = tmp_path / "train.py"
    script.write_text(UNGUARDED_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1, done.stderr[-2000:]
    assert last.startswith("autopar.errors.UsageError") and 'if __name__ == "__main__":' in last, last


def different_plan_on_rank_1(rank: int, plan_json: str) -> None:
    plan = autopar.Plan.from_json(plan_json)
    if rank == 1:
        plan.optimizer = "sgd"  # any difference changes the digest
    model, batch = make_mlp()
    autopar.compile(model, autopar.Cluster.local(2), batch, plan=plan)


def test_a_plan_that_differs_on_one_rank_is_refused():
    model, batch = make_mlp()
    plan_json = autopar.plan(model, autopar.Cluster.local(2), batch).to_json()
    with pytest.raises(PlanError, match="differs from rank 0's; pass the same plan on every rank"):
        autopar.launch(different_plan_on_rank_1, 2, plan_json, timeout=30)


def test_the_same_inputs_give_a_byte_identical_plan_json():
    """Planner timings live in ``plan.timings``, which ``to_json`` leaves out; all else is deterministic."""
    model, batch = make_mlp()
    cluster = autopar.Cluster.local(4, mesh_shape=(2, 2))
    a, b = (autopar.plan(model, cluster, batch).to_json() for _ in range(2))
    assert a == b, differing_paths(json.loads(a), json.loads(b))


def differing_paths(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [p for k in sorted(set(a) | set(b))
                for p in differing_paths(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".")]


@pytest.fixture
def remote_peers(monkeypatch):
    """This process as rank 0 of 3 registered in a fresh TCPStore; ranks 1 and 2 'live on another host'."""
    monkeypatch.setattr(faults, "HEARTBEAT_S", 0.05)
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=5),
                           wait_for_workers=False)
    faults.register(server, 0, 3)
    peers = dist.PrefixStore("autopar/faults/", server)
    for r in (1, 2):
        peers.set(f"proc/{r}", f"not-{socket.gethostname()} 1")
        peers.add(f"hb/{r}", 1)
    yield peers
    faults.unregister()


def test_a_silent_heartbeat_names_a_rank_on_another_host(remote_peers):
    stop = threading.Event()
    beating = threading.Thread(target=keep_beating, args=(remote_peers, 2, stop))
    beating.start()
    try:
        causes, _ = faults.find_dead_ranks()
    finally:
        stop.set()
        beating.join()
    assert list(causes) == [1] and "heartbeat stood still" in causes[1], causes
    message = faults.describe(0, "all_reduce", RuntimeError("Connection reset by peer"), causes, {})
    assert message.startswith("rank 1 died (its heartbeat stood still"), message
    assert "other ranks stopped: 0 (this rank), 2" in message, message


def keep_beating(store, rank: int, stop) -> None:
    while not stop.wait(0.02):
        store.add(f"hb/{rank}", 1)


def test_an_error_a_rank_raised_itself_is_the_cause_not_a_death(remote_peers):
    remote_peers.set("exit/1", "1")
    remote_peers.set("fail/1", "error ValueError: bad batch")
    remote_peers.set("exit/2", "1")
    remote_peers.set("fail/2", "comm CommunicationError: rank 1 failed")
    causes, stopped = faults.find_dead_ranks(wait_s=0.1)
    assert causes == {1: "raised ValueError: bad batch"} and list(stopped) == [2], (causes, stopped)
    message = faults.describe(0, "all_gather", RuntimeError("Connection closed by peer"), causes, stopped)
    assert message.startswith("rank 1 failed (raised ValueError: bad batch)"), message


def _train_step_that_loses_its_peer():
    raise RuntimeError("Connection reset by peer")


def _train_step_error(store, monkeypatch, live_peers: tuple[int, ...]) -> str:
    """What rank 0's pm.train_step raises when its collective loses a peer, while ``live_peers`` keep beating and
    peer 1's last published call is still "is in autopar.compile"."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    store.set("at/1", "is in autopar.compile")
    store.set("at/2", "is in pm.train_step")
    stop = threading.Event()
    beating = [threading.Thread(target=keep_beating, args=(store, r, stop)) for r in live_peers]
    for thread in beating:
        thread.start()
    try:
        with pytest.raises(CommunicationError) as caught:
            faults.collective_call("pm.train_step")(_train_step_that_loses_its_peer)()
    finally:
        stop.set()
        for thread in beating:
            thread.join()
    return str(caught.value)


def test_a_dead_peer_is_the_cause_even_when_its_last_published_call_was_another(remote_peers, monkeypatch):
    """A rank that dies within a heartbeat of entering train_step still reads "is in autopar.compile": its
    death, not a one-rank call, is what its peers must report."""
    remote_peers.set("exit/1", "1")
    message = _train_step_error(remote_peers, monkeypatch, live_peers=(2,))
    assert message.startswith("rank 1 died (exit code 1)"), message


def test_a_live_peer_in_another_call_is_named_as_a_one_rank_call(remote_peers, monkeypatch):
    """The control: the same stale-looking record from a peer that is alive is a one-rank call."""
    message = _train_step_error(remote_peers, monkeypatch, live_peers=(1, 2))
    assert "called it alone: rank 1 is in autopar.compile" in message, message


def test_errors_that_are_not_about_communication_pass_unchanged():
    error = ValueError("shape mismatch")
    assert faults.explain(error) is error
    with pytest.raises(CommunicationError, match="no process group"):
        faults.guard("all_reduce", None, _raise, RuntimeError("Connection reset by peer"))


def _raise(error):
    raise error
