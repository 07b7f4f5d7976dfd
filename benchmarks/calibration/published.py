"""Published GPT training runs with their exact layouts: the rows ``calibration.py`` predicts.

Every row's throughput is the published per-GPU TFLOP/s, counted with the formula its source uses, which for
all rows here includes the recomputed forward (Narayanan et al. 2021, eq. 3; Alpa's ``compute_gpt_tflops``
with checkpoint_activations=True, the same expression):

    F = 96 · B · s · l · h² · (1 + s / (6h) + V / (16 · l · h))      (B global batch, s sequence, l layers,
                                                                       h hidden, V vocabulary)
    published step time = F / (TFLOP/s per GPU · 1e12 · GPUs)

Sources
* ALPA: alpa-projects/alpa, osdi22_artifact/results_e2e.tsv (the data of OSDI'22 Fig. 7a; p3.16xlarge, fp16,
  seq 1024, vocab 51200, activation recompute on). Megatron layouts: osdi22_artifact/megatron/benchmark_gpt.py
  ``gpt_megatron_best_suite`` (dp, tp, pp, microbatches; --checkpoint-activations, --fp16). Alpa layouts:
  osdi22_artifact/suite_artifact_e2e_gpt.py ``artifact_result_e2e_gpt_suite`` (layer clusters per stage,
  submesh, logical mesh, batch dim forced to mesh dim 0, remat on). The TSV's 2-GPU Megatron row (760M) and both
  64-GPU rows (39B) have no layout in the artifact and are left out.
* SC21: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
  SC'21, Table 1 (DGX A100 80 GB, fp16, seq 2048, vocab 51200); layouts (tp, pp, micro-batch size, global
  batch, nodes, recompute) from NVIDIA/Megatron-LM examples/sc21/run_table_1.sh. Rows from 76B on use the
  interleaved schedule, which autopar does not plan yet: left out.
* TITAN: pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (commit 31a17bf of that file; runs of
  torchtitan 9dec370, torch 1963fc8, December 2024): Llama 3.1 8B, sequence 8192 (torchtitan's llama3_8b.toml),
  bf16 parameters with fp32 gradient reduction (FSDP2's MixedPrecisionPolicy as torchtitan sets it), eager
  (no torch.compile, no Float8), selective activation checkpointing "op" (every second ``mm`` of a block and
  the attention outputs saved, the rest recomputed in backward), tokens/s per GPU. Table 1: 8 GPUs, local
  batch 2 (global 16): 5,762; Table 3: 128 GPUs, local batch 2 (global 256): 5,605. Hardware (the file's
  "Hardware"): Grand Teton hosts, 8 H100 per host fully connected with NVLink, 96 GB HBM2e at 2.4 TB/s, 500 W
  power limit, 400 Gb/s RDMA per GPU: the ``grand-teton-h100`` preset. Published TFLOP/s per GPU is
  torchtitan's count, tokens/s × (6 · non-embedding parameters + 12 · layers · hidden · sequence).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """One published run. layout: "megatron" (dp, tp, pp, microbatches) or "alpa" (``stages``: per stage
    (first layer, last layer, submesh [nodes, width], logical mesh), ``layers`` clusters of blocks);
    role: "fit" rows set the preset's compute_time_scale, "holdout" rows only check it. grad_sync: "overlapped"
    (torch DDP, and Alpa's, whose all-reduce the planner prices as its own) or "after_backward" (Megatron's
    ``--DDP-impl local``: the artifact's benchmark_gpt_one_case.py always uses it; run_table_1.sh from 39B).
    The fit rows are one system's runs per GPU type (Megatron's on p3.16xlarge, SC'21's two smallest on DGX
    A100); the hold-out rows are the other system's plans on the same GPUs (Alpa's) and the larger SC'21
    layouts (tp 4-8, pp 2). model: "gpt" (``examples.gpt``) or a key of ``LLAMAS``; zero: the ZeRO level of
    every parameter (3: FSDP); layout "fsdp": data parallel over every GPU, every weight replicated over the
    batch shards (ZeRO-3 shards their storage). tokens_per_s: the published tokens/s per GPU, where that is the
    published figure (``tflops`` is then derived from it)."""

    name: str
    source: str
    preset: str
    gpus: int
    hidden: int
    layers: int
    heads: int
    seq: int
    vocab: int
    batch: int
    microbatches: int
    tflops: float
    layout: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    alpa_layers: int = 0
    stages: tuple = ()
    recompute: str = "full"
    precision: str = "fp16"
    schedule: str = "1f1b"
    role: str = "holdout"
    grad_sync: str = "overlapped"
    model: str = "gpt"
    zero: int = 0
    tokens_per_s: float = 0.0
    amp: bool = False  # fp32 weights, ops under bf16/fp16 autocast (torch.amp; llm-foundry's amp_bf16)
    memory_checked: bool = True  # False: planned without the memory bound (calibration.cluster_for)
    attention_kernel: str = ""  # the run's fused attention where not SDPA's pick (published_schedule)
    fused_softmax: bool = False  # the run's softmax applies the causal mask in-kernel (published_schedule)
    attention: str = "materialized"  # GPT rows: ``examples.gpt.GPTConfig.attention`` as the run's system ran it
    dropout: float = 0.1


def _alpa_stage(first, last, submesh, mesh):
    return (first, last, tuple(submesh), tuple(mesh))


ALPA = "Alpa OSDI'22 artifact results_e2e.tsv"
SC21 = "Megatron-LM SC'21 Table 1"
P3, A100 = "p3.16xlarge", "dgx-a100"
GPT_1024 = dict(seq=1024, vocab=51200)
GPT_2048 = dict(seq=2048, vocab=51200)

RUNS = [
    # Megatron on p3.16xlarge (benchmark_gpt.py best layouts; schedule: Megatron's 1F1B; uniform recompute; local DDP).
    Run(name="megatron 350M@1", source=ALPA, preset=P3, gpus=1, hidden=1024, layers=24, heads=16, **GPT_1024,
        batch=128, microbatches=8, tflops=47.53, layout="megatron", role="fit",
        grad_sync="after_backward"),
    Run(name="megatron 1.3B@4", source=ALPA, preset=P3, gpus=4, hidden=2048, layers=24, heads=32, **GPT_1024,
        batch=1024, microbatches=128, tflops=55.89, layout="megatron", dp=2, pp=2, role="fit",
        grad_sync="after_backward"),
    Run(name="megatron 2.6B@8", source=ALPA, preset=P3, gpus=8, hidden=2560, layers=32, heads=32, **GPT_1024,
        batch=1024, microbatches=128, tflops=50.44, layout="megatron", pp=8, role="fit",
        grad_sync="after_backward"),
    Run(name="megatron 6.7B@16", source=ALPA, preset=P3, gpus=16, hidden=4096, layers=32, heads=32, **GPT_1024,
        batch=1024, microbatches=256, tflops=56.59, layout="megatron", tp=2, pp=8, role="fit",
        grad_sync="after_backward"),
    Run(name="megatron 15B@32", source=ALPA, preset=P3, gpus=32, hidden=5120, layers=48, heads=40, **GPT_1024,
        batch=1024, microbatches=256, tflops=58.24, layout="megatron", tp=4, pp=8, role="fit",
        grad_sync="after_backward"),
    # Alpa's own plans (manual_gpipe stages of the artifact; GPipe schedule, remat on).
    # One stage, so the layer count only sets the recompute regions: one per transformer layer, as Alpa's
    # GPT remats each layer (with one layer for the whole model, backward would replay all of it at once).
    Run(name="alpa 350M@1", source=ALPA, preset=P3, gpus=1, hidden=1024, layers=24, heads=16, **GPT_1024,
        batch=1024, microbatches=64, tflops=45.07, layout="alpa", alpa_layers=24, schedule="gpipe",
        stages=(_alpa_stage(0, 23, [1, 1], [1, 1]),)),
    Run(name="alpa 760M@2", source=ALPA, preset=P3, gpus=2, hidden=1536, layers=24, heads=16, **GPT_1024,
        batch=1024, microbatches=128, tflops=57.92, layout="alpa", alpa_layers=6, schedule="gpipe",
        stages=(_alpa_stage(0, 2, [1, 1], [1, 1]), _alpa_stage(3, 5, [1, 1], [1, 1]))),
    Run(name="alpa 1.3B@4", source=ALPA, preset=P3, gpus=4, hidden=2048, layers=24, heads=32, **GPT_1024,
        batch=1024, microbatches=128, tflops=58.21, layout="alpa", alpa_layers=6, schedule="gpipe",
        stages=(_alpa_stage(0, 2, [1, 2], [2, 1]), _alpa_stage(3, 5, [1, 2], [2, 1]))),
    Run(name="alpa 2.6B@8", source=ALPA, preset=P3, gpus=8, hidden=2560, layers=32, heads=32, **GPT_1024,
        batch=1024, microbatches=128, tflops=61.61, layout="alpa", alpa_layers=8, schedule="gpipe",
        stages=(_alpa_stage(0, 1, [1, 2], [2, 1]), _alpa_stage(2, 3, [1, 2], [2, 1]),
                _alpa_stage(4, 7, [1, 4], [4, 1]))),
    Run(name="alpa 6.7B@16", source=ALPA, preset=P3, gpus=16, hidden=4096, layers=32, heads=32, **GPT_1024,
        batch=1024, microbatches=64, tflops=60.0, layout="alpa", alpa_layers=8, schedule="gpipe",
        stages=(_alpa_stage(0, 3, [1, 8], [2, 4]), _alpa_stage(4, 7, [1, 8], [2, 4]))),
    Run(name="alpa 15B@32", source=ALPA, preset=P3, gpus=32, hidden=5120, layers=48, heads=40, **GPT_1024,
        batch=1024, microbatches=128, tflops=59.9, layout="alpa", alpa_layers=16, schedule="gpipe",
        stages=tuple(_alpa_stage(4 * i, 4 * i + 3, [1, 8], [2, 4]) for i in range(4))),
    # Megatron-LM SC'21 Table 1 on DGX A100 (run_table_1.sh: dp = GPUs / (tp · pp), microbatches = GBS / (dp · MBS);
    # DDP=torch up to 18B, DDP=local for 39B).
    Run(name="sc21 1.7B@32", source=SC21, preset=A100, gpus=32, hidden=2304, layers=24, heads=24, **GPT_2048,
        batch=512, microbatches=1, tflops=137, layout="megatron", dp=32, role="fit"),
    Run(name="sc21 3.6B@64", source=SC21, preset=A100, gpus=64, hidden=3072, layers=30, heads=32, **GPT_2048,
        batch=512, microbatches=1, tflops=138, layout="megatron", dp=32, tp=2, role="fit"),
    Run(name="sc21 7.5B@128", source=SC21, preset=A100, gpus=128, hidden=4096, layers=36, heads=32, **GPT_2048,
        batch=512, microbatches=1, tflops=142, layout="megatron", dp=32, tp=4),
    Run(name="sc21 18B@256", source=SC21, preset=A100, gpus=256, hidden=6144, layers=40, heads=48, **GPT_2048,
        batch=1024, microbatches=4, tflops=135, layout="megatron", dp=32, tp=8),
    Run(name="sc21 39B@512", source=SC21, preset=A100, gpus=512, hidden=8192, layers=48, heads=64, **GPT_2048,
        batch=1536, microbatches=12, tflops=138, layout="megatron", dp=32, tp=8, pp=2,
        grad_sync="after_backward"),
]

# Megatron-LM (FusedScaleMaskSoftmax, --masked-softmax-fusion on by default) and Alpa (XLA fusion) apply the
# causal mask inside the softmax kernel: re-priced by published_schedule ("Fused scale-mask-softmax").
RUNS = [dataclasses.replace(r, fused_softmax=True) for r in RUNS]

# Llama configurations (Hugging Face ``LlamaConfig`` fields; meta-llama/Llama-3.1-8B's config.json).
LLAMAS = {"llama3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0)}


def llama_non_embedding_params(name: str) -> int:
    """Parameters less the input embedding (torchtitan's count): per block q, o (h²), k, v (h · h·kv/heads),
    the three MLP matrices (3 · h · ffn) and two norms; then the final norm and the output projection."""
    c = LLAMAS[name]
    h, ffn, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"]
    block = 2 * h * h + 2 * h * (h * kv // c["num_attention_heads"]) + 3 * h * ffn + 2 * h
    return c["num_hidden_layers"] * block + h + h * c["vocab_size"]


def titan_tflops(name: str, seq: int, tokens_per_s: float) -> float:
    """torchtitan's model TFLOP/s per GPU: tokens/s × (6 · non-embedding parameters + 12 · l · h · s)."""
    c = LLAMAS[name]
    per_token = 6 * llama_non_embedding_params(name) + 12 * c["num_hidden_layers"] * c["hidden_size"] * seq
    return tokens_per_s * per_token / 1e12


TITAN = "torchtitan llama3_h100_202412 (Grand Teton H100)"
LLAMA_8B = dict(model="llama3.1-8b", hidden=4096, layers=32, heads=32, seq=8192, vocab=128256, microbatches=1,
                layout="fsdp", precision="bf16", zero=3, recompute="op_sac", preset="grand-teton-h100")
RUNS += [
    Run(name="titan 8B@8", source=TITAN, gpus=8, batch=16, tokens_per_s=5762,
        tflops=titan_tflops("llama3.1-8b", 8192, 5762), role="fit", **LLAMA_8B),
    Run(name="titan 8B@128", source=TITAN, gpus=128, batch=256, tokens_per_s=5605,
        tflops=titan_tflops("llama3.1-8b", 8192, 5605), **LLAMA_8B),
]

# MosaicML llm-foundry on 8 A100 80GB (one node, NVLink): MPT models trained with FSDP FULL_SHARD, amp_bf16
# (bf16 autocast over fp32 master weights; FSDP "PURE" keeps the sharded parameters in bf16 for the gathers),
# no activation checkpointing, flash attention, no dropout, no biases, ALiBi instead of learned positions,
# vocabulary 50368 (scripts/train/benchmarking/README.md of mosaicml/llm-foundry, table "A100 80GB with
# 1600 Gbps node-node interconnect (RoCE)", rows at sequence 2048; model shapes from
# scripts/train/yamls/pretrain/mpt-{125m,350m,760m,1b}.yaml). Planned as ``examples.gpt`` with one fused
# attention call (its biases and positional table are < 0.5 % of the FLOPs) and compared on the published
# tokens/s per GPU. All hold-out rows: a system, a parallelism (pure FSDP, no pipeline or tensor parallel)
# and a recompute policy (none) that no fitted row has. As the runs ran: amp (fp32 weights, bf16 autocast:
# the loss's log-softmax over the 50k vocabulary in fp32), the attention kernel MPT's Triton FlashAttention
# with ALiBi (``attn_impl: triton``, the default of llm-foundry's scripts/train/benchmarking/
# submit_benchmarks.py; re-priced in ``published_schedule``), and the memory bound off (``memory_checked``):
# autopar's memory model finds no plan for the 350M and 760M layouts under amp (98 GiB per 80 GB GPU).
FOUNDRY = "llm-foundry MPT benchmarks (A100 80GB table)"
MPT = dict(preset=A100, gpus=8, seq=2048, vocab=50368, layout="fsdp", precision="bf16", amp=True, zero=3,
           recompute="none", attention="sdpa", attention_kernel="efficient", dropout=0.0, memory_checked=False)
RUNS += [
    Run(name="foundry 125M@8", source=FOUNDRY, hidden=768, layers=12, heads=12, batch=512, microbatches=2,
        tokens_per_s=141737, tflops=0.4445 * 312, **MPT),
    Run(name="foundry 350M@8", source=FOUNDRY, hidden=1024, layers=24, heads=16, batch=512, microbatches=2,
        tokens_per_s=58782, tflops=0.5162 * 312, **MPT),
    Run(name="foundry 760M@8", source=FOUNDRY, hidden=1536, layers=24, heads=12, batch=384, microbatches=2,
        tokens_per_s=32434, tflops=0.5685 * 312, **MPT),
    Run(name="foundry 1.3B@8", source=FOUNDRY, hidden=2048, layers=24, heads=16, batch=448, microbatches=4,
        tokens_per_s=20513, tflops=0.5986 * 312, **MPT),
]

# Published but not predicted yet, with what is missing.
PENDING = [
    ("torchtitan Llama 3.1 8B with torch.compile or Float8 (Tables 1-3), 70B and 405B (Tables 4-6)",
     "compiled kernels and fp8 matmuls are not priced; the 70B/405B runs also use torch.compile and Float8"),
    ("Megatron-LM SC'21 Table 1 76B@1024 ... 1T@3072 (DGX A100)", "interleaved 1F1B schedule"),
    ("Alpa artifact 39B@64 (Megatron 57.84, Alpa 57 TFLOP/s) and Megatron 760M@2 (55.53)", "no layout published"),
]


def model_flops(run: Run) -> float:
    """F of the module docstring: FLOPs of one iteration, recomputed forward included (GPT rows); Llama rows:
    torchtitan's count, which leaves recompute out."""
    if run.model != "gpt":
        return run.tflops * 1e12 * run.gpus * published_step_time(run)
    b, s, layers, h, v = run.batch, run.seq, run.layers, run.hidden, run.vocab
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def published_step_time(run: Run) -> float:
    if run.tokens_per_s:
        return run.batch * run.seq / (run.tokens_per_s * run.gpus)
    return model_flops(run) / (run.tflops * 1e12 * run.gpus)
