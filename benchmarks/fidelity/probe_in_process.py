"""The profiler's probe step inside the fidelity benchmark's own process, against the same probe in a fresh one.

    python benchmarks/fidelity/probe_in_process.py --cluster profile.json [--rounds 8]

Two ``autopar.launch``es of the cluster's ranks (2: as the profile and the benchmark run) take turns, round
by round, through keys in a store this process holds (``Turns``): only one launch computes at a time, and
round k of each sees the same machine, so other jobs' load moves both sides of each pair alike. "fresh" only
times the probe, as ``autopar profile``'s processes do; "benchmark" times it in the states the fidelity
benchmark's own process passes through, one condition after another: before anything is built (bare); with
13 plain GPTs stepped once with AdamW (plain heap: the heap a training process grows, nothing of autopar's;
freed afterwards); with every plan of ``fidelity_plans`` compiled, stepped twice and its peak memory read
through torch.profiler (built); each round right after one step of every plan (stepped: the benchmark's own
rounds); with the faults heartbeat stopped (no heartbeat); with every plan freed (freed). A round is a
reference window, a probe window (``cost_model_fidelity._probe_step``'s call: forward + backward of
``TinyBlock`` at the CPU probe shape, every rank at once) and a reference window (fp32 mm 256³); its ratio
is probe / mean of the two references, the figure whose drift between the profile and the benchmark is in
question ("probe step over the reference mm").

Printed per condition: the benchmark's ratio over the fresh launch's in the rounds just before and after
(median over pairs and ranks), by the clock and by the main thread's CPU time (``time.thread_time``: the
clock above it means the thread was off the core), and beside it the probe's seconds, its page faults per
call, the CPU other threads of the process used during the probe windows by thread name (heartbeat: a Python
thread, "python"; gloo: "gloo_tcp_loop", "pt_gloo_runloop"), the threads alive, and torch's intra-op and
inter-op thread counts.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import autopar  # noqa: E402
from autopar.profiling.fidelity import peak_allocated_bytes  # noqa: E402
from autopar.profiling.probe_step import REFERENCE_SIDE, TinyBlock, probe_shape  # noqa: E402
from autopar.runtime import faults  # noqa: E402
from benchmarks.fidelity.fidelity_plans import BATCH, CONFIG, make_plans  # noqa: E402
from examples.gpt import make_gpt  # noqa: E402

PROBE_WINDOW_S, REFERENCE_WINDOW_S = 0.15, 0.1  # as cost_model_fidelity times them
_TICK = os.sysconf("SC_CLK_TCK")


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """{tid: (name, CPU seconds)} of every thread of this process (/proc; clock-tick resolution)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            fields = stat.rsplit(")", 1)[1].split()
            out[int(tid)] = (stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / _TICK)
        except OSError:  # the thread ended
            pass
    return out


def _involuntary_switches() -> int:
    with open(f"/proc/self/task/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("nonvoluntary_ctxt_switches"))


def _calls(call, window_s: float) -> int:
    """Calls per window, the slowest rank's (every rank runs the same number)."""
    call()
    start = time.perf_counter()
    call()
    n = torch.tensor([max(1.0, window_s / (time.perf_counter() - start))])
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    return int(n)


def _window(call, calls: int) -> tuple[float, float, float]:
    """(wall seconds, main-thread CPU seconds, main-thread minor page faults) per call over one window, every
    rank starting together."""
    dist.barrier()
    faults_before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        call()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    return wall / calls, cpu / calls, (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults_before) / calls


class Prober:
    """The probe step and the reference mm of ``cost_model_fidelity``, timed in rounds that take turns with the
    other launch (``Turns``): a round is a reference window, a probe window and a reference window."""

    def __init__(self, turns: "Turns"):
        shape = probe_shape("cpu")
        block, x = TinyBlock(shape.width), torch.randn(shape.tokens, shape.width)
        a, b, out = (torch.randn(REFERENCE_SIDE, REFERENCE_SIDE) for _ in range(3))
        self.probe, self.reference = (lambda: block(x).backward()), (lambda: torch.mm(a, b, out=out))
        self.n_probe = _calls(self.probe, PROBE_WINDOW_S)
        self.n_reference = _calls(self.reference, REFERENCE_WINDOW_S)
        self.turns, self.rows = turns, []

    def round(self, condition: str) -> bool:
        """One round in this launch's turn; its row: (condition, wall ratio, CPU ratio, probe wall, probe CPU,
        page faults per probe call, ({other thread's name: CPU seconds in the probe window}, the window's
        seconds), threads alive)."""
        if not self.turns.wait():
            return False
        before = _window(self.reference, self.n_reference)
        probe_threads, probe_start = _thread_cpu(), time.perf_counter()
        wall, cpu, minflt = _window(self.probe, self.n_probe)
        elapsed, after_threads = time.perf_counter() - probe_start, _thread_cpu()
        after = _window(self.reference, self.n_reference)
        self.turns.done()
        main = os.getpid()
        others = {}
        for tid, (name, seconds) in after_threads.items():
            used = seconds - probe_threads.get(tid, (name, 0.0))[1]
            if tid != main and used > 0:
                others[name] = others.get(name, 0.0) + used
        self.rows.append((condition, wall / ((before[0] + after[0]) / 2), cpu / ((before[1] + after[1]) / 2),
                          wall, cpu, minflt, (others, elapsed), len(os.listdir("/proc/self/task"))))
        return True


class Turns:
    """Rounds of the two launches alternate through keys in the parent's TCPStore: the benchmark's round k runs
    once the fresh launch's round k-1 is done, the fresh launch's round k once the benchmark's k is done, so
    only one launch computes at a time and both see the same machine, round by round."""

    def __init__(self, port: int, role: str):
        self.store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=900))
        self.role, self.k = role, 0

    def wait(self) -> bool:
        """Block until this launch's round k is due; False when the benchmark launch has ended the turns."""
        key = f"fresh/{self.k - 1}" if self.role == "benchmark" else f"benchmark/{self.k}"
        if self.role == "fresh" or self.k > 0:
            self.store.wait([key])
        dist.barrier()
        return self.store.get(key) != b"end" if self.role == "fresh" else True

    def end(self) -> None:
        """(benchmark launch, after its last round) let the fresh launch finish its last round, then stop it."""
        dist.barrier()
        if dist.get_rank() == 0:
            self.store.wait([f"fresh/{self.k - 1}"])
            self.store.set(f"benchmark/{self.k}", "end")

    def done(self) -> None:
        dist.barrier()
        if dist.get_rank() == 0:
            self.store.set(f"{self.role}/{self.k}", "1")
        self.k += 1


def _fresh_rank(rank: int, port: int) -> list:
    turns = Turns(port, "fresh")
    prober = Prober(turns)
    while prober.round("fresh"):
        pass
    return prober.rows


def _plain_models_stepped(count: int, batch) -> list:
    """``count`` fidelity GPTs (plain torch, no autopar, no process group), each stepped once with AdamW at a
    data-parallel rank's batch: a heap grown and freed as a training process grows it, with nothing else."""
    from examples.gpt import GPT

    kept = []
    for _ in range(count):
        gpt = GPT(CONFIG)
        opt = torch.optim.AdamW(gpt.parameters(), lr=1e-4)
        gpt(*(t[:BATCH // dist.get_world_size()] for t in batch)).backward()
        opt.step()
        kept.append((gpt, opt))
    return kept


def _benchmark_rank(rank: int, plans: list[tuple[str, str]], n: int, port: int) -> list:
    turns = Turns(port, "benchmark")
    prober = Prober(turns)
    torch_threads = (torch.get_num_threads(), torch.get_num_interop_threads())
    for _ in range(n):
        prober.round("bare")
    model, batch = make_gpt(CONFIG, batch_size=BATCH)
    heap = _plain_models_stepped(len(plans), batch)  # the heap a training process grows, without autopar
    for _ in range(n):
        prober.round("plain heap")
    del heap
    gc.collect()
    built = []
    for _, text in plans:
        plan = autopar.Plan.from_json(text)
        pm = autopar.compile(model, autopar.Cluster.from_dict(plan.cluster), batch, plan=plan, compile=False)
        built.append((pm, pm.optimizer(torch.optim.AdamW, lr=1e-4)))

    def step_all() -> None:
        for pm, opt in built:
            dist.barrier()
            pm.train_step(*batch)
            opt.step()
            opt.zero_grad(set_to_none=True)
        dist.barrier()
    step_all()
    for pm, opt in built:  # as the benchmark reads each plan's peak memory (torch.profiler, profile_memory=True)
        peak_allocated_bytes(lambda: (pm.train_step(*batch), opt.step(), opt.zero_grad(set_to_none=True)))
    step_all()
    for _ in range(n):
        prober.round("built")
    for _ in range(max(2, n // 2)):
        step_all()
        prober.round("stepped")
    faults.unregister()
    time.sleep(2 * faults.HEARTBEAT_S)  # the heartbeat thread sees the stop and ends
    for _ in range(n):
        prober.round("no heartbeat")
    built.clear()
    gc.collect()
    for _ in range(n):
        prober.round("freed")
    turns.end()
    return {"rows": prober.rows, "torch_threads": torch_threads, "after": (torch.get_num_threads(),
                                                                            torch.get_num_interop_threads())}


def _others(rows) -> str:
    """The CPU other threads used during the probe windows of ``rows``, as a share of a core, by thread name."""
    used, seconds = {}, sum(r[6][1] for r in rows)
    for r in rows:
        for name, cpu in r[6][0].items():
            used[name] = used.get(name, 0.0) + cpu
    top = sorted(used.items(), key=lambda item: -item[1])[:3]
    return f"{sum(used.values()) / seconds * 100:.1f} % of a core (" + (
        ", ".join(f"{name} {cpu / seconds * 100:.1f} %" for name, cpu in top) or "none") + ")"


def paired_ratios(bench: list[list], fresh: list[list], condition: str, column: int) -> list[float]:
    """Per rank and benchmark round k of ``condition``: its ``column`` over the mean of the fresh launch's
    rounds k-1 and k on the same rank (the rounds run just before and just after it)."""
    out = []
    for b_rows, f_rows in zip(bench, fresh):
        for k, row in enumerate(b_rows):
            around = [f_rows[j][column] for j in (k - 1, k) if 0 <= j < len(f_rows)]
            if row[0] == condition and around:
                out.append(row[column] / statistics.mean(around))
    return out


def _report(bench: list[dict], fresh: list[list]) -> None:
    """Per condition: the benchmark's ratios over the fresh launch's in the rounds just before and after."""
    conditions = list(dict.fromkeys(row[0] for row in bench[0]["rows"]))
    print(f"# torch intra-op / inter-op threads in the benchmark launch: {bench[0]['torch_threads']} at start, "
          f"{bench[0]['after']} at the end (rank 0)")
    med = statistics.median
    for condition in conditions:
        rows = [row for b in bench for row in b["rows"] if row[0] == condition]
        pairs_wall, pairs_cpu = (paired_ratios([b["rows"] for b in bench], fresh, condition, column)
                                 for column in (1, 2))
        print(f"{condition:13s} probe/ref x {med(pairs_wall):.3f} of fresh (wall), x {med(pairs_cpu):.3f} (CPU); "
              f"benchmark probe/ref {med(r[1] for r in rows):5.2f}, probe {med(r[3] for r in rows) * 1e3:5.2f} ms "
              f"wall {med(r[4] for r in rows) * 1e3:5.2f} ms CPU, {max(r[5] for r in rows):4.1f} page faults/call, "
              f"other threads {_others(rows)}, {max(r[7] for r in rows)} threads; "
              f"{len(pairs_wall)} pairs", flush=True)
    after = {c: [f[k][1] for b, f in zip(bench, fresh) for k, row in enumerate(b["rows"]) if row[0] == c and k < len(f)]
             for c in conditions}
    print("fresh rounds by the benchmark round just before them (probe/ref; does what the machine just ran move a "
          "fresh process's probe too?): " + ", ".join(f"{c} {med(v):.2f}" for c, v in after.items() if v))
    f_all = [r for rows in fresh for r in rows]
    print(f"fresh         probe/ref {med(r[1] for r in f_all):5.2f}, probe {med(r[3] for r in f_all) * 1e3:5.2f} ms "
          f"wall {med(r[4] for r in f_all) * 1e3:5.2f} ms CPU, {max(r[5] for r in f_all):4.1f} page faults/call, "
          f"other threads {_others(f_all)}, "
          f"{max(r[7] for r in f_all)} threads; {len(f_all)} rounds")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", help="a profiled 2-rank cluster JSON (the plans are made on it)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds per condition")
    parser.add_argument("--json", help="also write every round of both launches here")
    parser.add_argument("--fresh", help=argparse.SUPPRESS)  # "PORT OUT": this process is the fresh launch
    args = parser.parse_args(argv)
    if args.fresh:
        port, out, world = args.fresh.split()
        rows = autopar.launch(_fresh_rank, int(world), int(port), timeout=900)
        with open(out, "w") as f:
            json.dump(rows, f)
        return 0
    if not args.cluster or args.rounds < 2:
        parser.error("--cluster is required and --rounds must be at least 2")
    cluster = autopar.Cluster.from_json(args.cluster)
    plans = [(name, p.to_json()) for name, p in make_plans(cluster).items()]
    world = cluster.num_devices
    print(f"# probe_in_process, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {world} ranks, "
          f"{len(plans)} plans; load average {tuple(round(x, 2) for x in os.getloadavg())}", flush=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "fresh.json")
        fresh = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--fresh", f"{store.port} {out} {world}"])
        try:
            bench = autopar.launch(_benchmark_rank, world, plans, args.rounds, store.port, timeout=900)
        except BaseException:
            fresh.kill()
            raise
        fresh.wait(timeout=900)
        with open(out) as f:
            fresh_rows = json.load(f)
    _report(bench, fresh_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": bench, "fresh": fresh_rows, "load_after": os.getloadavg()}, f)
    print(f"# load average after {tuple(round(x, 2) for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
