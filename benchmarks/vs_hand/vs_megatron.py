"""autopar against hand-written layouts: Megatron-LM's grid on GPT, DP×PP on Wide-ResNet, DP×EP×PP on MoE.

    python benchmarks/vs_megatron.py --simulate                      # Alpa's suites, cost model (~1 h on 2 cores)
    python benchmarks/vs_megatron.py --simulate --points gpt:1.3B:4:p3.16xlarge moe:2.4B:8:p3.16xlarge
    python benchmarks/vs_megatron.py --simulate --precision fp16     # fp32 master weights, fp16 compute, both sides
    python benchmarks/vs_megatron.py --simulate --precision fp16 --merge --points gpt:39B:64:p3.16xlarge
    python benchmarks/vs_megatron.py --simulate --suite mist [--grid full]   # Mist's points, L4 and A100 40 GB
    python benchmarks/vs_megatron.py --simulate --suite moe          # GShard MoE + Mixtral-8x7B vs DP×EP×PP
    python benchmarks/vs_megatron.py --local --nprocs 2 [--cluster cluster.json]   # measured on 2 gloo ranks
    python benchmarks/vs_megatron.py --from-json benchmarks/results/vs_megatron_simulate.json  # re-render
    python benchmarks/vs_megatron.py --replan --precision fp16   # saved rows: autopar side planned again

--simulate: for every point MODEL:NAME:GPUS:PRESET, the best hand configuration of a grid search and
autopar's own plan (``autopar.plan(model, cluster, batch)``, default options) are both scored by autopar's
cost model on the meta device, so the comparison is apples to apples (``benchmarks/megatron_configs.py``
and ``benchmarks/hand_grids.py`` say how a hand configuration becomes a plan). GPT throughput uses
Megatron's FLOP count, 72·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)), for both sides; Wide-ResNet and MoE use the
captured graph's forward + backward FLOPs (torch.utils.flop_counter). The ratio autopar/hand is a
throughput ratio (higher is better; = hand step time / autopar step time).

Memory ignored: every hand configuration without recompute is planned again at a budget no device binds
(``hand_search.search_hand``). The fastest of them is the ceiling: (best hand layout that fits) / (fastest
with memory ignored), as a throughput ratio, is the most any planner that shares the cost model can gain
over the hand grid from memory levers alone. Memory binds at a point when it changes the hand grid's
answer: a configuration that does not fit beats the fastest one that does once memory is ignored, or
nothing fits. The summary line's geometric mean is over those points. Every point is written as soon as it is done
(``--merge`` keeps the saved points it does not run).

Points: Alpa's GPT weak-scaling suite (examples.gpt.GPT_SUITE: 350M on 1 GPU ... 39B on 64, seq 1024,
vocab 51200, global batch 1024, fp16) on "p3.16xlarge" (8× V100 per node, 25 Gbps between nodes) and
"dgx-a100"; Megatron-LM SC'21 Table 1 rows (examples.gpt.SC21_TABLE1, family "sc21": seq 2048, their
published global batch and GPU count, DGX A100), by default the two that plan within about 15 minutes each
(1.7B on 32 GPUs, 3.6B on 64); Wide-ResNet (examples/wide_resnet.py, fp32, batch 1536) and GShard MoE
(examples/moe.py, fp16, batch 1024) at Alpa's 8- and 16-GPU weak-scaling points on p3.16xlarge.

--precision fp16|bf16: the models stay float32 (master weights and optimizer state in fp32, as Megatron and
Alpa train) and both sides plan under that mixed-precision policy; without it GPT and MoE are cast to fp16
whole (weights, gradients and optimizer state in fp16: the memory of neither real system).

--suite mist: the hardware and shapes of Mist's evaluation (Zhu et al., EuroSys'25): GPT-3-shaped models (the
sizes of Alpa's suite nearest Mist's 1.3B-22B) and Llama-style ones (family "mistllama": HF LlamaForCausalLM at
those sizes, ``llama_workload``; Megatron's layout by Llama's names, ``megatron_configs.LLAMA_NAMES``) on "l4"
(24 GB, sequence 2048) and "a100-40gb" (sequence 4096), 2-32 GPUs, global batch 16 per GPU, bf16 mixed precision;
autopar plans with ``offload="auto"``. ``--grid mist`` (the default there) scores Mist's Megatron baseline
(``megatron_configs.mist_grid``: full recompute, distributed optimizer, powers of two, micro-batch 1/2/4);
``--grid full`` the repository's grid. Megatron's sequence parallelism needs no grid entry: the activations of
every hand layout are placed by the ILP, which may split the residual stream over the sequence between
tensor-parallel blocks (tests/test_context_parallel.py pins and checks that layout).
``benchmarks/vs_hand/mist_report.py`` puts the sweeps of both grids in one table, scored against the issue's goals.

--suite moe: mixture-of-experts points against the hand grid with all-to-all expert parallelism (DP × EP × PP,
``hand_grids.moe_pins``: Megatron / DeepSpeed-MoE / GShard style): the GShard-style example at Alpa's 8- and
16-GPU points on "p3.16xlarge" (fp16 whole) and a Mixtral-8x7B-sized Hugging Face model (32 layers, hidden 4096,
8 experts top-2, sequence 4096, global batch 256, bf16 whole; ``examples.hf_causal_lm.MIXTRAL_8X7B``) on 16 and
32 GPUs of "dgx-h100"; name "8x7B-L<n>" keeps n of its layers. The summary adds the geometric mean over every
point against the 1.5× goal. Results: benchmarks/results/vs_megatron_moe.{md,json,png}.

--local: see ``benchmarks/vs_megatron_local.py``. Both modes print a markdown table, write it with a PNG
chart under benchmarks/results/, and end with the line "min speedup vs hand: X".
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import autopar  # noqa: E402
from autopar.baselines import hand_grids, megatron_configs  # noqa: E402
from autopar.errors import InfeasibleError  # noqa: E402
from benchmarks.vs_hand import vs_megatron_moe as moe_points  # noqa: E402
from benchmarks.vs_hand import vs_megatron_report as report  # noqa: E402

GPT_POINTS = [("350M", 1), ("1.3B", 4), ("2.6B", 8), ("6.7B", 16), ("15B", 32), ("39B", 64)]
PRESETS = ("p3.16xlarge", "dgx-a100")
SC21_POINTS = ["sc21:1.7B:32:dgx-a100", "sc21:3.6B:64:dgx-a100"]
OTHER_POINTS = ["wrn:2B:8:p3.16xlarge", "wrn:4B:16:p3.16xlarge", "moe:2.4B:8:p3.16xlarge", "moe:10B:16:p3.16xlarge"]
DEFAULT_POINTS = [f"gpt:{n}:{g}:{p}" for p in PRESETS for n, g in GPT_POINTS] + SC21_POINTS + OTHER_POINTS
GLOBAL_BATCH = {"gpt": 1024, "wrn": 1536, "moe": 1024, "mixtral": 256}
MIST_SEQ = {"l4": 2048, "a100-40gb": 4096}
MIST_BATCH_PER_GPU = 16
MIST_POINTS = [f"mist:{n}:{g}:l4" for n, g in [("1.3B", 2), ("2.6B", 4), ("6.7B", 8), ("15B", 16)]] + \
    [f"mist:{n}:{g}:a100-40gb" for n, g in [("1.3B", 4), ("2.6B", 8), ("6.7B", 16), ("15B", 32)]] + \
    [f"mistllama:{n}:{g}:l4" for n, g in [("1.3B", 2), ("2.6B", 4), ("6.7B", 8)]] + \
    [f"mistllama:{n}:{g}:a100-40gb" for n, g in [("1.3B", 4), ("2.6B", 8)]]


@dataclasses.dataclass
class Workload:
    """A model on the meta device, its global batch, and its FLOPs per training step."""

    family: str
    name: str
    model: torch.nn.Module
    batch: tuple
    flops: float


def build_workload(family: str, name: str, precision: str | None = None, preset: str = "", gpus: int = 0) -> Workload:
    """``precision`` None casts GPT and MoE to fp16 whole; a policy name keeps them float32 (module docstring).
    Family "mist": ``preset`` and ``gpus`` give the sequence and the global batch (``MIST_SEQ``)."""
    cast = (lambda m: m.half()) if precision is None else (lambda m: m)
    if family == "mistllama":
        return llama_workload(name, MIST_SEQ[preset], MIST_BATCH_PER_GPU * gpus)
    if family == "mist":
        from examples.gpt import GPT, make_batch, suite_config

        cfg, batch_size = suite_config(name, seq_len=MIST_SEQ[preset]), MIST_BATCH_PER_GPU * gpus
        with torch.device("meta"):
            model = cast(GPT(cfg))
        return Workload(family, name, model, make_batch(cfg, batch_size, device="meta"),
                        megatron_configs.gpt_flops(cfg, batch_size))
    if family in ("gpt", "sc21"):
        from examples.gpt import GPT, SC21_TABLE1, make_batch, sc21_config, suite_config

        cfg = suite_config(name) if family == "gpt" else sc21_config(name)
        batch_size = GLOBAL_BATCH["gpt"] if family == "gpt" else SC21_TABLE1[name][3]
        with torch.device("meta"):
            model = cast(GPT(cfg))
        return Workload(family, name, model, make_batch(cfg, batch_size, device="meta"),
                        megatron_configs.gpt_flops(cfg, batch_size))
    batch_size = GLOBAL_BATCH[family]
    if family == "mixtral":
        model, batch = moe_points.mixtral(name, batch_size, torch.bfloat16 if precision is None else torch.float32)
        return Workload(family, name, model, batch, graph_flops(model, batch))
    if family == "wrn":
        from examples.wide_resnet import WideResNet, make_batch, suite_config

        cfg = suite_config(name)
        with torch.device("meta"):
            model = WideResNet(cfg)
    elif family == "moe":
        from examples.moe import MoETransformer, make_batch, suite_config

        cfg = suite_config(name)
        with torch.device("meta"):
            model = cast(MoETransformer(cfg))
    else:
        raise ValueError(f"unknown model family {family!r}; use gpt, sc21, wrn or moe")
    batch = make_batch(cfg, batch_size, device="meta")
    return Workload(family, name, model, batch, graph_flops(model, batch))


def llama_workload(name: str, seq: int, batch_size: int) -> Workload:
    """A Llama-style model (HF ``LlamaForCausalLM``: RMSNorm, rotary positions, SwiGLU MLP of 8h/3 rounded up to a
    multiple of 256, no biases, vocabulary 32000, as Llama 2) at the hidden size, depth and heads of Alpa's GPT
    suite entry ``name``; FLOPs counted on its graph."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from examples.gpt import GPT_SUITE
    from examples.hf_causal_lm import CausalLMLoss

    hidden, layers, heads = GPT_SUITE[name]
    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=-(-8 * hidden // 3 // 256) * 256,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=seq, use_cache=False, attention_dropout=0.0)
    with torch.device("meta"):
        model = CausalLMLoss(LlamaForCausalLM(cfg))
    ids = torch.zeros(batch_size, seq, dtype=torch.long, device="meta")
    batch = (ids, ids.clone())
    return Workload("mistllama", name, model, batch, graph_flops(model, batch))


def graph_flops(model, batch) -> float:
    """Forward + backward FLOPs of every op of the captured graph (torch.utils.flop_counter's count)."""
    from autopar.cost_models.compute import node_flops
    from autopar.passes.capture import capture

    return sum(sum(node_flops(n)) for n in capture(model, batch).gm.graph.nodes)


def best_hand(work: Workload, cluster, log, precision: str = "fp32",
              time_limit: float = 60.0, grid: str = "full") -> megatron_configs.HandSearch:
    """The family's hand grid searched (best that fits, every config scored, best with memory ignored);
    ``grid``: "full" or "mist" for GPT (``megatron_configs.best_megatron``)."""
    common = dict(log=log, precision=precision, time_limit=time_limit)
    if work.family == "mistllama":
        cfg = work.model.lm.config
        return megatron_configs.best_megatron(work.model, cluster, work.batch, cfg.num_hidden_layers,
                                              cfg.num_attention_heads, grid=grid, names=megatron_configs.LLAMA_NAMES,
                                              **common)
    if work.family in ("gpt", "sc21", "mist"):
        cfg = work.model.cfg
        return megatron_configs.best_megatron(work.model, cluster, work.batch, cfg.n_layer, cfg.n_head, grid=grid,
                                              **common)
    if work.family == "wrn":
        return hand_grids.best_hand(work.model, cluster, work.batch, hand_grids.wrn_pins, **common)
    if work.family == "mixtral":
        return hand_grids.best_hand(work.model, cluster, work.batch, hand_grids.mixtral_pins,
                                    n_experts=work.model.lm.config.num_local_experts, **common)
    return hand_grids.best_hand(work.model, cluster, work.batch, hand_grids.moe_pins,
                                n_experts=work.model.cfg.n_expert, **common)


def run_point(point: str, progress, precision: str | None = None, autopar_options: dict | None = None,
              time_limit: float = 60.0, grid: str = "full", plan_auto: bool = True) -> dict:
    """Both sides of one point; ``autopar_options`` are extra ``autopar.plan`` options (default: none);
    ``time_limit``: every ILP solve's, both sides (a loaded machine can slow a solve past the default)."""
    family, name, gpus, preset = point.split(":")
    cluster = autopar.Cluster.preset(preset, gpus=int(gpus))
    work = build_workload(family, name, precision, preset, int(gpus))
    policy = precision or "fp32"
    start, cpu = time.perf_counter(), cpu_seconds()
    search = best_hand(work, cluster, log=lambda r: progress(f"  {point} hand {r.config}: "
                                                             f"{r.status} {r.step_time or ''}"), precision=policy,
                       time_limit=time_limit, grid=grid)
    best, unbounded = search.best, search.unbounded
    grid_s, grid_cpu_s = time.perf_counter() - start, cpu_seconds() - cpu
    options = {"time_limit": time_limit, **(autopar_options or {})}
    auto_step, auto_desc, plan_s = plan_autopar(work, cluster, policy, options) if plan_auto else \
        (None, "not planned (--hand-only: mist_report.py --replan plans it)", 0.0)
    return {"point": point, "family": family, "model": name, "gpus": int(gpus), "cluster": preset,
            "flops": work.flops, "hand": str(best.config) if best else "all OOM",
            "hand_step": best.step_time if best else None, "auto_step": auto_step, "auto_plan": auto_desc,
            "memory_binds": search.memory_binds, "hand_unbounded": str(unbounded.config) if unbounded else None,
            "hand_unbounded_step": unbounded.step_time if unbounded else None, "ceiling": search.ceiling,
            "autopar_options": options, "grid_s": grid_s, "grid_cpu_s": grid_cpu_s,
            "load": os.getloadavg()[0], "plan_s": plan_s, "hand_grid": grid,
            "scored": [(str(s.config), s.status, s.step_time) for s in search.scored],
            "memory_ignored": [(str(s.config), s.status, s.step_time) for s in search.free]}


def cpu_seconds() -> float:
    """CPU seconds of this process and of its reaped children (the grid's forked workers)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def plan_autopar(work: Workload, cluster, policy: str, options: dict) -> tuple[float | None, str, float]:
    """(predicted step s or None, the plan in words or why nothing fits, planning seconds)."""
    start = time.perf_counter()
    try:
        plan = autopar.plan(work.model, cluster, work.batch, precision=policy, **options)
        auto_step, auto_desc = float(plan.predicted["step_time"]), report.describe_plan(plan)
    except InfeasibleError as e:
        auto_step, auto_desc = None, f"OOM ({e})"
    return auto_step, auto_desc, time.perf_counter() - start


def replan(name: str, precision: str | None, header: str) -> int:
    """Plan the autopar side of every saved row again with this tree, keeping its hand grid: the grid is
    scored with manual stages and fixed microbatches, which a change to the planner's own search (stage
    DP, interleaving, exact re-solves) does not reach. Each row records when it was re-planned."""
    rows = saved_rows(name)
    for row in rows:
        family, model, gpus, preset = row["point"].split(":")
        work = build_workload(family, model, precision, preset, int(gpus))
        options = dict(row["autopar_options"])
        if options.get("schedule") == "auto":  # the default now
            del options["schedule"]
        row["auto_step"], row["auto_plan"], row["plan_s"] = plan_autopar(
            work, autopar.Cluster.preset(preset, gpus=int(gpus)), precision or "fp32", options)
        row["autopar_options"], row["replanned"] = options, report.machine_line("re-planned")
        print("| " + " | ".join(str(c) for c in table_row(row)) + " |", flush=True)
    return render_simulation(header, rows, name)


def ratio(row: dict) -> float | None:
    if row["hand_step"] is None or row["auto_step"] is None:
        return None
    return row["hand_step"] / row["auto_step"]


def pflops(row: dict, key: str) -> float:
    return row["flops"] / row[key] / 1e15 if row[key] else 0.0


HEADERS = ["model", "GPUs", "cluster", "best hand layout", "hand PFLOP/s", "autopar PFLOP/s", "autopar plan",
           "autopar / hand", "memory binds", "ceiling (fastest hand layout, memory ignored)",
           "configs scored (OOM, skipped by floor) + memory ignored (skipped)", "grid s (CPU s, load)",
           "autopar plan s"]


def table_row(row: dict) -> list:
    r = ratio(row)
    label = {"gpt": "GPT", "sc21": "GPT (SC'21)", "wrn": "Wide-ResNet", "moe": "MoE", "mist": "GPT-3 (Mist)",
             "mistllama": "Llama-style (Mist)", "mixtral": "Mixtral"}[
        row["family"]]
    return [f"{label} {row['model']}", row["gpus"], row["cluster"], row["hand"], f"{pflops(row, 'hand_step'):.3f}",
            f"{pflops(row, 'auto_step'):.3f}", row["auto_plan"], f"{r:.3f}" if r else "n/a", binds_cell(row),
            ceiling_cell(row), configs_cell(row),
            grid_cell(row), f"{row['plan_s']:.0f}"]


def grid_cell(row: dict) -> str:
    """'472 (160 CPU, load 9.8)': the grid's wall seconds, with its CPU seconds and load where recorded."""
    if "grid_cpu_s" not in row:
        return f"{row['grid_s']:.0f}"
    return f"{row['grid_s']:.0f} ({row['grid_cpu_s']:.0f} CPU, load {row['load']:.1f})"


def configs_cell(row: dict) -> str:
    """'582 (201, 95) + 194 (60)': configs of the grid (those out of memory, those the step-time floor ruled out
    unplanned: ``hand_search.SKIPPED``) + memory-free configs searched with memory ignored (ruled out)."""
    def skipped(entries):
        return sum(1 for s in entries if s[1].startswith("skipped"))

    free = row.get("memory_ignored", [])
    oom = sum(1 for s in row["scored"] if s[1] == "OOM")
    return f"{len(row['scored'])} ({oom}, {skipped(row['scored'])}) + {len(free)} ({skipped(free)})"


def ceiling_cell(row: dict) -> str:
    """'1.084 (dp4·tp1·pp1·B2)': best hand that fits / fastest with memory ignored, and that layout."""
    if row.get("ceiling") is None:
        return "n/a"
    return f"{row['ceiling']:.3f} ({row['hand_unbounded']})"


def simulate(points: list[str], precision: str | None = None, merge: bool = False,
             autopar_options: dict | None = None, name: str = "simulate", time_limit: float = 60.0,
             grid: str = "full", plan_auto: bool = True) -> int:
    """Run ``points`` one by one, writing the results after each (a long run keeps what it finished). With
    ``merge`` the rows of the saved JSON stay, each replaced by a new run of its point."""
    policy = f", {precision} mixed precision" if precision else ""
    extra = "".join(f", autopar {k}={v!r}" for k, v in (autopar_options or {}).items())
    header = report.machine_line(f"autopar vs hand-written layouts, simulated (autopar's cost model{policy}{extra}, "
                                 f"ILP time limit {time_limit:.0f} s; hand grid: {grid})")
    print(header)
    print("| " + " | ".join(HEADERS) + " |\n|" + "---|" * len(HEADERS), flush=True)
    rows = saved_rows(name) if merge else []
    for point in points:
        row = run_point(point, progress=lambda line: print(line, file=sys.stderr, flush=True), precision=precision,
                        autopar_options=autopar_options, time_limit=time_limit, grid=grid, plan_auto=plan_auto)
        rows = [r for r in rows if r["point"] != point] + [row]
        print("| " + " | ".join(str(c) for c in table_row(row)) + " |", flush=True)
        render_simulation(header, rows, name)
    return 0


def saved_rows(name: str = "simulate") -> list[dict]:
    path = os.path.join(report.RESULTS, f"vs_megatron_{name}.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)


def render_simulation(header: str, rows: list[dict], name: str = "simulate") -> int:
    """Write the table, the JSON of every scored config and the chart; print the summary line."""
    text = "\n\n".join([header, report.markdown_table(HEADERS, [table_row(r) for r in rows]), _notes()])
    path = report.write_results(name, text, rows)
    labels = [f"{r['family']} {r['model']}/{r['gpus']} {r['cluster'].split('.')[0]}" for r in rows]
    chart = report.throughput_chart(name, labels, [pflops(r, "hand_step") for r in rows],
                                    [pflops(r, "auto_step") for r in rows], "PFLOP/s (predicted)",
                                    "autopar vs best hand layout (autopar's cost model)")
    print(f"\nwrote {path} and {chart}")
    print(report.summary_line([(r["point"], ratio(r)) for r in rows if ratio(r) is not None],
                              {r["point"] for r in rows if memory_binds(r)}))
    if any(r["family"] in moe_points.FAMILIES for r in rows):
        print(moe_points.goal_line([ratio(r) for r in rows if r["family"] in moe_points.FAMILIES]))
    return 0


def binds_cell(row: dict) -> str:
    if not memory_binds(row):
        return "no"
    return "yes" if "memory_binds" in row else "yes (some config OOM)"


def memory_binds(row: dict) -> bool:
    """Memory changes the hand grid's answer at this point: its fastest layout with memory ignored does not
    fit (``HandSearch.memory_binds``). Rows saved before that was recorded fall back to the older, weaker
    test: some configuration of the grid does not fit."""
    if "memory_binds" in row:
        return bool(row["memory_binds"])
    return any(status == "OOM" for _, status, _ in row["scored"])


def _notes() -> str:
    return ("Hand layouts: GPT, Megatron-LM's grid (dp × tp × pp × microbatches × recompute none/selective/full × "
            "distributed optimizer × interleaved virtual stages v ∈ {1, 2, 4}, tp inside a node, blocks split "
            "evenly; Megatron's weight layout, activations placed by the same ILP); Wide-ResNet, DP × PP (FLOP- "
            "or parameter-balanced stages); MoE, DP × expert-parallel × PP. Both sides are scored by autopar's "
            "cost model under the same precision policy. Memory binds: a hand layout that does not fit would "
            "beat the best one that does. Ceiling: best hand layout that fits / fastest hand layout without "
            "recompute with memory ignored (throughput ratio): what memory levers alone can gain. PFLOP/s: "
            "Megatron's FLOP formula for GPT, the graph's counted FLOPs "
            "otherwise.")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--from-json", nargs="+", help="re-render saved --simulate runs (benchmarks/results/"
                      "vs_megatron_simulate.json; several are merged, a later file's point replacing an earlier's) "
                      "without planning again")
    mode.add_argument("--simulate", action="store_true", help="grid search vs autopar.plan on simulated clusters")
    mode.add_argument("--replan", action="store_true", help="plan the autopar side of the saved --simulate rows "
                      "(--name) again, keeping their hand grids (for a change to the planner's own search)")
    mode.add_argument("--local", action="store_true", help="measure hand layouts and autopar on --nprocs gloo ranks")
    parser.add_argument("--points", nargs="+", default=DEFAULT_POINTS, help="FAMILY:NAME:GPUS:PRESET (--simulate)")
    parser.add_argument("--merge", action="store_true", help="--simulate: keep the saved JSON's other points")
    parser.add_argument("--suite", choices=("default", "mist", "moe"), default="default", help="--simulate: the points "
                        "(mist: Mist's hardware and shapes, bf16, autopar with offload='auto'; see above)")
    parser.add_argument("--grid", choices=("full", "mist"), help="--simulate: the GPT hand grid (default: mist "
                        "for --suite mist, else full)")
    parser.add_argument("--hand-only", action="store_true", help="--simulate --suite mist: score the hand grid "
                        "only (autopar's side comes from mist_report.py --replan, once for both grids)")
    parser.add_argument("--name", default="simulate", help="--simulate: results are written as "
                        "benchmarks/results/vs_megatron_NAME.{md,json,png} (two runs side by side need two names)")
    parser.add_argument("--autopar-schedule", choices=("1f1b", "interleaved", "auto"),
                        help="--simulate: autopar's schedule option (default: autopar.plan's default)")
    parser.add_argument("--time-limit", type=float, default=300.0, help="--simulate: every ILP solve's time limit "
                        "in seconds, both sides (default 300: no solve takes a minute on an idle machine, but a "
                        "loaded one can slow one past the planner's default of 60, which would score a hand "
                        "config out of memory)")
    parser.add_argument("--precision", choices=("fp16", "bf16"), help="--simulate: keep the models float32 and "
                        "plan both sides under this mixed-precision policy (default: models cast to fp16 whole)")
    parser.add_argument("--cluster", help="profiled cluster JSON for --local (default: profile now, or reuse "
                                          "benchmarks/results/local4_cluster.json)")
    parser.add_argument("--header", help="--from-json: the header line of the original run")
    parser.add_argument("--nprocs", type=int, default=2, help="--local: gloo ranks (main figure: one per core)")
    parser.add_argument("--rounds", type=int, default=5, help="--local: round-robin rounds over the layouts")
    parser.add_argument("--steps", type=int, default=3, help="--local: timed steps per layout and round")
    args = parser.parse_args(argv)
    if args.from_json:
        rows = {}
        for path in args.from_json:
            with open(path) as f:
                rows.update({r["point"]: r for r in json.load(f)})
        rows = list(rows.values())
        print(report.markdown_table(HEADERS, [table_row(r) for r in rows]))
        return render_simulation(args.header or report.machine_line("autopar vs hand-written layouts, simulated "
                                                                    "(autopar's cost model)"), rows)
    if args.replan:
        return replan(args.name, args.precision, args.header or report.machine_line(
            "autopar vs hand-written layouts, simulated (autopar's cost model"
            + (f", {args.precision} mixed precision" if args.precision else "") + "; autopar side re-planned)"))
    if args.simulate:
        extra = {"schedule": args.autopar_schedule} if args.autopar_schedule else {}
        if args.suite == "moe":
            points = args.points if args.points is not DEFAULT_POINTS else moe_points.POINTS
            name = args.name if args.name != "simulate" else "moe"
            return simulate(points, args.precision, args.merge, extra or None, name, args.time_limit,
                            args.grid or "full")
        if args.suite == "mist":
            points = args.points if args.points is not DEFAULT_POINTS else MIST_POINTS
            name = args.name if args.name != "simulate" else f"mist_{args.grid or 'mist'}"
            return simulate(points, args.precision or "bf16", args.merge, {**extra, "offload": "auto"}, name,
                            args.time_limit, args.grid or "mist", plan_auto=not args.hand_only)
        return simulate(args.points, args.precision, args.merge, extra or None, args.name, args.time_limit,
                        args.grid or "full")
    from benchmarks.vs_hand.vs_megatron_local import measure

    return measure(args.cluster, rounds=args.rounds, steps=args.steps, world=args.nprocs)


if __name__ == "__main__":
    sys.exit(main())
