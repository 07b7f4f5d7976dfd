"""The profiler's probe step (item 4) read back-to-back, after a 4-layer model's step, and after GPT steps.

    python benchmarks/fidelity/probe_after_model.py [--seconds 45] [--nprocs 2]

Every rank (one thread, gloo, all at once) loops rounds for ``--seconds``; a round is one of four conditions
in turn: (back-to-back) a window of the probe step; (model) forward + backward of 4 stacked
``profiler_neighbour.TrainingBlock``s, then the window; (gpt) one untimed forward + backward of the fidelity
GPT at a data-parallel rank's batch, then the window; (gpts) the same for 6 distinct GPTs (the benchmark's
rounds run a dozen plans' models between two probe windows); each window followed by a window of the
reference mm. Printed on rank 0: the median ratio
probe / mean of the references around it, per condition (the first 3 s left out as warm-up), over the
condition "back-to-back"; and the back-to-back ratio per 3 s of the run (does a sustained run drift?).
The profile reads the probe back-to-back; the fidelity benchmark reads it after its plans' steps: where the
"gpt" / "gpts" columns exceed back-to-back, the state a step leaves slows the probe (a profile would then time
its probe after a model's step, as the "model" column does).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

CONDITIONS = ("back-to-back", "model", "gpt", "gpts")
MODEL_LAYERS = 4  # "model": forward + backward of this many profiler_neighbour.TrainingBlocks
OTHER_MODELS = 6  # "gpts": steps of this many distinct GPTs before the window, as the benchmark's rounds
WARMUP_S, BIN_S, WINDOW_S = 3.0, 3.0, 0.1


def _window(call, calls: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def _calls(call) -> int:
    import torch
    import torch.distributed as dist

    call()
    start = time.perf_counter()
    call()
    n = torch.tensor([max(1, int(WINDOW_S / (time.perf_counter() - start)))])
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    return int(n)


def _rank(rank: int, world: int, port: int, seconds: float) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from autopar.profiling.probe_step import PROBE_TOKENS, PROBE_WIDTH, TinyBlock
    from autopar.profiling.profiler_neighbour import NEIGHBOUR_SHAPE, TrainingBlock
    from benchmarks.fidelity.fidelity_plans import BATCH, CONFIG
    from examples.gpt import GPT, make_batch

    block, x = TinyBlock(PROBE_WIDTH), torch.randn(PROBE_TOKENS, PROBE_WIDTH)
    a, b, out = (torch.randn(256, 256) for _ in range(3))
    probe, reference = (lambda: block(x).backward()), (lambda: torch.mm(a, b, out=out))
    gpt, (ids, targets) = GPT(CONFIG), make_batch(CONFIG, BATCH // world)
    layers, h = [TrainingBlock(NEIGHBOUR_SHAPE[2]) for _ in range(MODEL_LAYERS)], torch.randn(NEIGHBOUR_SHAPE)

    def model_step() -> None:
        x = h
        for layer in layers:
            x = _residual(layer, x)
        x.sum().backward()
    others = [GPT(CONFIG) for _ in range(OTHER_MODELS)]
    before = {"back-to-back": lambda: None, "model": model_step, "gpt": lambda: gpt(ids, targets).backward(),
              "gpts": lambda: [m(ids, targets).backward() for m in others]}
    n_probe, n_reference = _calls(probe), _calls(reference)
    rows, start = [], time.perf_counter()
    ref_before = _window(reference, n_reference)
    while time.perf_counter() - start < seconds:
        condition = CONDITIONS[len(rows) % len(CONDITIONS)]
        before[condition]()
        t = _window(probe, n_probe)
        ref_after = _window(reference, n_reference)
        rows.append((time.perf_counter() - start, condition, t / ((ref_before + ref_after) / 2)))
        ref_before = ref_after
    if rank == 0:
        _report(rows, seconds)
    dist.destroy_process_group()


def _residual(block, x):
    """``TrainingBlock``'s output before its ``.sum()``: the residual stream, so blocks stack into a model."""
    import torch.nn.functional as F

    q, k, v = block.qkv(block.ln1(x)).chunk(3, dim=-1)
    x = x + block.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))
    return x + block.down(F.gelu(block.up(block.ln2(x))))


def _report(rows, seconds: float) -> None:
    late = [r for r in rows if r[0] >= WARMUP_S]
    base = statistics.median(r[2] for r in late if r[1] == "back-to-back")
    for condition in CONDITIONS:
        ratios = [r[2] for r in late if r[1] == condition]
        print(f"{condition:13s} probe / reference {statistics.median(ratios):6.2f}  "
              f"x {statistics.median(ratios) / base:.3f} of back-to-back  ({len(ratios)} windows)")
    curve = []
    for lo in range(0, int(seconds), int(BIN_S)):
        ratios = [r[2] for r in rows if r[1] == "back-to-back" and lo <= r[0] < lo + BIN_S]
        if ratios:
            curve.append(f"{lo}-{lo + int(BIN_S)} s {statistics.median(ratios):.1f}")
    print("back-to-back ratio over the run: " + ", ".join(curve))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=45.0)
    parser.add_argument("--nprocs", type=int, default=2)
    args = parser.parse_args(argv)
    if args.seconds <= WARMUP_S + BIN_S or args.nprocs < 1:
        parser.error(f"--seconds must exceed {WARMUP_S + BIN_S:.0f} and --nprocs be at least 1")
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"# probe_after_model, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.nprocs} ranks, "
          f"{args.seconds:.0f} s, load average {os.getloadavg()}", flush=True)
    mp.spawn(_rank, args=(args.nprocs, port, args.seconds), nprocs=args.nprocs)
    print(f"# load average after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
