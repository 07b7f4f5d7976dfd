"""Long context: autopar's plan against a torchtitan-style hand grid (FSDP, FSDP × TP, FSDP × CP; checkpointing).

    python benchmarks/vs_hand/long_context.py            # HF Llama-3-8B at 32K and 128K on 8 and 64 H100 (dgx-h100)
    python benchmarks/vs_hand/long_context.py --model llama3-8b-causal --name long_context_causal   # mask-free SDPA
    python benchmarks/vs_hand/long_context.py --points 32768:8 --model gpt-8b --name long_context_gpt
    python benchmarks/vs_hand/long_context.py --points 4096:8 --model llama-small --name lc_check  # quick check

Models: "llama3-8b" is Hugging Face ``LlamaForCausalLM`` at meta-llama/Llama-3.1-8B's config (GQA with 8 key/value
heads, SwiGLU MLP of 14336, vocabulary 128256, rotary theta 500000), built on the meta device. Its SDPA path
passes a materialized causal mask (S² booleans: 16 GiB at 128K, as HF allocates it), priced alike on both sides;
torchtitan's flash attention needs none, so the memory figures are HF's, not torchtitan's. "llama3-8b-causal" is
the same model on HF's mask-free path (``register_causal_sdpa``: SDPA with ``is_causal`` and grouped key/value
heads, as HF's eager path and torchtitan run it; its attention splits over heads or the sequence). "gpt-8b" is the GPT
example at that shape (one fused causal SDPA, no mask, no GQA or SwiGLU). bf16 mixed precision; one sequence per
data-parallel replica, as torchtitan's long-context runs take.

Hand layouts, each one pipeline stage on a (dp, m) mesh of the "dgx-h100" preset with full activation
checkpointing (recompute="full") and FSDP (zero=3: every weight sharded over the axes it is replicated on):
  * "fsdp": FSDP alone, mesh (gpus, 1), weights replicated before ZeRO-3 shards them over every device;
  * "tp": Megatron/torchtitan tensor parallelism on the m axis (column-parallel q, k, v, gate, up; row-parallel
    o, down; vocabulary-parallel embedding and output), FSDP over dp;
  * "cp": context parallelism on the m axis: tokens and every attention split over the sequence
    (``autopar/runtime/context_parallel.py``), weights replicated on m (so FSDP shards them over dp·m).
torchtitan combines FSDP × TP × CP on a 3-D mesh; autopar's meshes are 2-D, so the grid holds the one- and
two-axis combinations (an honest subset). Activations not pinned are placed by the same ILP. The table says
which layouts fit, which fit without CP, and compares the fastest that fits with ``autopar.plan`` (default
options: the search includes CP, recompute, ZeRO levels 0-3 and offload="none"; where they find no plan, again
with zero=3, and the table says so; global batch = the best hand layout's dp, or gpus / 8 where none fits). Every
point is written to benchmarks/results/NAME.{md,json} when done. Asserts nothing about time.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import autopar  # noqa: E402
from autopar.baselines.megatron_configs import LLAMA_TP_SPECS, TP_WEIGHT_SPECS  # noqa: E402
from autopar.errors import InfeasibleError  # noqa: E402
from benchmarks.vs_hand.vs_megatron_report import RESULTS, machine_line  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0)
SMALL_LLAMA = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=2)
MODELS = {"llama3-8b": ("llama", LLAMA3_8B), "llama3-8b-causal": ("llama-causal", LLAMA3_8B),
          "llama-small": ("llama", SMALL_LLAMA), "llama-small-causal": ("llama-causal", SMALL_LLAMA),
          "gpt-8b": ("gpt", dict(vocab_size=128256, n_layer=32, n_head=32, n_embd=4096)),
          "small": ("gpt", dict(vocab_size=1024, n_layer=2, n_head=8, n_embd=256))}
DEFAULT_POINTS = ["32768:8", "131072:8", "32768:64", "131072:64"]
INPUTS = {"llama": ("input_ids", "labels"), "llama-causal": ("input_ids", "labels"), "gpt": ("idx", "targets")}
CAUSAL_SDPA = "sdpa_is_causal"  # the HF attention implementation "llama-causal" models run (``register_causal_sdpa``)
WIDTHS = (2, 4, 8)
# autopar's side: default options (zero="auto" chooses ZeRO level 0, 2 or 3 per parameter group), then, only where
# they find no plan, every weight at ZeRO-3 as the hand grid has it (the table says when that was needed).
AUTOPAR_OPTIONS = ({}, {"zero": 3})


def workload(model: str, seq: int, batch: int):
    """(model on the meta device, (tokens, labels) on the meta device, family)."""
    family, shape = MODELS[model]
    if family.startswith("llama"):
        from transformers import LlamaConfig, LlamaForCausalLM

        from examples.hf_causal_lm import CausalLMLoss

        extra = {"attn_implementation": register_causal_sdpa()} if family == "llama-causal" else {}
        cfg = LlamaConfig(**shape, max_position_embeddings=seq, use_cache=False, attention_dropout=0.0, **extra)
        with torch.device("meta"):
            lm = CausalLMLoss(LlamaForCausalLM(cfg))
        ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        return lm, (ids, ids.clone()), family
    from examples.gpt import GPT, GPTConfig, make_batch

    cfg = GPTConfig(seq_len=seq, **shape)
    with torch.device("meta"):
        gpt = GPT(cfg)
    return gpt, make_batch(cfg, batch, device="meta"), family


def register_causal_sdpa() -> str:
    """Register (once) an HF attention implementation that is SDPA with ``is_causal`` and no mask wherever the
    inputs carry no padding (no attention_mask) and queries are as long as keys: HF's eager path skips the mask
    there too, but under torch.export HF always materializes an S × S mask (``masking_utils``: an exported graph
    would hard-code ``is_causal`` for later lengths, and it cannot read position ids to rule out packed sequences;
    autopar's capture is fixed-shape, and this benchmark's inputs give no position ids, so nothing is packed).
    Elsewhere it falls back to HF's own SDPA mask. Returns the implementation's name."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def mask(batch_size, q_length, kv_length, *args, attention_mask=None, local_size=None, **kwargs):
        if attention_mask is None and local_size is None and q_length == kv_length and not args:
            return None
        return sdpa_mask(batch_size, q_length, kv_length, *args, attention_mask=attention_mask,
                         local_size=local_size, **kwargs)

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(CAUSAL_SDPA, mask)
    return CAUSAL_SDPA


def hand_layouts(gpus: int, per_node: int) -> list[tuple[str, int, int]]:
    """(kind, dp, m) with dp·m = gpus and m inside a node; FSDP alone first."""
    return [("fsdp", gpus, 1)] + [(kind, gpus // m, m) for m in WIDTHS if m <= per_node and gpus % m == 0
                                  for kind in ("tp", "cp")]


def layout_name(kind: str, dp: int, m: int) -> str:
    return f"fsdp{dp}" if kind == "fsdp" else f"{kind}{m}·fsdp{dp}"


def hand_options(kind: str, dp: int, family: str) -> dict:
    """The plan options of one hand layout (module docstring)."""
    batch = "S(0)" if dp > 1 else "R"
    tokens, labels = INPUTS[family]
    if kind == "fsdp":
        pin = {"p_*": "RR", tokens: batch + "R", labels: batch + "R"}
    elif kind == "tp":
        specs = LLAMA_TP_SPECS if family.startswith("llama") else TP_WEIGHT_SPECS
        pin = {glob: "R" + spec for glob, spec in specs.items()}
        pin.update({tokens: batch + "R", labels: batch + "R"})
    else:
        pin = {"p_*": "RR", tokens: batch + "S(1)", "scaled_dot_product_attention*": batch + "S(2)"}
    return {"stages": 1, "pin": pin, "recompute": "full", "zero": 3, "precision": "bf16"}


def score(model, batch, cluster, options: dict) -> float | None:
    """Predicted step seconds, or None where the plan does not fit."""
    try:
        return float(autopar.plan(model, cluster, batch, **options).predicted["step_time"])
    except InfeasibleError:
        return None


def run_point(point: str, model_name: str, log) -> dict:
    seq, gpus = (int(x) for x in point.split(":"))
    per_node = autopar.Cluster.preset("dgx-h100", gpus=gpus).devices_per_node
    hand, batches = {}, {}
    for kind, dp, m in hand_layouts(gpus, per_node):
        name = layout_name(kind, dp, m)
        model, batch, family = workload(model_name, seq, dp)
        cluster = autopar.Cluster.preset("dgx-h100", gpus=gpus, mesh_shape=(dp, m))
        start = time.perf_counter()
        hand[name], batches[name] = score(model, batch, cluster, hand_options(kind, dp, family)), dp
        log(f"  {point} {name}: {hand[name]} ({time.perf_counter() - start:.0f} s)")
    fitting = {k: v for k, v in hand.items() if v is not None}
    best = min(fitting, key=fitting.get) if fitting else None
    global_batch = batches[best] if best else max(1, gpus // max(WIDTHS))
    model, batch, _ = workload(model_name, seq, global_batch)
    start = time.perf_counter()
    row = {"point": point, "model": model_name, "hand": hand, "best": best, "hand_step": fitting.get(best),
           "global_batch": global_batch, "auto_step": None, "auto_plan": "no plan fits"}
    for options in AUTOPAR_OPTIONS:
        try:
            plan = autopar.plan(model, autopar.Cluster.preset("dgx-h100", gpus=gpus), batch, precision="bf16",
                                **options)
        except InfeasibleError as e:
            row.setdefault("auto_error", str(e))
            continue
        extra = "".join(f", {k}={v}" for k, v in options.items())
        row.update(auto_step=float(plan.predicted["step_time"]), auto_plan=describe(plan) + extra,
                   auto_options=options)
        break
    return {**row, "plan_s": time.perf_counter() - start}


def describe(plan) -> str:
    """'1 × 1x8 (mesh 1x8), B=1, context parallel': stages, microbatches, and whether attention is split over the
    sequence."""
    from benchmarks.vs_hand.vs_megatron_report import describe_plan

    return describe_plan(plan) + (", context parallel" if uses_context_parallel(plan) else "")


def uses_context_parallel(plan) -> bool:
    """Some stage splits an attention over the sequence: SDPA's output [B, heads, S, d] is Shard(2) on an axis."""
    return any(name.startswith("scaled_dot_product_attention") and "S(2)" in sharding.out
               for stage in plan.stages for name, sharding in stage.shardings.items())


def fits_without_cp(row: dict) -> bool:
    return any(v is not None for k, v in row["hand"].items() if not k.startswith("cp"))


def table(rows: list[dict]) -> str:
    lines = ["| model | sequence | GPUs | hand layouts that fit | fits without CP | best hand (s/step) | autopar plan "
             "| autopar (s/step) | autopar / hand |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["model"], int(r["point"].split(":")[1]), int(r["point"].split(":")[0]))):
        seq, gpus = r["point"].split(":")
        fits = ", ".join(k for k, v in r["hand"].items() if v is not None) or "none"
        ratio = f"{r['hand_step'] / r['auto_step']:.3f}" if r["hand_step"] and r["auto_step"] else "n/a"
        best = f"{r['best']} ({r['hand_step']:.4g})" if r["best"] else "none fits"
        auto = f"{r['auto_step']:.4g}" if r["auto_step"] else "no plan"
        lines.append(f"| {r['model']} | {seq} | {gpus} | {fits} | {'yes' if fits_without_cp(r) else 'no'} | {best} "
                     f"| {r['auto_plan']} | {auto} | {ratio} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """The issue's two long-context goals (a plan wherever the best hand layout fits; a plan where only
    context-parallel hand layouts fit), and the points where no hand layout fits at all."""
    hand_fits = [r for r in rows if r["best"]]
    only_cp = [r for r in hand_fits if not fits_without_cp(r)]
    none_fit = [r for r in rows if not r["best"]]
    planned = lambda rs: sum(1 for r in rs if r["auto_step"])  # noqa: E731
    ratios = [r["hand_step"] / r["auto_step"] for r in hand_fits if r["auto_step"]]
    worst = f" (autopar / best hand: min {min(ratios):.3f})" if ratios else ""
    return (f"autopar plans at {planned(hand_fits)} of the {len(hand_fits)} points where a hand layout fits{worst}; "
            f"at {planned(only_cp)} of the {len(only_cp)} points where only context-parallel hand layouts fit; "
            f"at {planned(none_fit)} of the {len(none_fit)} points where no hand layout fits")


def write(name: str, header: str, rows: list[dict]) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    path = os.path.join(RESULTS, f"{name}.md")
    with open(path, "w") as f:
        f.write("\n\n".join([header, table(rows), summary(rows), NOTES]) + "\n")
    return path


NOTES = ("Models: llama3-8b is HF LlamaForCausalLM at Llama-3.1-8B's config as torch.export captures it (HF "
         "materializes an S × S causal mask under export: 16 GiB of booleans at 128K, replicated unless the sequence "
         "is split); llama3-8b-causal the same model on HF's mask-free SDPA path (is_causal, grouped key/value heads), "
         "as HF's eager path and torchtitan run it; gpt-8b the GPT example at that shape (no GQA or SwiGLU). "
         "Hand layouts (one stage, full activation checkpointing, FSDP = ZeRO-3 over the axes a weight is replicated "
         "on): fsdpN = FSDP alone; tpM·fsdpN = tensor parallel on M devices of a node; cpM·fsdpN = context parallel "
         "(tokens and attention split over the sequence) on M devices. Scored by autopar's cost model; autopar plans "
         "with default options (its search includes the sequence split). See benchmarks/vs_hand/long_context.py.")


def saved(name: str) -> list[dict]:
    path = os.path.join(RESULTS, f"{name}.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", nargs="+", default=DEFAULT_POINTS, help="SEQUENCE:GPUS")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    parser.add_argument("--name", default="long_context", help="results: benchmarks/results/NAME.{md,json}")
    parser.add_argument("--merge", action="store_true", help="keep the saved rows of other points")
    parser.add_argument("--render", action="store_true", help="re-write NAME.md from NAME.json, planning nothing")
    args = parser.parse_args(argv)
    header = machine_line(f"Long context, simulated ({args.model}, dgx-h100, bf16; autopar's cost model)")
    if args.render:
        print(f"wrote {write(args.name, header.replace('simulated', 'simulated, re-rendered'), saved(args.name))}")
        return 0
    rows = saved(args.name) if args.merge else []
    for point in args.points:
        row = run_point(point, args.model, lambda line: print(line, file=sys.stderr, flush=True))
        rows = [r for r in rows if (r["point"], r["model"]) != (point, args.model)] + [row]
        path = write(args.name, header, rows)
    print(f"{header}\n\n{table(rows)}\n\n{summary(rows)}\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
