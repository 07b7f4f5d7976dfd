"""Speed on one GPU: autopar's module eager and compiled against the plain model eager and under torch.compile.

    python benchmarks/gpu/gpu_speed.py --out DIR [--cluster cluster.json] [--models llama-1b gpt-l]
    python benchmarks/gpu/gpu_speed.py --out DIR --device cpu --tiny      # a dry run of the same code here

Per model (``gpu_models``: a ~1B Llama and the GPT example at GPU sizes, bf16 autocast over fp32 weights,
AdamW): four runners from the same weights, one after another (each freed before the next):
  * autopar, compile=False and compile=True (``autopar.compile`` on one rank, NCCL world 1);
  * the plain model, eager and ``torch.compile(model)``, under ``torch.autocast(bfloat16)``.
Per runner: the first step's seconds (compilation), the median step (train step + AdamW step + zero_grad,
CUDA events) after warm-up, tokens/s, and MFU = model FLOPs per step (``runtime.throughput.model_flops``:
flop_counter on the captured graph) / step time / the GPU's datasheet peak for bf16 (``DATASHEET_PEAK``:
989 TFLOP/s dense for an H100 or H200 SXM; the convention of the published ~40 % single-H100 figures).
autopar's own ``pm.step_stats()`` of the compiled runner is recorded beside them (its MFU is against the
cluster file's peak, the profiled curve's best rate). Also a compiled parity check: the GPT example at
parity size, fp32 with TF32 off, compile=True against the same model on the same device (5 AdamW steps).
Results: DIR/gpu_speed.json and DIR/gpu_speed.md, rewritten after every runner.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import autopar  # noqa: E402
from benchmarks.gpu.gpu_models import model_for, to_device  # noqa: E402

DATASHEET_PEAK = {"H100": 989e12, "H200": 989e12}  # bf16 dense FLOP/s, SXM
RUNNERS = ("autopar eager", "autopar compiled", "plain eager", "plain compiled")


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _timed(step, device: str, warmup: int, steps: int) -> tuple[float, float]:
    """(seconds of the first call, median seconds of ``steps`` calls after ``warmup`` more)."""
    from benchmarks.gpu.gpu_check import _sync, _timed_steps

    t0 = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - t0, _timed_steps(step, device, warmup, steps)


def _autopar_step(model, batch, cluster, precision: str, compiled: bool):
    pm = autopar.compile(model, cluster, batch, precision=precision, recompute="none", compile=compiled)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-5)

    def step():
        pm.train_step(*batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return pm, step


def _plain_step(model, batch, device: str, compiled: bool):
    run = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = run(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def speed_case(name: str, cluster: autopar.Cluster, device: str, tiny: bool, peak: float, save) -> dict:
    from autopar.passes.capture import capture
    from autopar.runtime.throughput import model_flops

    warmup, steps = (1, 3) if tiny else (3, 10)
    model, batch = model_for(name, tiny, parity=False)
    row = {"model": name, "tokens_per_step": batch[0].numel(), "params": sum(p.numel() for p in model.parameters())}
    row["model_flops"] = model_flops(capture(model, batch), 1)
    batch = to_device(batch, device)
    for runner in RUNNERS:
        try:
            copy_ = copy.deepcopy(model).to(device)
            if runner.startswith("autopar"):
                pm, step = _autopar_step(copy_, batch, cluster, "bf16", runner.endswith("compiled"))
            else:
                pm, step = None, _plain_step(copy_, batch, device, runner.endswith("compiled"))
            first, median = _timed(step, device, warmup, steps)
            row[runner] = {"first_step_s": first, "step_s": median, "tokens_per_s": row["tokens_per_step"] / median,
                           "mfu": row["model_flops"] / median / peak}
            if pm is not None:
                row[runner]["step_stats"] = pm.step_stats(warmup=1 + warmup)
                row[runner]["plan"] = pm.plan.summary(max_rows=0)[:300]
            del pm, step, copy_
        except Exception as e:  # recorded; the next runner runs
            row[runner] = {"error": f"{type(e).__name__}: {e}"[:1500], "traceback": traceback.format_exc()[-2500:]}
        _free()
        save()
    return row


def compiled_parity(cluster: autopar.Cluster, device: str, tiny: bool) -> dict:
    from benchmarks.gpu.gpu_check import LR, TOLERANCE, _autopar_losses, _reference_losses, _worst_rel

    torch.backends.cuda.matmul.allow_tf32 = False
    model, batch = model_for("gpt", tiny, parity=True)
    reference = copy.deepcopy(model).to(device)
    batch = to_device(batch, device)
    pm = autopar.compile(model.to(device), cluster, batch, recompute="none", compile=True)
    got = _autopar_losses(pm, batch)
    want = _reference_losses(reference, batch, "fp32", device, LR)
    from autopar.runtime.compiled import compile_failures

    torch.backends.cuda.matmul.allow_tf32 = True
    return {"autopar": got, "reference": want, "worst_rel": _worst_rel(got, want), "tolerance": TOLERANCE["fp32"],
            "compile_failures": compile_failures(pm.runner)}


def speed_rank(rank: int, cluster_dict: dict, device: str, tiny: bool, models: list[str], out: str) -> dict:
    cluster = autopar.Cluster.from_dict(dict(cluster_dict, nodes=1, devices_per_node=1, mesh_shape=(1, 1)))
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    peak = next((v for k, v in DATASHEET_PEAK.items() if k in gpu), cluster.peak_flops.get("bfloat16", 1e12))
    results = {"gpu": gpu, "datasheet_peak": peak, "torch": torch.__version__, "cases": []}

    def save():
        with open(os.path.join(out, "gpu_speed.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        with open(os.path.join(out, "gpu_speed.md"), "w") as f:
            f.write(markdown(results))
    try:
        results["parity"] = compiled_parity(cluster, device, tiny)
    except Exception as e:
        results["parity"] = {"error": f"{type(e).__name__}: {e}"[:1500], "traceback": traceback.format_exc()[-2500:]}
    save()
    for name in models:
        results["cases"].append({"model": name})
        results["cases"][-1] = speed_case(name, cluster, device, tiny, peak, save)
        save()
    return results


def markdown(results: dict) -> str:
    lines = [f"# one-GPU speed: autopar eager/compiled vs the plain model eager/compiled — {results['gpu']}, "
             f"torch {results['torch']}, MFU against {results['datasheet_peak'] / 1e12:.0f} TFLOP/s (bf16 dense)", ""]
    parity = results.get("parity", {})
    lines.append(f"compiled parity (GPT, fp32, TF32 off, 5 AdamW steps): worst relative loss difference "
                 f"{parity.get('worst_rel', 'n/a')} (tolerance {parity.get('tolerance')}); "
                 f"{parity.get('error') or 'fallbacks: ' + str(parity.get('compile_failures'))}")
    lines += ["", "| model | runner | first step s | step ms | tokens/s | MFU |", "|---|---|---|---|---|---|"]
    for case in results["cases"]:
        for runner in RUNNERS:
            r = case.get(runner)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {case['model']} | {runner} | error: {r['error'][:200]} | | | |")
                continue
            lines.append(f"| {case['model']} | {runner} | {r['first_step_s']:.1f} | {1e3 * r['step_s']:.1f} | "
                         f"{r['tokens_per_s']:.0f} | {100 * r['mfu']:.1f} % |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--cluster", default=None, help="a cluster JSON (default: the dgx-h100 preset on CUDA)")
    ap.add_argument("--models", nargs="+", default=["llama-1b", "gpt-l"])
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.cluster:
        cluster = autopar.Cluster.from_json(args.cluster)
    elif args.device == "cuda":
        cluster = autopar.Cluster.preset("dgx-h100", nodes=1)
    else:
        cluster = autopar.Cluster.local(1)
    cluster_dict = cluster.to_dict()
    if args.device == "cpu":
        cluster_dict = dict(cluster_dict, device_type="cpu", backend="gloo")
    backend = "nccl" if args.device == "cuda" else "gloo"
    autopar.launch(speed_rank, 1, cluster_dict, args.device, args.tiny, args.models, args.out, backend=backend,
                   timeout=600)
    print(open(os.path.join(args.out, "gpu_speed.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
