"""A rank killed during ``pm.save`` over a good checkpoint never damages it: the save is all or nothing.

Each case: 2 real ranks (forked from this process, gloo over a FileStore) compile an MLP, train one SGD
step, save it as step 1 (the good checkpoint), train a second step, and save over it as step 2 with
``AUTOPAR_CHECKPOINT_CRASH`` set, so one rank ``os._exit``s at the named point of the save: before,
during (its data files cut short, then killed) or after writing its files, or rank 0 before, between
and after the renames that switch the new checkpoint in. The survivor is killed as a job scheduler
would. Then this process loads the path without a process group (``export_state_dict``, which verifies
every file) and must get exactly step 1's or, once the switch is done, step 2's weights. A last save
to the same path cleans up what the crash left. Negative control: the two steps' weights differ.
"""
import multiprocessing
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.runtime.checkpoint import export_state_dict
from autopar.runtime.checkpoint_files import CRASH_VAR
from tests.models import make_mlp

WORLD = 2
CASES = {  # crash point: (rank killed, step the path holds afterwards)
    "before_write": (1, 1), "during_write": (1, 1), "after_write": (1, 1),
    "before_switch": (0, 1), "mid_switch": (0, 1), "after_switch": (0, 2),
}


def rank_main(rank: int, root: str, store: str, plan_json: str, crash: str | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    model, batch = make_mlp()
    pm = autopar.compile(model, autopar.Cluster.local(WORLD), batch, plan=autopar.Plan.from_json(plan_json),
                         timeout=60)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    for step in (1, 2):
        pm.train_step(*batch)
        opt.step()
        opt.zero_grad()
        state = pm.full_state_dict()
        if rank == 0:
            torch.save(state, os.path.join(root, f"weights{step}.pt"))
        if step == 2 and crash:
            os.environ[CRASH_VAR] = crash
        pm.save(os.path.join(root, "ckpt"), step=step)
    os._exit(0)


def run_ranks(root: str, plan_json: str, crash: str | None) -> list[int]:
    """Exit codes of both ranks; once one ends, the other gets 5 s, then is killed."""
    ctx = multiprocessing.get_context("fork")
    store = os.path.join(tempfile.mkdtemp(prefix="autopar-store-"), "store")
    procs = [ctx.Process(target=rank_main, args=(r, root, store, plan_json, crash)) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = None
    while any(p.is_alive() for p in procs):
        time.sleep(0.05)
        if deadline is None and any(not p.is_alive() for p in procs):
            deadline = time.monotonic() + 5
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.is_alive():
                    p.kill()
    for p in procs:
        p.join()
    return [p.exitcode for p in procs]


@pytest.fixture(scope="module")
def plan_json():
    assert not dist.is_initialized(), "fork needs a parent without a process group"
    model, batch = make_mlp()
    return autopar.plan(model, autopar.Cluster.local(WORLD), batch).to_json()


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.distributed
@pytest.mark.parametrize("point", list(CASES))
def test_a_rank_killed_during_a_save_leaves_a_whole_checkpoint(point, plan_json, tmp_path):
    killed, held = CASES[point]
    codes = run_ranks(str(tmp_path), plan_json, f"{point}:{killed}")
    assert codes[killed] == 43, f"rank {killed} was not killed at {point}: exit codes {codes}"
    weights = {s: torch.load(tmp_path / f"weights{s}.pt") for s in (1, 2)}
    assert not same(weights[1], weights[2]), "negative control: the two steps' weights are equal"
    loaded = export_state_dict(tmp_path / "ckpt")
    assert same(loaded, weights[held]), f"after a kill at {point} the checkpoint holds neither step whole"
    assert run_ranks(str(tmp_path), plan_json, None) == [0, 0]
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "weights1.pt", "weights2.pt"], "crash debris left"
    assert same(export_state_dict(tmp_path / "ckpt"), weights[2])
