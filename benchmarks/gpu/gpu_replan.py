"""Re-predict a GPU check's measured plans with another cluster file, on any machine (no GPU needed).

    python benchmarks/gpu/gpu_replan.py --results benchmarks/results/gpu_h200_2026-11-26.json \\
        --cluster benchmarks/results/gpu_h200_cluster.json [--set compute_time_scale=1.0 ...]

The measurements of ``gpu_check.py`` (step time, peak memory per one-GPU plan) stay fixed; each plan is planned
again on the meta device for the given cluster (with ``--set field=value`` overrides), so a change to the cost
model or to how a profile is turned into a cluster can be judged against the GPU runs without device time.
Printed: per plan the predicted and measured step time and peak memory with their errors, then the median
|time error|, the Spearman correlation of predicted and measured times and the median |memory error|.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import autopar  # noqa: E402
from autopar.profiling.fidelity import relative_error, spearman  # noqa: E402
from benchmarks.gpu.gpu_models import GPT_SIZES, LLAMA_SIZES  # noqa: E402
from examples.gpt import GPT, make_batch  # noqa: E402
from examples.hf_causal_lm import CausalLMLoss  # noqa: E402

GiB = 2**30


def meta_model(name: str):
    """(model, batch) of a plan case on the meta device: planning needs shapes, not weights."""
    if name.startswith("gpt"):
        cfg, batch = GPT_SIZES[name]
        with torch.device("meta"):
            model = GPT(cfg)
        return model, make_batch(cfg, batch, device="meta")
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs, seq, batch = LLAMA_SIZES[name]
    cfg = LlamaConfig(**kwargs, max_position_embeddings=2 * seq, use_cache=False, attention_dropout=0.0)
    with torch.device("meta"):
        model = CausalLMLoss(LlamaForCausalLM(cfg))
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (ids, ids.clone())


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def one_gpu_cluster(path: str, overrides: list[str]) -> autopar.Cluster:
    d = json.loads(open(path).read())
    for item in overrides:
        field, _, value = item.partition("=")
        d[field] = _value(value)
    return autopar.Cluster.from_dict(dict(d, nodes=1, devices_per_node=1, mesh_shape=(1, 1)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", required=True, help="gpu_check.json of a GPU run")
    ap.add_argument("--cluster", required=True, help="cluster JSON to predict with")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a cluster field")
    args = ap.parse_args(argv)
    cluster = one_gpu_cluster(args.cluster, args.set)
    rows = [r for r in json.loads(open(args.results).read())["plans"] if "measured_step_s" in r]
    print(f"{'model':9} {'prec':5} {'recompute':9} {'pred ms':>8} {'meas ms':>8} {'err':>7} "
          f"{'pred GiB':>8} {'alloc GiB':>9} {'err':>7}")
    predicted, measured, mem_errors = [], [], []
    for r in rows:
        model, batch = meta_model(r["model"])
        plan = autopar.plan(model, cluster, batch, precision=r["precision"], recompute=r["recompute"])
        t, m = float(plan.predicted["step_time"]), float(plan.predicted["peak_memory"])
        predicted.append(t)
        measured.append(r["measured_step_s"])
        mem_errors.append(relative_error(m, r["max_allocated"]))
        print(f"{r['model']:9} {r['precision']:5} {r['recompute']:9} {t * 1e3:8.1f} {r['measured_step_s'] * 1e3:8.1f} "
              f"{relative_error(t, r['measured_step_s']):+7.1%} {m / GiB:8.2f} {r['max_allocated'] / GiB:9.2f} "
              f"{mem_errors[-1]:+7.1%}")
    time_errors = [abs(relative_error(p, m)) for p, m in zip(predicted, measured)]
    print(f"median |time error| {statistics.median(time_errors):.1%}; Spearman {spearman(predicted, measured):.3f}; "
          f"median |memory error| {statistics.median(abs(e) for e in mem_errors):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
