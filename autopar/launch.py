"""``autopar.launch``: run ``fn(rank, *args)`` on n local processes over gloo, or once under torchrun.

Under ``torchrun`` (RANK and WORLD_SIZE set) the process group is initialized from the environment and
``fn`` runs in this process. Otherwise n processes are spawned on this machine. Every process group gets
``timeout`` seconds per collective, so a dead rank makes the others fail instead of hanging. Each rank's
return value comes back to the caller (rank order); when a rank raises, ``launch`` raises with its error.
"""
from __future__ import annotations

import datetime
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, backend: str, timeout: float) -> None:
    os.environ["AUTOPAR_TIMEOUT"] = str(timeout)  # autopar.compile's groups use the same timeout
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // world))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout))


def _worker(rank: int, fn, world: int, port: int, backend: str, timeout: float, args: tuple, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    _init(rank, world, backend, timeout)
    try:
        result = fn(rank, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def launch(fn, nprocs: int, *args, backend: str = "gloo", timeout: float = 60.0) -> list:
    """Run ``fn(rank, *args)`` on ``nprocs`` ranks; returns the list of their results (see module doc)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _init(rank, world, backend, timeout)
        try:
            return [fn(rank, *args)]
        finally:
            dist.destroy_process_group()
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"launch: nprocs must be a positive integer, got {nprocs!r}")
    with tempfile.TemporaryDirectory(prefix="autopar-launch-") as out_dir:
        mp.spawn(_worker, args=(fn, nprocs, _free_port(), backend, timeout, args, out_dir), nprocs=nprocs)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(nprocs)]
