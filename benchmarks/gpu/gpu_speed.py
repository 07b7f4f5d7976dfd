"""Throughput and MFU on one GPU (``../shared/GPU.md`` items 2 and 4): tokens/s and model FLOP utilization of the
same model trained plainly and by autopar, eager and compiled, and one-GPU plans at long sequences.

    python benchmarks/gpu/gpu_speed.py --out DIR                       # on a machine with one GPU
    python benchmarks/gpu/gpu_speed.py --out DIR --device cpu --tiny   # a dry run of the same code here

MFU = model FLOPs per step / (step time x peak FLOP/s), with the model FLOPs counted once by
``torch.utils.flop_counter.FlopCounterMode`` over one forward + backward of the plain model (matmuls and
attention; recompute is not counted, as MFU's convention has it) and the peak the dense bf16 rate of the GPU's
datasheet (H100/H200 SXM: 989 TFLOP/s). Step = ``train_step`` (or forward + backward) + AdamW step + zero_grad,
median over timed steps with CUDA events after warm-up (the first warm-up step also compiles, timed apart).

Modes per model: ``plain`` (the model under ``torch.autocast``), ``plain_compiled`` (``torch.compile(model)``),
``autopar`` (``autopar.compile``, eager) and ``autopar_compiled`` (``compile=True`` where ``autopar.compile``
takes it, else the generated graph module's forward under ``torch.compile``: the result records which).
Section ``long``: Llama-1B plans at sequences 8K-32K with recompute, predicted vs measured step and memory.
Section ``scale``: Llama-3-8B built on the meta device, trained with the levers the planner picks (``scale_rank``).
Results go to ``DIR/gpu_speed.json`` after every case, so a run cut short still reports what it reached.
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import autopar  # noqa: E402
from examples.gpt import GPTConfig, make_gpt  # noqa: E402
from examples.hf_causal_lm import CausalLMLoss  # noqa: E402

PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12}  # dense bf16 tensor-core rate, NVIDIA's SXM datasheets
LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                num_attention_heads=16, num_key_value_heads=4)
TINY_LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
SPEED_CASES = {  # name -> (kind, config, sequence, batch)
    "llama-1b": ("llama", LLAMA_1B, 2048, 8),
    "gpt-l": ("gpt", GPTConfig(vocab_size=50304, seq_len=1024, n_layer=16, n_head=16, n_embd=2048), 1024, 8),
}
TINY_CASES = {"llama-1b": ("llama", TINY_LLAMA, 32, 2),
              "gpt-l": ("gpt", GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, n_embd=64), 32, 2)}
LONG_SEQUENCES = (8192, 16384, 32768)
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0)


def build(kind: str, cfg, seq: int, batch: int):
    """(model on the CPU, (ids, labels)) with deterministic weights and data."""
    if kind == "gpt":
        return make_gpt(cfg, batch_size=batch)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**cfg, max_position_embeddings=seq, use_cache=False, attention_dropout=0.0)
    model = CausalLMLoss(LlamaForCausalLM(config))
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, (ids, ids.clone())


def peak_flops(device: str) -> float:
    if device != "cuda":
        return 1e12  # a nominal figure for the dry run
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_BF16.items() if k in name), 989.4e12)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _timed(step, device: str, warmup: int, steps: int) -> dict:
    t0 = time.perf_counter()
    step()
    if device == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
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
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
    out = {"first_step_s": first, "step_s": statistics.median(times), "step_min_s": min(times),
           "step_max_s": max(times)}
    if device == "cuda":
        out["max_allocated"] = torch.cuda.max_memory_allocated()
    return out


def model_flops(model, batch, device: str) -> float:
    """FLOPs of one forward + backward of the plain model (FlopCounterMode), under bf16 autocast."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    try:
        with counter, torch.autocast(device, dtype=torch.bfloat16):
            model(*batch).backward()
    except AssertionError:  # torch 2.11's SDPA formula refuses grouped-query attention (fewer k/v heads)
        return analytic_flops(model, batch)
    finally:
        model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def analytic_flops(model, batch) -> float:
    """PaLM's count (appendix B): 6 x matmul parameters x tokens + 12 x layers x width x sequence x tokens; the
    input embedding is a lookup, not a matmul, so its parameters are left out."""
    ids = batch[0]
    tokens, seq = ids.numel(), ids.shape[-1]
    lm = getattr(model, "lm", model)
    cfg = lm.config
    embedding = lm.get_input_embeddings().weight.numel()
    matmul_params = sum(p.numel() for p in model.parameters()) - embedding
    return 6.0 * matmul_params * tokens + 12.0 * cfg.num_hidden_layers * cfg.hidden_size * seq * tokens


def plain_row(model, batch, device: str, compiled: bool, warmup: int, steps: int) -> dict:
    model = model.to(device)
    runner = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = runner(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _timed(step, device, warmup, steps)


def autopar_row(model, batch, device: str, compiled: bool, warmup: int, steps: int, **options) -> dict:
    cluster = _one_device_cluster(device)
    row = {}
    takes_compile = "compile" in inspect.signature(autopar.compile).parameters or _accepts_compile_option()
    kwargs = dict(precision="bf16", **options)
    if compiled and takes_compile:
        kwargs["compile"] = True
        row["how_compiled"] = "autopar.compile(compile=True)"
    elif not compiled and takes_compile:
        kwargs["compile"] = False
    t0 = time.perf_counter()
    on_meta = next(model.parameters()).device.type == "meta"  # autopar materializes this rank's shards itself
    pm = autopar.compile(model if on_meta else model.to(device), cluster, batch, **kwargs)
    row["plan_and_build_s"] = time.perf_counter() - t0
    if compiled and not takes_compile:
        pm.runner.gm.forward = torch.compile(pm.runner.gm.forward)
        row["how_compiled"] = "torch.compile(pm.runner.gm.forward) by hand"
    row["plan"] = pm.plan.summary(max_rows=0)[:1500]
    row.update(predicted_step_s=float(pm.plan.predicted["step_time"]),
               predicted_peak_bytes=float(pm.plan.predicted["peak_memory"]), microbatches=pm.plan.microbatches,
               recompute=dict(pm.plan.stages[0].recompute))
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-5, fused=device == "cuda")

    def step():
        pm.train_step(*batch)
        opt.step()
        opt.zero_grad(set_to_none=True)

    row.update(_timed(step, device, warmup, steps))
    return row


def _accepts_compile_option() -> bool:
    try:
        from autopar.planner.options import PlanOptions
    except ImportError:
        try:
            from autopar.planner.options import PlanOptions
        except ImportError:
            return False
    return "compile" in getattr(PlanOptions, "__dataclass_fields__", {})


def _one_device_cluster(device: str) -> autopar.Cluster:
    path = os.environ.get("AUTOPAR_GPU_CLUSTER")
    if device != "cuda":
        return autopar.Cluster.local(1)
    base = autopar.Cluster.from_json(path).to_dict() if path else autopar.Cluster.preset("dgx-h100").to_dict()
    return autopar.Cluster.from_dict(dict(base, nodes=1, devices_per_node=1, mesh_shape=(1, 1)))


def speed_rank(rank: int, device: str, tiny: bool, modes: list[str], out: str) -> list[dict]:
    torch.backends.cuda.matmul.allow_tf32 = True
    warmup, steps = (2, 2) if tiny else (4, 10)
    rows = []
    for name, (kind, cfg, seq, batch) in (TINY_CASES if tiny else SPEED_CASES).items():
        flops = None
        for mode in modes:
            row = {"model": name, "mode": mode, "tokens_per_step": seq * batch}
            try:
                model, data = build(kind, cfg, seq, batch)
                data = tuple(t.to(device) for t in data)
                if flops is None:
                    flops = model_flops(model.to(device), data, device)
                if mode.startswith("plain"):
                    row.update(plain_row(model, data, device, mode.endswith("compiled"), warmup, steps))
                else:
                    row.update(autopar_row(model, data, device, mode.endswith("compiled"), warmup, steps,
                                           recompute="none"))
                row["model_flops"] = flops
                row["tokens_per_s"] = seq * batch / row["step_s"]
                row["mfu"] = flops / row["step_s"] / peak_flops(device)
            except Exception as e:  # recorded; the next case runs
                _record_failure(row, e)
            rows.append(row)
            print(_line(row), flush=True)
            model = data = None
            _free()
            _dump(out, "speed_partial.json", rows)
    return rows


def long_rank(rank: int, device: str, tiny: bool, out: str, seqs: tuple = LONG_SEQUENCES) -> list[dict]:
    rows = []
    seqs = (64, 128) if tiny else seqs
    for seq in seqs:
        for recompute in ("full", "auto"):
            row = {"model": "llama-1b", "seq": seq, "batch": 1, "recompute_option": recompute}
            try:
                model, data = build("llama", TINY_LLAMA if tiny else LLAMA_1B, seq, 1)
                data = tuple(t.to(device) for t in data)
                row.update(autopar_row(model, data, device, False, 2, 2 if tiny else 5, recompute=recompute))
                row["tokens_per_s"] = seq / row["step_s"]
            except Exception as e:
                _record_failure(row, e)
            rows.append(row)
            print(_line(row), flush=True)
            model = data = None
            _free()
            _dump(out, "long_partial.json", rows)
    return rows


def scale_rank(rank: int, device: str, tiny: bool, seq: int, batch: int, out: str) -> list[dict]:
    """GPU.md item 3: Llama-3-8B built on the meta device (its fp32 training state, ~128 GB with AdamW, does
    not fit one GPU), initialized by autopar on the GPU and trained a few steps with the levers the planner
    chooses (bf16, recompute, CPU offload): predicted vs measured step time and peak memory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = TINY_LLAMA if tiny else LLAMA3_8B
    row = {"model": "llama3-8b" if not tiny else "tiny", "seq": seq, "batch": batch}
    try:
        config = LlamaConfig(**cfg, max_position_embeddings=seq, use_cache=False, attention_dropout=0.0)
        with torch.device("meta"):
            model = CausalLMLoss(LlamaForCausalLM(config))
        ids = torch.randint(0, cfg["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
        data = (ids.to(device), ids.to(device))
        row["parameters"] = sum(p.numel() for p in model.parameters())
        row.update(autopar_row(model, data, device, False, 1, 2 if tiny else 3, recompute="auto",
                               offload="auto"))
        row["tokens_per_s"] = seq * batch / row["step_s"]
    except Exception as e:
        _record_failure(row, e)
    print(_line(row), flush=True)
    return [row]


def _record_failure(row: dict, error: Exception) -> None:
    """A case that raised: its error and the traceback's end go into its row, and the next case runs."""
    row["error"] = f"{type(error).__name__}: {error}"[:1500]
    row["traceback"] = traceback.format_exc()[-2500:]


def _line(row: dict) -> str:
    keep = ("model", "mode", "seq", "recompute_option", "step_s", "first_step_s", "tokens_per_s", "mfu",
            "predicted_step_s", "max_allocated", "predicted_peak_bytes", "how_compiled", "error")
    return " ".join(f"{k}={row[k]:.4g}" if isinstance(row.get(k), float) else f"{k}={row[k]}"
                    for k in keep if k in row)


def _dump(out: str, name: str, value) -> None:
    with open(os.path.join(out, name), "w") as f:
        json.dump(value, f, indent=1, default=str)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--modes", default="plain,plain_compiled,autopar,autopar_compiled")
    ap.add_argument("--sections", default="speed,long", help="any of speed,long,scale")
    ap.add_argument("--long-seqs", default=",".join(map(str, LONG_SEQUENCES)))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    backend = "nccl" if args.device == "cuda" else "gloo"
    results = {"torch": torch.__version__,
               "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    sections = args.sections.split(",")
    if "speed" in sections:
        results["speed"] = autopar.launch(speed_rank, 1, args.device, args.tiny, args.modes.split(","), args.out,
                                          backend=backend, timeout=600)[0]
        _dump(args.out, "gpu_speed.json", results)
    if "long" in sections:
        seqs = tuple(int(x) for x in args.long_seqs.split(","))
        results["long"] = autopar.launch(long_rank, 1, args.device, args.tiny, args.out, seqs, backend=backend,
                                         timeout=600)[0]
        _dump(args.out, "gpu_speed.json", results)
    if "scale" in sections:
        results["scale"] = autopar.launch(scale_rank, 1, args.device, args.tiny, 64 if args.tiny else 2048,
                                          2 if args.tiny else 1, args.out, backend=backend, timeout=600)[0]
    _dump(args.out, "gpu_speed.json", results)
    for section in ("speed", "long", "scale"):
        for row in results.get(section, []):
            print(section, _line(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
