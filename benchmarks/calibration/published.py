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
* H100: pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1 (Llama 3.1 8B, 8 H100,
  FSDP, local batch 2, selective AC: 5,762 tokens/s/GPU). Listed for completeness, not predicted: it needs
  FSDP (ZeRO-3, the ``zero`` option) and a Llama capture at sequence 8192; see ``PENDING``.
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
    layouts (tp 4-8, pp 2)."""

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
    Run(name="alpa 350M@1", source=ALPA, preset=P3, gpus=1, hidden=1024, layers=24, heads=16, **GPT_1024,
        batch=1024, microbatches=64, tflops=45.07, layout="alpa", alpa_layers=1, schedule="gpipe",
        stages=(_alpa_stage(0, 0, [1, 1], [1, 1]),)),
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

# Published but not predicted yet, with what is missing.
PENDING = [
    ("torchtitan Llama 3.1 8B@8 H100 (FSDP, local batch 2, seq 8192, selective AC): 5,762 tokens/s/GPU",
     "needs zero=3 (FSDP) and selective recompute in the planner, and the Llama capture of the zoo"),
    ("Megatron-LM SC'21 Table 1 76B@1024 ... 1T@3072 (DGX A100)", "interleaved 1F1B schedule"),
    ("Alpa artifact 39B@64 (Megatron 57.84, Alpa 57 TFLOP/s) and Megatron 760M@2 (55.53)", "no layout published"),
]


def model_flops(run: Run) -> float:
    """F of the module docstring: FLOPs of one iteration, recomputed forward included."""
    b, s, layers, h, v = run.batch, run.seq, run.layers, run.hidden, run.vocab
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def published_step_time(run: Run) -> float:
    return model_flops(run) / (run.tflops * 1e12 * run.gpus)
