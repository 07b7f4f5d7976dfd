"""Run by tests/test_torchrun.py under ``torchrun``: the small GPT, planned on rank 0 and trained 3 AdamW steps
on 4 ranks (2 nodes x 2 processes, a 2x2 mesh). Usage: torchrun ... torchrun_train.py OUT_DIR ok|fail

"fail" gives the cluster 1 KB per device, so planning on rank 0 raises InfeasibleError; every rank must raise it
(rank 0 sends it) instead of waiting for a plan. Each rank writes ``start-<rank>`` when it starts and
``end-<rank>.json`` (its error, if any) when it ends; rank 0 writes ``result.pt`` (losses, final state).
"""
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import autopar  # noqa: E402
from tests.models import make_small_gpt  # noqa: E402
from tests.parity import EPS, LR  # noqa: E402

STEPS = 3


def train(rank: int, out_dir: str, fail: bool) -> None:
    model, batch = make_small_gpt()
    cluster = autopar.Cluster.local(4, mesh_shape=(2, 2))
    if fail:
        cluster = cluster.with_memory(1e3)
    pm = autopar.compile(model, cluster, batch, stages=1)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    losses = []
    for _ in range(STEPS):
        losses.append(pm.train_step(*batch).item())
        opt.step()
        opt.zero_grad()
    state = pm.full_state_dict()
    if rank == 0:
        torch.save({"losses": losses, "state": state}, os.path.join(out_dir, "result.pt"))


def main() -> int:
    out_dir, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    with open(os.path.join(out_dir, f"start-{rank}"), "w") as f:
        f.write(str(time.time()))
    error = None
    try:
        autopar.launch(train, 4, out_dir, mode == "fail", timeout=60)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    with open(os.path.join(out_dir, f"end-{rank}.json"), "w") as f:
        json.dump({"time": time.time(), "error": error}, f)
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
