"""Does the profile's probe step read the compute factor a training step runs at? compute_time_scale per shape.

    python benchmarks/fidelity/probe_shape_scale.py --cluster cluster.json [--reps 5] [--window 0.3]

The profile's compute_time_scale s comes from forward + backward of ``probe_step.TinyBlock`` at its CPU probe
shape (192 wide, 384 tokens), all ranks at once, in units of the reference mm (``probe_step``'s formula).
The fidelity GPT's ranks run the same op mix at its width on more tokens (one data-parallel rank's
``BATCH / 2 · seq_len``; a replicated rank's ``BATCH · seq_len``), whose activations outgrow a core's L2
cache, with both cores busy. This times TinyBlock at each of those shapes, each window between two
reference-mm windows (fp32 256³), with 2 processes at once (one thread each, windows started together)
and with 1 alone, and prints s per shape by ``probe_step.end_to_end_factor`` on ``--cluster``:

    s(shape) = (step / reference · reference seconds at the profile's level − Σ o_i) / Σ r_i

A missing machine term would show as s growing with the shape (the working set) or from 1 process to 2;
equal s across shapes means the probe's shape is not what a profile misses. Ratios only: the load of
other jobs moves the reference and the step together.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.fidelity.fidelity_plans import BATCH, CONFIG  # noqa: E402

REFERENCE_SIDE, REFERENCE_CALLS = 256, 20


def shapes() -> list[tuple[int, int]]:
    """(width, tokens): the profile's probe, a data-parallel rank's tokens, a replicated rank's."""
    from autopar.profiling.probe_step import CPU_PROBE

    tokens = BATCH * CONFIG.seq_len
    return [(CPU_PROBE.width, CPU_PROBE.tokens), (CONFIG.n_embd, tokens // 2), (CONFIG.n_embd, tokens)]


def _timed(call, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def _rank(barrier, queue, reps: int, window: float) -> None:
    """One process: per shape and rep, reference window, probe window, reference window, all synchronized;
    puts {shape index: median over reps of (probe seconds / mean of the two references)}."""
    import torch

    from autopar.profiling.probe_step import TinyBlock

    torch.set_num_threads(1)
    a, b = torch.randn(REFERENCE_SIDE, REFERENCE_SIDE), torch.randn(REFERENCE_SIDE, REFERENCE_SIDE)
    reference = lambda: torch.mm(a, b)  # noqa: E731
    ratios: dict[int, list[float]] = {}
    for i, (width, tokens) in enumerate(shapes()):
        torch.manual_seed(0)
        block, x = TinyBlock(width), torch.randn(tokens, width)
        probe = lambda block=block, x=x: block(x).backward()  # noqa: E731
        probe(), reference()
        calls = [max(1, round(window / _timed(f, 1))) for f in (probe, reference)]
        for _ in range(reps):
            barrier.wait()
            before = _timed(reference, calls[1])
            barrier.wait()
            seconds = _timed(probe, calls[0])
            barrier.wait()
            after = _timed(reference, calls[1])
            ratios.setdefault(i, []).append(seconds / ((before + after) / 2))
    queue.put({i: statistics.median(v) for i, v in ratios.items()})


def measure(processes: int, reps: int, window: float) -> dict[int, float]:
    """{shape index: the slowest process's probe / reference ratio} with ``processes`` running at once.
    Each process agrees on its own call counts, so windows line up only roughly: the barrier starts them."""
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(processes), ctx.Queue()
    workers = [ctx.Process(target=_rank, args=(barrier, queue, reps, window)) for _ in range(processes)]
    for w in workers:
        w.start()
    results = [queue.get(timeout=3600) for _ in workers]
    for w in workers:
        w.join()
    return {i: max(r[i] for r in results) for i in results[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cluster", required=True, help="a profiled cluster JSON (`autopar profile --out ...`)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--window", type=float, default=0.3, help="seconds per timed window")
    args = parser.parse_args()
    from autopar.hardware.cluster import Cluster
    from autopar.profiling.probe_step import ProbeShape, end_to_end_factor

    with open(args.cluster) as f:
        cluster = Cluster.from_json(f.read())
    flops = 2.0 * REFERENCE_SIDE**3
    # the reference at the curve as scaled (the profile uses its square curve): s compares across shapes only
    reference_s = flops / cluster.matmul_flops("float32", flops)
    print(f"# probe_shape_scale: cluster {args.cluster}; load average {os.getloadavg()}")
    for processes in (2, 1):
        ratios = measure(processes, args.reps, args.window)
        for i, (width, tokens) in enumerate(shapes()):
            shape = ProbeShape(width, tokens, "float32", REFERENCE_SIDE)
            scale = end_to_end_factor(cluster, ratios[i] * reference_s, reference_s, shape)
            print(f"processes {processes}  TinyBlock {width:4d} wide x {tokens:5d} tokens: "
                  f"step / reference {ratios[i]:8.1f}  s {scale:.3f}")
    print(f"# load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
