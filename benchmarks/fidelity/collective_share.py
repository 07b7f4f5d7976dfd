"""The collectives' share of a training step, measured inside the step, against what the cost model prices.

    python benchmarks/fidelity/collective_share.py --cluster cluster.json [--plans dp tp rep] [--steps 6]

Invariant: per plan, in_step = Σ over the step's collective calls of (wall seconds inside the call, plus, for
async calls, inside their ``wait``), on the slowest rank (it includes waiting for a rank still computing);
``last`` the same on the rank that waits least (the collectives' own time, near enough); priced = the plan's
``comm`` (forward and backward redistributions) - ``grad_sync`` + ``grad_sync_exposed``. ``alone`` re-times
the same calls (same tensors, groups, order) between steps with nothing else running, as the profile times
collectives: last / alone is what running inside a step adds to a collective on this machine (the other
rank's compute on the shared cores, cold buffers), alone / priced the profile's fit against the same calls.
Ratios are read under any load; seconds only on an idle machine. In process CPU seconds (gloo's threads and
the kernel's loopback copies included; other jobs' time slices not): the step's, the same step's with the
collectives replaced by local copies (``cost_model_fidelity --split``), their difference (the collectives'
CPU inside the step) and the replay's CPU (theirs alone); ``pr comp`` is the compute (recompute's replay
included) and optimizer the cost model prices for the plan, to set beside the compute-only CPU.
``cold / alone``: the replay again with a 64 MiB buffer overwritten before each call (the calls' tensors
out of cache, as after the compute that wrote them): what cold buffers alone add to a collective, against
what ``last / alone`` shows in the step.

The calls are timed by wrapping torch.distributed's functions and the runtime's module-level references to
them (as ``cost_model_fidelity --split`` replaces them), on every rank at once, in one ``autopar.launch``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import autopar  # noqa: E402
from benchmarks.fidelity.cost_model_fidelity import _local_collectives, _step  # noqa: E402
from benchmarks.fidelity.fidelity_plans import BATCH, CONFIG, make_plans, priced_compute  # noqa: E402
from examples.gpt import make_gpt  # noqa: E402

NAMES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "all_gather_single",
         "reduce_scatter_single", "send", "recv", "isend", "irecv")


class _Recorder:
    """Wraps collectives: wall seconds inside each call (and its ``wait``), and the calls' arguments for replay."""

    def __init__(self):
        self.seconds, self.calls = 0.0, []

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            work = fn(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            self.calls.append((fn, args, dict(kwargs)))
            if work is not None and hasattr(work, "wait"):
                return _TimedWork(work, self)
            return work
        return timed


class _TimedWork:
    def __init__(self, work, recorder: _Recorder):
        self._work, self._recorder = work, recorder

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._recorder.seconds += time.perf_counter() - start

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def recording(recorder: _Recorder):
    from autopar.runtime import gradsync, zero3

    patches = [(dist, k) for k in NAMES if hasattr(dist, k)]
    patches += [(m, k) for m, k in ((gradsync, "_REDUCE_SCATTER"), (gradsync, "_ALL_GATHER"), (zero3, "_ALL_GATHER"))
                if hasattr(m, k)]
    saved = [(m, k, getattr(m, k)) for m, k in patches]
    try:
        for m, k, f in saved:
            setattr(m, k, recorder.wrap(f))
        yield
    finally:
        for m, k, f in saved:
            setattr(m, k, f)


EVICT_BYTES = 64 * 2 ** 20  # larger than this machine's caches: writing it pushes the step's buffers out


def replay_alone(calls, evict: torch.Tensor | None = None) -> tuple[float, float]:
    """(wall, process CPU) seconds of the recorded calls again, one after another, nothing else running (async
    ones waited at once). With ``evict``, that buffer is overwritten before each call (outside the timing), so
    each call finds its tensors out of cache, as after the compute that wrote them."""
    dist.barrier()
    wall = cpu = 0.0
    with torch.no_grad():  # outputs recorded inside autograd (views made under no_grad) may be written again
        for fn, args, kwargs in calls:
            if evict is not None:
                evict.add_(1.0)
                dist.barrier()  # both ranks start the call together: no wait for the other's eviction is timed
            start, cpu_start = time.perf_counter(), time.process_time()
            work = fn(*args, **kwargs)
            if work is not None and hasattr(work, "wait"):
                work.wait()
            wall, cpu = wall + time.perf_counter() - start, cpu + time.process_time() - cpu_start
    return wall, cpu


def _compute_only_cpu(pm, opt, batch) -> float:
    """Process CPU seconds of one step with the collectives replaced by local copies (its computation alone)."""
    dist.barrier()
    cpu = time.process_time()
    with _local_collectives():
        _step(pm, opt, batch)
    return time.process_time() - cpu


def _over_ranks(x: float, op) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t)


def _measure_rank(rank: int, plans: list[tuple[str, str]], warmup: int, steps: int) -> dict:
    model, batch = make_gpt(CONFIG, batch_size=BATCH)
    evict = torch.zeros(EVICT_BYTES // 4)
    out = {}
    for name, text in plans:
        plan = autopar.Plan.from_json(text)
        if len(plan.stages) != 1:
            continue  # sends between stages wait on the other stage's compute: not a collective's own time
        pm = autopar.compile(model, autopar.Cluster.from_dict(plan.cluster), batch, plan=plan, compile=False)
        opt = pm.optimizer(torch.optim.AdamW, lr=1e-4)
        rows = {k: [] for k in ("step", "cpu", "in_step", "in_step_last", "alone", "alone_cpu", "compute_cpu",
                                "cold")}
        for i in range(warmup + steps):
            recorder = _Recorder()
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            with recording(recorder):
                _step(pm, opt, batch)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            dist.barrier()
            alone, alone_cpu = replay_alone(recorder.calls)
            cold = replay_alone(recorder.calls, evict)[0]
            compute_cpu = _compute_only_cpu(pm, opt, batch)
            if i >= warmup:
                for key, value in (("step", wall), ("cpu", cpu), ("in_step", recorder.seconds), ("alone", alone),
                                   ("alone_cpu", alone_cpu), ("compute_cpu", compute_cpu), ("cold", cold)):
                    rows[key].append(_over_ranks(value, dist.ReduceOp.MAX))
                rows["in_step_last"].append(_over_ranks(recorder.seconds, dist.ReduceOp.MIN))
        out[name] = {k: statistics.median(v) for k, v in rows.items()}
    return out


def ratio(a: float, b: float) -> str:
    return f"{a / b:8.2f}" if b > 0 else f"{'-':>8}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", required=True, help="a profiled cluster JSON (`autopar profile --nprocs 2`)")
    parser.add_argument("--plans", nargs="+", default=["rep", "dp", "tp", "dp-z2", "tp-rc"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    cluster = autopar.Cluster.from_json(args.cluster)
    plans = make_plans(cluster, args.plans)
    load = os.getloadavg()
    measured = autopar.launch(_measure_rank, cluster.num_devices, [(n, p.to_json()) for n, p in plans.items()],
                              args.warmup, args.steps, timeout=900)[0]
    print(f"# collectives in the step vs priced; cluster {args.cluster}; load average {load} -> {os.getloadavg()}")
    print(f"{'plan':8} {'step ms':>8} {'cpu ms':>8} {'in-step':>8} {'last':>8} {'alone':>8} {'priced':>8} "
          f"{'last/alone':>10} {'alone/pr':>8} {'in/pr':>8} {'comp cpu':>8} {'pr comp':>8} {'comm cpu':>8} "
          f"{'alone cpu':>9} {'cold/alone':>10}")
    for name, m in measured.items():
        p = plans[name].predicted
        priced = float(p["comm"] - p["grad_sync"] + p["grad_sync_exposed"])
        print(f"{name:8} {m['step'] * 1e3:8.1f} {m['cpu'] * 1e3:8.1f} {m['in_step'] * 1e3:8.1f} "
              f"{m['in_step_last'] * 1e3:8.1f} {m['alone'] * 1e3:8.1f} {priced * 1e3:8.1f} "
              f"{ratio(m['in_step_last'], m['alone']):>10} "
              f"{ratio(m['alone'], priced)} {ratio(m['in_step'], priced)} {m['compute_cpu'] * 1e3:8.1f} "
              f"{(priced_compute(plans[name]) + float(p['optimizer'])) * 1e3:8.1f} "
              f"{(m['cpu'] - m['compute_cpu']) * 1e3:8.1f} {m['alone_cpu'] * 1e3:9.1f} "
              f"{ratio(m['cold'], m['alone']):>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
