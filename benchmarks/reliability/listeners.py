"""Which addresses a job's processes listen on: ``autopar.launch`` against ``torchrun``'s rendezvous flags.

    python benchmarks/reliability/listeners.py      (needs ``ss`` from iproute2; Linux)

Each launcher starts 2 gloo ranks of a script that joins the process group, marks itself ready and sleeps;
once both ranks are ready, ``ss -ltnp`` lists the listening TCP sockets of the launcher's process tree.
A socket on ``*`` / ``0.0.0.0`` / ``[::]`` is reachable from other machines; the c10d store behind it has no
authentication. The table shows each command and its listeners.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RANK_SCRIPT = """
import os, sys, time, torch.distributed as dist
dist.init_process_group("gloo")
open(os.path.join(sys.argv[1], f"ready{dist.get_rank()}"), "w").close()
time.sleep(float(sys.argv[2]))
dist.barrier()
dist.destroy_process_group()
"""

LAUNCH_SCRIPT = """
import os, sys, time
sys.path.insert(0, {root!r})
import autopar, torch.distributed as dist

def rank_main(rank, ready, hold):
    open(os.path.join(ready, f"ready{{rank}}"), "w").close()
    time.sleep(hold)
    dist.barrier()

if __name__ == "__main__":
    autopar.launch(rank_main, 2, sys.argv[1], float(sys.argv[2]), timeout=120)
"""


def process_tree(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            children = []
        todo += [int(c) for c in children]
    return out


def listeners(pids: set[int]) -> list[str]:
    text = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in text.splitlines():
        fields = line.split()
        if any(f"pid={p}," in line for p in pids):
            found.append(fields[3])
    return sorted(set(found))


def run(command: list[str], work: Path, hold: float = 20.0) -> list[str]:
    for ready in work.glob("ready*"):
        ready.unlink()
    proc = subprocess.Popen(command + [str(work), str(hold)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while len(list(work.glob("ready*"))) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    found = listeners(process_tree(proc.pid)) if proc.poll() is None else ["(the job ended before it was ready)"]
    proc.wait(timeout=hold + 120)
    return found


def main() -> None:
    root = Path(__file__).resolve().parents[2]
    work = Path(tempfile.mkdtemp(prefix="autopar-listeners-"))
    (work / "rank.py").write_text(RANK_SCRIPT)
    (work / "launch.py").write_text(LAUNCH_SCRIPT.format(root=str(root)))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    commands = {
        "autopar.launch(fn, 2)": [sys.executable, str(work / "launch.py")],
        "torchrun --master-addr 127.0.0.1 --master-port 29631": torchrun + [
            "--master-addr", "127.0.0.1", "--master-port", "29631", str(work / "rank.py")],
        "torchrun --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29632 --local-addr 127.0.0.1": torchrun + [
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29632", "--local-addr", "127.0.0.1",
            str(work / "rank.py")],
        "torchrun --standalone": torchrun + ["--standalone", str(work / "rank.py")],
    }
    print(f"{'command':<86} listening on")
    for name, command in commands.items():
        found = run(command, work)
        every = [a for a in found if a.startswith(("*:", "0.0.0.0:", "[::]:"))]
        print(f"{name:<86} {', '.join(found)}" + (f"   <- {len(every)} on all interfaces" if every else ""))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
