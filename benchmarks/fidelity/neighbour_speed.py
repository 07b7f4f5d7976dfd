"""How fast one rank's reference mm runs depends on what the other rank does at that moment.

    python benchmarks/fidelity/neighbour_speed.py [--rounds 8] [--calls 300]

Process 0 times the profiler's reference mm (fp32 256³, one thread) while process 1 (one thread) is idle,
runs the same reference mm, runs forward + backward of the fidelity GPT at one data-parallel rank's
batch, or runs the block the profiler's ρ is measured beside (``profiler_neighbour.TrainingBlock``: is it a
fair stand-in for the step?); the four alternate round by round (drift cancels), and process 1 signals it
is busy before each window starts. Printed: the median seconds per call for each neighbour and its ratio to "beside the
reference". A profile's figures are at its reference's level (``probes.SpeedReference``: the median of its
reference windows); where a neighbour's compute slows a core as much as this VM's does (2 vCPUs:
about 1.9× beside a busy neighbour, 2026-11-27), a level read while the other rank waits (a collective, a
barrier, a window that ended earlier) describes a faster machine than a training step, whose ranks compute
at once, runs on.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

NEIGHBOURS = ("idle", "reference", "step", "block")


def _neighbour(modes, stop, busy, done) -> None:
    import torch

    from autopar.profiling.profiler_neighbour import neighbour_step
    from benchmarks.fidelity.fidelity_plans import BATCH, CONFIG
    from examples.gpt import GPT, make_batch

    torch.set_num_threads(1)
    model, (x, y) = GPT(CONFIG), make_batch(CONFIG, BATCH // 2)
    a = torch.randn(256, 256)
    work = {"reference": lambda: torch.mm(a, a), "step": lambda: model(x, y).backward(),
            "idle": lambda: time.sleep(0.001), "block": neighbour_step("cpu")}
    work["step"](), work["block"]()
    done.set()
    for mode in iter(modes.get, None):
        work[mode]()
        busy.set()
        while not stop.is_set():
            work[mode]()
        done.set()


def measure(rounds: int, calls: int) -> dict[str, list[float]]:
    import torch

    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    modes, stop, busy, done = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event()
    worker = ctx.Process(target=_neighbour, args=(modes, stop, busy, done))
    worker.start()
    done.wait(600)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    seconds: dict[str, list[float]] = {n: [] for n in NEIGHBOURS}
    for _ in range(rounds):
        for mode in NEIGHBOURS:
            busy.clear(), done.clear(), stop.clear()
            modes.put(mode)
            busy.wait(600)
            start = time.perf_counter()
            for _ in range(calls):
                torch.mm(a, b)
            seconds[mode].append((time.perf_counter() - start) / calls)
            stop.set()
            done.wait(600)
    modes.put(None)
    worker.join()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    print(f"# neighbour_speed: load average {os.getloadavg()}")
    seconds = measure(args.rounds, args.calls)
    beside = statistics.median(seconds["reference"])
    for mode in NEIGHBOURS:
        median = statistics.median(seconds[mode])
        print(f"neighbour {mode:9s}: reference mm {median * 1e6:8.1f} us, {2 * 256**3 / median / 1e9:6.1f} GFLOP/s, "
              f"{median / beside:.3f} of beside-the-reference; rounds (us) {[round(s * 1e6) for s in seconds[mode]]}")
    print(f"# load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
