"""The same training script under ``torchrun``: 2 nodes x 2 processes on loopback (c10d rendezvous, 127.0.0.1).

Parity: the 4 ranks plan on rank 0 (the plan exchange), train the small GPT 3 AdamW steps, and must match one
device (the tolerances of tests/parity.py); negative control: one device's 2-step weights do not match. Failure:
planning fails on rank 0 (1 KB per device): every rank must end with that InfeasibleError within the configured
60 s collective timeout of its start, not after the 30-minute plan-exchange wait.
"""
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from tests.models import make_small_gpt
from tests.parity import rel, train_one_device

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "torchrun_train.py")
LOSS_TOL, PARAM_TOL, TIMEOUT_S = 1e-5, 1e-4, 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_two_nodes(out_dir, mode: str) -> list[int]:
    """Start both nodes' agents (c10d rendezvous on 127.0.0.1); their exit codes."""
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=autopar-{port}",
               "--local-addr=127.0.0.1", "--max-restarts=0", "--monitor-interval=0.5", SCRIPT, str(out_dir), mode]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outputs = [a.communicate(timeout=600)[0] for a in agents]
    codes = [a.returncode for a in agents]
    if mode == "ok" and codes != [0, 0]:
        print("\n".join(o[-3000:] for o in outputs))
    return codes


def single_device(steps: int):
    model, batch = make_small_gpt()
    return train_one_device(model, [batch] * steps)


@pytest.mark.distributed
def test_torchrun_two_nodes_match_one_device(tmp_path):
    assert torchrun_two_nodes(tmp_path, "ok") == [0, 0]
    result = torch.load(tmp_path / "result.pt")
    losses, state = single_device(3)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], losses))
    param_err = max(rel(result["state"][k], v) for k, v in state.items())
    assert loss_err <= LOSS_TOL and param_err <= PARAM_TOL, (loss_err, param_err)
    _, earlier = single_device(2)
    assert max(rel(result["state"][k], v) for k, v in earlier.items()) > PARAM_TOL, "negative control passed"


@pytest.mark.distributed
@pytest.mark.slow
def test_a_planning_failure_on_rank_0_ends_every_rank_within_the_timeout(tmp_path):
    started = time.time()
    codes = torchrun_two_nodes(tmp_path, "fail")
    assert codes != [0, 0] and time.time() - started < 600
    ends = {r: json.loads((tmp_path / f"end-{r}.json").read_text()) for r in range(4)}
    for rank, end in ends.items():
        assert end["error"] and end["error"].startswith("InfeasibleError"), (rank, end)
        start = float((tmp_path / f"start-{rank}").read_text())
        assert end["time"] - start < TIMEOUT_S, f"rank {rank} took {end['time'] - start:.0f} s to stop"
