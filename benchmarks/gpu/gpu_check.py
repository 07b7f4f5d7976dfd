"""The GPU checklist (``../shared/GPU.md``) in one launch: what autopar does on one CUDA device.

    python benchmarks/gpu/gpu_check.py --out DIR                 # on a machine with one GPU
    python benchmarks/gpu/gpu_check.py --out DIR --device cpu --tiny   # a dry run of the same code here

Sections, each recorded even when an earlier one fails (results are rewritten to ``DIR/gpu_check.json`` and
``DIR/gpu_check.md`` after every section, so a run cut short still reports what it reached):

1. parity: the GPT example and a small Hugging Face Llama, compiled by autopar on one rank (NCCL, world 1;
   eager, and two cases with ``compile=True``),
   trained ``PARITY_STEPS`` AdamW steps beside the same model trained on the same device without autopar;
   the largest relative loss difference per step (fp32 with TF32 off; the bf16 policy against plain
   ``torch.autocast``). Negative control: the reference at 1.1x the learning rate must differ by more than
   the tolerance. Then two gloo ranks sharing the one GPU (NCCL refuses two ranks on one device): the
   planner's plan and context parallelism (the sequence split over the two ranks), each against one device.
2. profile: ``autopar profile --device cuda`` (one rank): the matmul curve's best rate per dtype, the achieved
   memory bandwidth and usable memory, beside a direct 8192^3 bf16 matmul timed with CUDA events.
3-5. plans: several one-GPU plans (GPT at three sizes, a Llama-style model; fp32 and bf16; recompute none and
   full) planned with the profiled cluster and compiled; per plan the predicted step time and peak memory
   against the measured median step (CUDA events, after warm-up) and ``max_memory_allocated`` /
   ``max_memory_reserved`` over one step; the same model's plain step (runtime overhead) and, for the case
   marked ``torch_compile``, autopar's module with ``compile=True``. Every other autopar module of this check is
   built with ``compile=False`` (the default "auto" compiles on CUDA), so the predicted-vs-measured rows stay
   the eager runtime's; ``gpu_speed.py`` compares eager and compiled speed.

A global deadline (``--budget`` seconds) skips the plans still to run once it has passed.
"""
from __future__ import annotations

import argparse
import copy
import gc
import importlib.metadata
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import autopar  # noqa: E402
from benchmarks.gpu.gpu_models import PLAN_CASES, model_for, to_device  # noqa: E402

PARITY_STEPS, LR = 5, 1e-3
# (model, precision, compile=): eager modules (the plans' sections measure them too), and two compiled ones
PARITY_CASES = [(m, p, False) for m in ("gpt", "llama") for p in ("fp32", "bf16")] + \
    [("gpt", "fp32", True), ("llama", "bf16", True)]
TOLERANCE = {"fp32": 1e-5, "bf16": 5e-3}  # bf16: autocast rounding in two differently ordered graphs
CONTROL_LR = 2.0  # the negative control's learning rate, as a multiple of LR


# ---- helpers ----------------------------------------------------------------------------------------
def _device_cluster(cluster_dict: dict, devices: int = 1, backend: str | None = None) -> autopar.Cluster:
    d = dict(cluster_dict, nodes=1, devices_per_node=devices, mesh_shape=(1, devices))
    if backend:
        d["backend"] = backend
    return autopar.Cluster.from_dict(d)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _timed_steps(step, device: str, warmup: int, steps: int) -> float:
    """Median seconds of ``step()`` after ``warmup`` untimed calls (CUDA events on GPUs)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _reference_losses(model, batch, precision: str, device: str, lr: float) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(PARITY_STEPS):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _autopar_losses(pm, batch) -> list[float]:
    """Losses of PARITY_STEPS AdamW steps (lr LR) of a compiled module on ``batch``."""
    opt = pm.optimizer(torch.optim.AdamW, lr=LR)
    losses = []
    for _ in range(PARITY_STEPS):
        losses.append(pm.train_step(*batch).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def _worst_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


# ---- section 1: parity (on rank 0 of a world-1 process group) -----------------------------------------
def parity_rank(rank: int, cluster_dict: dict, device: str, tiny: bool) -> list[dict]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    for name, precision, compiled in PARITY_CASES:
        rows.append(_parity_case(name, precision, cluster_dict, device, tiny, compiled))
        _free()
    return rows


def _parity_case(name: str, precision: str, cluster_dict: dict, device: str, tiny: bool, compiled: bool) -> dict:
    row = {"model": name, "precision": precision, "compiled": compiled}
    try:
        model, batch = model_for(name, tiny, parity=True)
        reference = copy.deepcopy(model).to(device)
        control = copy.deepcopy(model).to(device)
        batch = to_device(batch, device)
        pm = autopar.compile(model.to(device), _device_cluster(cluster_dict), batch, precision=precision,
                             recompute="none", compile=compiled)
        got = _autopar_losses(pm, batch)
        want = _reference_losses(reference, batch, precision, device, LR)
        off = _reference_losses(control, batch, precision, device, CONTROL_LR * LR)
        row.update(autopar=got, reference=want, worst_rel=_worst_rel(got, want),
                   control_worst_rel=_worst_rel(off, want), tolerance=TOLERANCE[precision])
        row["passed"] = row["worst_rel"] <= row["tolerance"] < row["control_worst_rel"]
    except Exception as e:  # recorded, and the next case runs
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        row["traceback"] = traceback.format_exc()[-3000:]
    return row


# Context parallelism on the GPT example's 2 ranks: tokens and every attention split over the sequence (the
# causal ring of ``runtime.context_parallel``), parameters replicated.
CONTEXT_PARALLEL_PINS = {"idx": "RS(1)", "scaled_dot_product_attention*": "RS(2)", "p_*": "RR"}  # mesh 1 x 2


def shared_gpu_rank(rank: int, cluster_dict: dict, device: str, tiny: bool) -> dict:
    """Two gloo ranks on one device (NCCL refuses two ranks on one GPU): the GPT example trained by the
    planner's data-parallel plan and by context parallelism, losses vs the same model on the device alone."""
    torch.backends.cuda.matmul.allow_tf32 = False
    out = {}
    for name, options in (("planned", {}), ("context_parallel", {"stages": 1, "pin": CONTEXT_PARALLEL_PINS})):
        model, batch = model_for("gpt", tiny, parity=True)
        reference = copy.deepcopy(model).to(device)
        batch = to_device(batch, device)
        pm = autopar.compile(model.to(device), _device_cluster(cluster_dict, 2, "gloo"), batch, recompute="none",
                             compile=False, **options)
        got = _autopar_losses(pm, batch)
        want = _reference_losses(reference, batch, "fp32", device, LR)
        row = {"plan": pm.plan.summary(max_rows=0)[:600], "autopar": got, "reference": want,
               "worst_rel": _worst_rel(got, want)}
        if name == "planned":
            out.update(row)
        else:
            out[name] = row
    return out


# ---- sections 3-5: plans, memory and step time ------------------------------------------------------
def plans_rank(rank: int, cluster_dict: dict, device: str, tiny: bool, deadline: float, out: str) -> list[dict]:
    rows = []
    for case in PLAN_CASES:
        if time.time() > deadline:
            rows.append({**case, "skipped": "deadline"})
            continue
        rows.append(_plan_case(case, cluster_dict, device, tiny))
        _free()
        with open(os.path.join(out, "plans_partial.json"), "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return rows


def _plan_case(case: dict, cluster_dict: dict, device: str, tiny: bool) -> dict:
    row = dict(case)
    warmup, steps = (1, 3) if tiny else (3, 10)
    try:
        model, batch = model_for(case["model"], tiny, parity=False)
        plain = copy.deepcopy(model) if case.get("plain") else None  # on the host until autopar's is freed
        batch = to_device(batch, device)
        t0 = time.perf_counter()
        pm = autopar.compile(model.to(device), _device_cluster(cluster_dict), batch, precision=case["precision"],
                             recompute=case["recompute"], compile=False)  # eager: what the cost model predicts
        row["compile_s"] = time.perf_counter() - t0
        row["predicted_step_s"] = float(pm.plan.predicted["step_time"])
        row["predicted_peak_bytes"] = float(pm.plan.predicted["peak_memory"])
        row["predicted"] = {k: float(v) for k, v in pm.plan.predicted.items()}
        row["microbatches"], row["stage_recompute"] = pm.plan.microbatches, dict(pm.plan.stages[0].recompute)
        opt = pm.optimizer(torch.optim.AdamW, lr=1e-5)

        def step():
            pm.train_step(*batch)
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        _sync(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        step()
        _sync(device)
        if device == "cuda":
            row["max_allocated"] = torch.cuda.max_memory_allocated()
            row["max_reserved"] = torch.cuda.max_memory_reserved()
        row["measured_step_s"] = _timed_steps(step, device, warmup, steps)
        if plain is not None:
            del pm, opt
            _free()
            row["plain_step_s"] = _plain_step(plain.to(device), batch, case["precision"], device, warmup, steps)
        if case.get("torch_compile"):
            row.update(_compiled_step(case, cluster_dict, device, tiny, warmup, steps))
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        row["traceback"] = traceback.format_exc()[-3000:]
    return row


def _plain_step(model, batch, precision: str, device: str, warmup: int, steps: int) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    dtype = {"bf16": torch.bfloat16}.get(precision)

    def step():
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _timed_steps(step, device, warmup, steps)


def _compiled_step(case: dict, cluster_dict: dict, device: str, tiny: bool, warmup: int, steps: int) -> dict:
    """autopar's module with compile=True (every generated module under torch.compile: ``runtime.compiled``)."""
    try:
        model, batch = model_for(case["model"], tiny, parity=False)
        batch = to_device(batch, device)
        pm = autopar.compile(model.to(device), _device_cluster(cluster_dict), batch, precision=case["precision"],
                             recompute=case["recompute"], compile=True)
        opt = pm.optimizer(torch.optim.AdamW, lr=1e-5)

        def step():
            pm.train_step(*batch)
            opt.step()
            opt.zero_grad(set_to_none=True)

        t0 = time.perf_counter()
        step()
        _sync(device)
        return {"compile_first_step_s": time.perf_counter() - t0,
                "torch_compile_step_s": _timed_steps(step, device, warmup, steps)}
    except Exception as e:
        return {"torch_compile_error": f"{type(e).__name__}: {e}"[:1500]}


# ---- section 2: the profiler ------------------------------------------------------------------------
def profile_section(device: str, tiny: bool, out: str) -> dict:
    path = os.path.join(out, "cluster.json")
    t0 = time.perf_counter()
    cluster = autopar.Cluster.profile(nprocs=1, out=path, device=device, quick=tiny, progress=False)
    row = {"profile_s": time.perf_counter() - t0, "memory_bandwidth": cluster.memory_bandwidth,
           "memory_per_device": cluster.memory_per_device, "memory_capacity": cluster.memory_capacity,
           "op_overhead": cluster.op_overhead, "compute_time_scale": cluster.compute_time_scale,
           "best_matmul": {d: max(r for _, r in pts) for d, pts in cluster.matmul_curve.items()},
           "matmul_curve": cluster.matmul_curve, "peak_flops": cluster.peak_flops}
    if device == "cuda":
        row["direct_bf16_8192"] = _direct_matmul(8192, torch.bfloat16)
        row["direct_fp32_4096"] = _direct_matmul(4096, torch.float32)
        row["gpu"] = torch.cuda.get_device_name(0)
    row["cluster"] = cluster.to_dict()
    return row


def _direct_matmul(side: int, dtype) -> float:
    a, b = (torch.randn(side, side, device="cuda", dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    end.synchronize()
    return 2 * side**3 * 10 / (start.elapsed_time(end) / 1e3)


# ---- driver -----------------------------------------------------------------------------------------
def environment() -> dict:
    env = {"torch": torch.__version__, "python": sys.version.split()[0], "cuda": torch.cuda.is_available()}
    for name in ("pulp", "highspy", "transformers", "networkx"):
        try:
            env[name] = importlib.metadata.version(name)
        except Exception as e:
            env[name] = f"missing: {e}"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", memory=p.total_memory, sms=p.multi_processor_count)
    return env


def _save(out: str, results: dict) -> None:
    from benchmarks.gpu.gpu_report import markdown

    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    try:
        text = markdown(results)
    except Exception:  # a report bug must not stop the measurements: the JSON has everything
        text = "report failed:\n" + traceback.format_exc()
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
        f.write(text)


def _section(results: dict, out: str, name: str, fn, *args):
    t0 = time.perf_counter()
    try:
        value = fn(*args)
    except Exception as e:
        value = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-3000:]}
    results[name] = value
    results.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
    _save(out, results)
    print(f"## {name} done in {results['seconds'][name]} s", flush=True)
    return value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small models and a quick profile (a dry run)")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds after which remaining plans are skipped")
    args = ap.parse_args(argv)
    start = time.time()
    os.makedirs(args.out, exist_ok=True)
    backend = "nccl" if args.device == "cuda" else "gloo"
    results = {"environment": environment()}
    _save(args.out, results)
    profiled = _section(results, args.out, "profile", profile_section, args.device, args.tiny, args.out)
    fallback = autopar.Cluster.preset("dgx-h100", nodes=1) if args.device == "cuda" else autopar.Cluster.local(1)
    cluster_dict = profiled.get("cluster") or fallback.to_dict()
    if args.device == "cpu":
        cluster_dict = dict(cluster_dict, device_type="cpu", backend="gloo")
    _section(results, args.out, "parity", lambda: autopar.launch(parity_rank, 1, cluster_dict, args.device,
                                                                 args.tiny, backend=backend, timeout=120)[0])
    _section(results, args.out, "shared_gpu", lambda: autopar.launch(shared_gpu_rank, 2, cluster_dict,
                                                                     args.device, args.tiny, backend="gloo",
                                                                     timeout=120)[0])
    deadline = start + args.budget
    _section(results, args.out, "plans", lambda: autopar.launch(plans_rank, 1, cluster_dict, args.device,
                                                                args.tiny, deadline, args.out, backend=backend,
                                                                timeout=300)[0])
    _save(args.out, results)
    print(open(os.path.join(args.out, "gpu_check.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
