"""Where a small GPT's training step goes on one GPU: step time and kernel time by kind, plain PyTorch.

    python benchmarks/calibration/small_gpt_gpu.py --out results.json      (needs a CUDA device)

For GPT shapes of the llm-foundry hold-out rows (``published.py``: hidden 768-2048, sequence 2048, bf16
weights, fused causal attention, no dropout, AdamW), one rank, no autopar: the median step of a few
(CUDA events), and one profiled step's device time summed by kernel kind (matmul, attention, everything
else). Beside them, the same GPU's rate on each GEMM shape the blocks run (forward) against a large square
one, and the achieved bandwidth of LayerNorm and GELU (forward + backward) against a plain copy. The cost
model prices these from the machine's large-GEMM rate and its streaming bandwidth; this says which kind of
kernel runs slower than that on small models, to compare with ``calibration.py``'s per-kind sensitivity.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.gpt import GPT, GPTConfig  # noqa: E402

SHAPES = {"125M": (768, 12, 12), "350M": (1024, 24, 16), "1.3B": (2048, 24, 16)}  # hidden, layers, heads


def cuda_time(fn, repeats: int = 10) -> float:
    """Median seconds of ``fn()`` by CUDA events, after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def kind(name: str) -> str:
    n = name.lower()
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if "gemm" in n or "cutlass" in n or "xmma" in n or "cublas" in n or "nvjet" in n:
        return "matmul"
    return "other"


def train_step_profile(size: str, batch: int, seq: int = 2048, vocab: int = 50368) -> dict:
    hidden, layers, heads = SHAPES[size]
    cfg = GPTConfig(vocab_size=vocab, seq_len=seq, n_layer=layers, n_head=heads, n_embd=hidden, dropout=0.0)
    model = GPT(cfg).to("cuda", torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, vocab, (batch, seq), device="cuda")

    def step():
        loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds = cuda_time(step, repeats=5)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = {}
    kernels = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_kind[kind(e.name)] = by_kind.get(kind(e.name), 0.0) + e.device_time / 1e6
            kernels += 1
    params = sum(p.numel() for p in model.parameters())
    flops = 6 * params * batch * seq + 12 * layers * hidden * seq * batch * seq
    return {"size": size, "batch": batch, "seq": seq, "step_s": seconds, "kernel_s": by_kind, "kernels": kernels,
            "model_tflops": flops / seconds / 1e12}


def gemm_rates(hidden: int, tokens: int) -> dict:
    """TFLOP/s of the block's forward GEMMs [tokens, K] @ [K, N] and of 8192³, bf16."""
    out = {}
    for k, n in ((hidden, hidden), (hidden, 4 * hidden), (4 * hidden, hidden), (8192, 8192)):
        m = tokens if k != 8192 else 8192
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        out[f"{m}x{k}x{n}"] = 2 * m * k * n / cuda_time(lambda: a @ b) / 1e12
    return out


def bandwidths(hidden: int, tokens: int) -> dict:
    """GB/s of copy, LayerNorm and GELU forward + backward on [tokens, hidden] bf16 (bytes as the cost model
    counts them: inputs + outputs, three times with backward)."""
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ln = torch.nn.LayerNorm(hidden).to("cuda", torch.bfloat16)
    grad = torch.randn_like(x)
    size = x.numel() * x.element_size()
    y = torch.empty_like(x)
    out = {"copy": 2 * size / cuda_time(lambda: y.copy_(x)) / 1e9}
    out["layer_norm"] = 3 * 2 * size / cuda_time(lambda: ln(x).backward(grad)) / 1e9
    out["gelu"] = 3 * 2 * size / cuda_time(lambda: torch.nn.functional.gelu(x).backward(grad)) / 1e9
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": [], "gemm": {},
              "bandwidth": {}}
    for size in SHAPES:
        result["steps"].append(train_step_profile(size, args.batch))
        torch.cuda.empty_cache()
        hidden = SHAPES[size][0]
        result["gemm"][size] = gemm_rates(hidden, args.batch * 2048)
        result["bandwidth"][size] = bandwidths(hidden, args.batch * 2048)
        print(json.dumps({k: v for k, v in result.items() if k != "device"}, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
