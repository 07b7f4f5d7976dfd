"""Calibration: the cost model against published training runs, each with its exact published layout.

    python benchmarks/calibration/calibration.py                 # every row of published.RUNS
    python benchmarks/calibration/calibration.py --rows "megatron 350M@1" "sc21 1.7B@32"
    python benchmarks/calibration/calibration.py --fit           # also print the compute_time_scale per GPU

For each row (``published.py``: source, layout, published TFLOP/s) the GPT of ``examples/gpt.py`` is built on
the meta device in the run's precision with the attention its system ran (materialized scores: Megatron-LM of
2021 and Alpa's JAX GPT compute softmax(QK^T) as separate kernels), captured at the global batch, and planned
for the preset cluster with the run's layout fixed: Megatron rows through ``autopar.baselines.megatron_configs``
(manual stages, Megatron's weight pins, microbatches, 1F1B) plus LayerNorms replicated over tp (Megatron-LM
had no sequence parallelism then), Alpa rows through manual stages of its layer
clusters with the batch dimension pinned to mesh axis 0 (its ``force_batch_dim_to_mesh_dim``), the rest left to
the ILP as Alpa left it to its own; FSDP rows (torchtitan's Llama runs) are Hugging Face Llama from the
published config (``capture_llama``, attention as torchtitan runs it: causal SDPA), data parallel over every
GPU with every weight at ZeRO level 3. Printed per row: predicted and published step time and throughput, and
ratio = predicted / published throughput (above 1: the model is optimistic); then the median and worst
|ln ratio| over fitted and hold-out rows apart. Goal: every row within 0.90-1.10.

The plan's predicted step is then re-priced where the run's system differs from autopar's runtime
(``published_schedule``: the gradient sync exposed after backward where the run used Megatron's local DDP,
torchtitan's op-level selective recompute, Megatron's and Alpa's fused scale-mask-softmax, llm-foundry's
FlashAttention-1-level Triton attention); the table's "predicted" is that step, "planner" the plan's own.
Rows run under amp (``Run.amp``: fp32 weights, bf16 autocast) are captured in fp32 and relabelled under the
precision policy, as ``autopar.plan`` does.
FSDP2's prefetched ZeRO-3 gathers are the plan's own price: autopar's runtime prefetches them too. Pipeline
sends are the planner's own shard-to-shard transfers, which is Megatron-LM's scatter/gather.

Recompute and precision are passed as ``PlanOptions(recompute=..., precision=...)``: the published runs
recompute every layer, and the planner prices that (one more forward per layer in backward, only the layer's
input kept). Precision comes from the model's dtype (``.half()``), which the cost model reads already.

--fit: the preset's one end-to-end constant per GPU type, ``Cluster.compute_time_scale``, is fitted on the rows
marked "fit" only (one per GPU type): s ← s · (geometric mean of their ratios), twice (compute scales with s,
communication does not). Paste the printed values into autopar/hardware/presets.py; hold-out rows show whether they
transfer. Results: benchmarks/results/calibration.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import autopar  # noqa: E402
from autopar.baselines.megatron_configs import MegatronConfig, megatron_options, score_options, spec_text  # noqa: E402
from autopar.ir.precision import apply_to_graph  # noqa: E402
from autopar.ir.precision import resolve as resolve_precision  # noqa: E402
from autopar.passes.capture import capture  # noqa: E402
from autopar.planner.driver import PlanOptions  # noqa: E402
from autopar.profiling.fidelity import log_ratio_summary  # noqa: E402
from benchmarks.calibration.published import LLAMAS, PENDING, RUNS, Run, published_step_time  # noqa: E402
from benchmarks.calibration.published_schedule import published_prediction  # noqa: E402
from examples.gpt import GPT, GPTConfig, make_batch  # noqa: E402
from examples.hf_causal_lm import CausalLMLoss  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "calibration.md")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
UNCHECKED_MEMORY = 4  # memory_checked=False rows: budget × this (cluster_for)
PLANNER_OPTIONS = {f.name for f in dataclasses.fields(PlanOptions)}


def cluster_for(run: Run, scale: float | None = None) -> autopar.Cluster:
    """The preset for the run's GPUs (``preset_gpus``), with ``scale`` as its compute_time_scale when given.
    A row with ``memory_checked=False`` gets the device's memory several times over: its published layout
    ran on that hardware, where autopar's memory model finds no plan for it (llm-foundry's MPT 350M and 760M
    under amp: 98 GiB predicted per 80 GB GPU), and the row checks time, not memory."""
    cluster = autopar.Cluster.preset(run.preset, gpus=run.gpus)
    if scale is not None:
        cluster = dataclasses.replace(cluster, compute_time_scale=scale)
    return cluster if run.memory_checked else cluster.with_memory(UNCHECKED_MEMORY * cluster.memory_per_device)


HIDDEN_STREAM_OPS = ("aten.layer_norm.default", "aten.dropout.default", "aten.add.Tensor")


def hidden_stream_ops(graph, hidden: int) -> list[str]:
    """The LayerNorms, dropouts and residual adds on the [batch, sequence, hidden] stream between blocks (the
    attention's dropout, on [batch, heads, s, s], is not one of them)."""
    out = []
    for node in graph.gm.graph.nodes:
        val = node.meta.get("val")
        if (node.op == "call_function" and str(node.target) in HIDDEN_STREAM_OPS
                and getattr(val, "ndim", 0) == 3 and val.shape[-1] == hidden):
            out.append(node.name)
    return out


def layout_options(run: Run, cluster, graph=None) -> dict:
    """PlanOptions fields that fix the run's layout (module docstring)."""
    if run.layout == "megatron":
        config = MegatronConfig(dp=run.dp, tp=run.tp, pp=run.pp, microbatches=run.microbatches)
        options = megatron_options(config, run.layers, cluster.devices_per_node)
        # Megatron-LM of 2021 keeps the hidden states replicated across tp between blocks (no sequence
        # parallelism, which Korthikanti et al. 2022 added to split exactly these ops): every tp rank runs the
        # LayerNorms, dropouts and residual adds whole. The ILP would otherwise shard them over the sequence
        # (a reduce-scatter and an all-gather cost what the all-reduce does) and price 1/tp of their time.
        replicated = ["layer_norm*", *hidden_stream_ops(graph, run.hidden)] if graph is not None else ["layer_norm*"]
        options["pin"] = {**options["pin"], **{name: spec_text(config, "S(0)", "R") for name in replicated}}
    elif run.layout == "fsdp":
        mesh = cluster.mesh_shape
        split = "".join("S(0)" if n > 1 else "R" for n in mesh)
        inputs = ("idx", "targets") if run.model == "gpt" else ("input_ids", "labels")  # forward's argument names
        options = {"stages": 1, "microbatches": run.microbatches,
                   "pin": {"p_*": "R" * len(mesh), **{name: split for name in inputs}}}
    else:
        stages = [{"layers": [first, last], "submesh": list(submesh), "mesh": list(mesh)}
                  for first, last, submesh, mesh in run.stages]
        batch_axis = all(mesh[0] > 1 for *_, mesh in run.stages)  # force_batch_dim_to_mesh_dim 0
        options = {"layers": run.alpa_layers, "stages": stages, "microbatches": run.microbatches,
                   "pin": {"idx": "S(0)R", "targets": "S(0)R"} if batch_axis else None}
    options["schedule"] = run.schedule
    # the runs' own ZeRO level (0: none sharded optimizer state; keeps the planner's zero="auto" out of them);
    # torchtitan's op-level selective checkpointing is planned as "full" and re-priced (published_schedule)
    recompute = "full" if run.recompute == "op_sac" else run.recompute
    for name, value in (("recompute", recompute), ("precision", run.precision), ("zero", run.zero)):
        if name in PLANNER_OPTIONS:
            options[name] = value
    return options


def predict(run: Run, graph, scale: float | None = None) -> dict:
    """Predicted step time of ``run`` on an already captured ``graph``."""
    cluster = cluster_for(run, scale)
    start = time.perf_counter()
    scored = score_options(graph, cluster, run.name, layout_options(run, cluster, graph), model_name="GPT")
    if scored.plan is None:
        return {"step": math.nan, "status": scored.status, "seconds": time.perf_counter() - start}
    published = published_prediction(scored.plan, run, graph)
    return {"step": float(published["step_time"]), "planner_step": scored.step_time, "status": "ok",
            "seconds": time.perf_counter() - start, "scale": cluster.compute_time_scale}


def capture_run(run: Run):
    if run.model != "gpt":
        return capture_llama(run)
    cfg = GPTConfig(vocab_size=run.vocab, seq_len=run.seq, n_layer=run.layers, n_head=run.heads,
                    n_embd=run.hidden, dropout=run.dropout, attention=run.attention)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.float32 if run.amp else DTYPES[run.precision])
    graph = capture(model, make_batch(cfg, run.batch, device="meta"))
    # amp: fp32 master weights, ops under autocast (the planner's precision policy, as autopar.plan runs it)
    return apply_to_graph(graph, resolve_precision(run.precision)) if run.amp else graph


def causal_sdpa(module, query, key, value, attention_mask, **kwargs):
    """Hugging Face attention as torchtitan runs it: ``F.scaled_dot_product_attention(..., is_causal=True)``,
    no mask tensor (the published inputs have no padding, so the mask is exactly the causal one). Under
    torch.export transformers' own "sdpa" passes the mask it materialized, which the cost model prices as
    the memory-efficient kernel over the whole square instead of flash over the causal half."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)


def capture_llama(run: Run):
    """The run's Llama (``published.LLAMAS``) on the meta device in its precision's dtype (torchtitan's FSDP2
    computes in bf16 parameters), with ``causal_sdpa`` attention, captured at the global batch."""
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    AttentionInterface.register("causal_sdpa", causal_sdpa)
    cfg = LlamaConfig(**LLAMAS[run.model], max_position_embeddings=run.seq, use_cache=False,
                      attention_dropout=0.0, attn_implementation="causal_sdpa")
    with torch.device("meta"):
        model = CausalLMLoss(LlamaForCausalLM(cfg)).to(DTYPES[run.precision])
    ids = torch.zeros(run.batch, run.seq, dtype=torch.long, device="meta")
    return capture(model, (ids, ids))


def fit_scales(rows: list[Run], graphs: dict, rounds: int = 2) -> dict[str, float]:
    """compute_time_scale per preset from its "fit" rows (module docstring)."""
    scales = {}
    for preset in dict.fromkeys(r.preset for r in rows if r.role == "fit"):
        fit_rows = [r for r in rows if r.role == "fit" and r.preset == preset]
        scale = cluster_for(fit_rows[0]).compute_time_scale
        for round_ in range(rounds):
            ratios = [published_step_time(r) / predict(r, graphs[r.name], scale)["step"] for r in fit_rows]
            print(f"# fit {preset} round {round_}: scale {scale:.3f}, ratios "
                  + ", ".join(f"{r.name} {x:.3f}" for r, x in zip(fit_rows, ratios)), flush=True)
            scale *= math.exp(statistics.fmean(math.log(x) for x in ratios))
        scales[preset] = scale
    return scales


def table(rows: list[Run], results: dict) -> list[str]:
    lines = ["| row | source | preset | layout | role | planner s | predicted s | published s | predicted TFLOP/s | "
             "published TFLOP/s | ratio | status |", "|" + "---|" * 12]
    for run in rows:
        r = results[run.name]
        published = published_step_time(run)
        ratio = published / r["step"] if r["step"] == r["step"] else math.nan
        layout = {"megatron": f"dp{run.dp} tp{run.tp} pp{run.pp} B{run.microbatches}",
                  "fsdp": f"FSDP {run.gpus}, {run.recompute}"}.get(run.layout, f"{len(run.stages)} stages, "
                                                                     f"B{run.microbatches}")
        layout += ", sync after bwd" if run.grad_sync == "after_backward" else ""
        lines.append(f"| {run.name} | {run.source} | {run.preset} | {layout} | {run.role} | "
                     f"{r.get('planner_step', math.nan):.3f} | {r['step']:.3f} | "
                     f"{published:.3f} | {run.tflops * ratio:.1f} | {run.tflops:.1f} | {ratio:.3f} | {r['status']} |")
    return lines


def summary(rows: list[Run], results: dict) -> list[str]:
    out = []
    for role in ("fit", "holdout"):
        ratios = [published_step_time(r) / results[r.name]["step"] for r in rows
                  if r.role == role and results[r.name]["step"] == results[r.name]["step"]]
        if ratios:
            median, worst = log_ratio_summary(ratios)
            inside = sum(0.9 <= x <= 1.1 for x in ratios)
            out.append(f"{role}: {len(ratios)} rows, median |ln ratio| {median:.3f} (x{math.exp(median):.2f}), "
                       f"worst {worst:.3f} (x{math.exp(worst):.2f}); {inside}/{len(ratios)} within 0.90-1.10")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="*", help="row names (default: all)")
    parser.add_argument("--fit", action="store_true", help="fit compute_time_scale on the fit rows first")
    parser.add_argument("--out", default=RESULTS, help="markdown file to write ('' to skip)")
    args = parser.parse_args(argv)
    rows = [r for r in RUNS if not args.rows or r.name in args.rows]
    graphs, results = {}, {}
    for run in rows:
        graphs[run.name] = capture_run(run)
    scales = fit_scales(rows, graphs) if args.fit else {}
    for run in rows:
        results[run.name] = predict(run, graphs[run.name], scales.get(run.preset))
        print(f"# {run.name}: {results[run.name]}", flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    header = (f"# autopar calibration - {time.strftime('%Y-%m-%d')}, {platform.machine()} {os.cpu_count()} cores, "
              f"torch {torch.__version__}, load {load:.1f}")
    lines = [header, *table(rows, results), "", *summary(rows, results)]
    if scales:
        lines.append("fitted compute_time_scale: " + ", ".join(f"{k} {v:.3f}" for k, v in scales.items()))
    lines += ["", "Not predicted yet:"] + [f"- {what}: {why}" for what, why in PENDING]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
