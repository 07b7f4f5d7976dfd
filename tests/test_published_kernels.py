"""The GPU presets' measured kernel rates and the calibration's re-pricing of kernels a published run's system
ran differently from autopar's eager runtime, on small planned GPTs with hand-computable differences:
Megatron-LM's fused scale-mask-softmax (no separate ``masked_fill`` over the scores), llm-foundry's
FlashAttention-1-level Triton attention, and amp rows captured with fp32 weights under autocast."""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from autopar.cost_models.compute import ATTENTION_RATE, attention_kernel, compute_time, node_flops
from autopar.hardware import presets
from autopar.hardware.cluster import Cluster
from autopar.passes.capture import capture
from autopar.placement import R
from autopar.planner.driver import PlanOptions, plan_graph
from benchmarks.calibration.published_schedule import (
    attention_extra_seconds,
    published_prediction,
    score_mask_seconds,
)
from examples.gpt import GPT, GPTConfig, make_batch

GPU_PRESETS = ("p3.16xlarge", "dgx-a100", "dgx-h100", "grand-teton-h100", "a100-40gb", "l4")


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_gpu_presets_stream_norms_at_the_h100_measured_share_of_their_hbm_peak(name):
    """norm_act_bandwidth = (1598 / 3350) × HBM peak (the preset's streaming bandwidth over STREAM_FRACTION);
    flash attention at the H100's measured 0.41 of the matmul rate on H100 parts, the default elsewhere."""
    cluster = Cluster.preset(name)
    peak = cluster.memory_bandwidth / presets.STREAM_FRACTION
    assert cluster.norm_act_bandwidth == pytest.approx(peak * 1598 / 3350)
    assert cluster.norm_act_bandwidth < cluster.memory_bandwidth
    assert cluster.attention_efficiency == (0.41 if "h100" in name else 0.0)


def _node_time(node, cluster):
    vals = [a.meta["val"] for a in node.args if isinstance(a, torch.fx.Node)]
    strategy = types.SimpleNamespace(work_fraction=1.0, in_specs=[(R,) * v.dim() for v in vals],
                                     out_spec=(R,) * node.meta["val"].dim())
    return compute_time(node, strategy, vals, [node.meta["val"]], (1, 1), cluster, differentiable=True)


def test_a_preset_prices_layer_norm_slower_than_an_add_of_the_same_bytes():
    """On dgx-a100 a LayerNorm moving the bytes an add moves takes memory_bandwidth / norm_act_bandwidth
    (0.85 / 0.477) times as long; with the rate unset (negative control) the two cost the same."""
    class LnAdd(torch.nn.Module):
        def forward(self, x, y):
            return torch.nn.functional.layer_norm(x, (64,)) + (x + y)

    with torch.device("meta"):
        graph = capture(LnAdd(), (torch.empty(512, 64, device="meta"), torch.empty(512, 64, device="meta")))
    nodes = [n for n in graph.gm.graph.nodes if n.op == "call_function"]
    ln, add = nodes[0], nodes[1]  # layer_norm(x) reads x, writes one x; the first add reads two, writes one
    cluster = Cluster.preset("dgx-a100", gpus=1)
    ratio = _node_time(ln, cluster) / _node_time(add, cluster) * 3 / 2  # ln moves 2 tensors, add 3
    assert ratio == pytest.approx(cluster.memory_bandwidth / cluster.norm_act_bandwidth)
    flat = dataclasses.replace(cluster, norm_act_bandwidth=0.0)
    assert _node_time(ln, flat) / _node_time(add, flat) * 3 / 2 == pytest.approx(1.0)


CFG = dict(vocab_size=128, seq_len=64, n_layer=2, n_head=4, n_embd=64, dropout=0.0)


def _planned(attention: str, dtype, microbatches: int = 2):
    cfg = GPTConfig(**CFG, attention=attention)
    with torch.device("meta"):
        model = GPT(cfg).to(dtype)
    graph = capture(model, make_batch(cfg, 8, device="meta"))
    cluster = Cluster.preset("dgx-a100", gpus=1)
    plan = plan_graph(graph, cluster, PlanOptions(stages=1, microbatches=microbatches, recompute="none"),
                      model_name="GPT")
    return graph, cluster, plan


def _run(**fields):
    base = dict(grad_sync="overlapped", recompute="none", fused_softmax=False, attention_kernel="")
    return types.SimpleNamespace(**{**base, **fields})


def test_fused_softmax_takes_the_score_masked_fill_out_of_each_microbatch():
    """Materialized attention, fp16, batch 8 in 2 microbatches: each layer's masked_fill reads the [8, 4, 64, 64]
    scores and the [64, 64] bool mask and writes the scores, 3 times with backward, at the preset's streaming
    bandwidth × its compute_time_scale. The fused row's step is the plan's less all of it (one stage: the
    microbatches run back to back)."""
    graph, cluster, plan = _planned("materialized", torch.float16)
    scores = 8 * 4 * 64 * 64 * 2
    per_layer = 3 * (2 * scores + 64 * 64) / cluster.memory_bandwidth * cluster.compute_time_scale
    stage = plan.stages[0]
    assert score_mask_seconds(stage, graph, cluster) == pytest.approx(2 * per_layer)  # 2 layers
    fused = published_prediction(plan, _run(fused_softmax=True), graph)["step_time"]
    assert plan.predicted["step_time"] - fused == pytest.approx(2 * per_layer, rel=1e-6)
    # negative controls: a row without the fused kernel keeps the plan's step; SDPA has no score masked_fill
    assert published_prediction(plan, _run(), graph)["step_time"] == plan.predicted["step_time"]
    sdpa_graph, _, sdpa_plan = _planned("sdpa", torch.float16)
    assert score_mask_seconds(sdpa_plan.stages[0], sdpa_graph, cluster) == 0.0


def test_a_flash_attention_1_level_kernel_adds_its_rate_gap_to_the_flash_price():
    """bf16 causal SDPA on dgx-a100 is priced as flash (rate 0.75 of the curve); the run's "efficient" kernel
    (0.38, FlashAttention-1's 25-40 % of peak over the GEMM's 85.9 %) takes 0.75 / 0.38 ≈ 2 times as long:
    the extra is the planned attention seconds times that less one, split between forward and backward as the
    attention's FLOPs are (flop_counter's); run as flash (negative control) nothing changes."""
    graph, cluster, plan = _planned("sdpa", torch.bfloat16)
    stage = plan.stages[0]
    attention = [n for n in graph.gm.graph.nodes if n.name in stage.nodes and attention_kernel(n, cluster)]
    assert len(attention) == 2 and all(attention_kernel(n, cluster) == "flash" for n in attention)
    fwd, bwd = attention_extra_seconds(stage, graph, cluster, "efficient")
    planned = sum(_node_time(n, cluster) for n in attention)
    assert fwd + bwd == pytest.approx(planned * (ATTENTION_RATE["flash"] / ATTENTION_RATE["efficient"] - 1))
    f, b = node_flops(attention[0])
    assert b > f > 0 and bwd / fwd == pytest.approx(b / f)
    slower = published_prediction(plan, _run(attention_kernel="efficient"), graph)["step_time"]
    assert slower == pytest.approx(plan.predicted["step_time"] + fwd + bwd, rel=1e-6)
    assert attention_extra_seconds(stage, graph, cluster, "flash") == (0.0, 0.0)


def test_amp_rows_capture_fp32_weights_with_bf16_matmuls():
    """An amp row (llm-foundry's amp_bf16) is captured with fp32 parameters and relabelled under the bf16
    autocast policy: its linears compute in bf16, its loss in fp32; a bf16 row keeps bf16 everywhere."""
    from benchmarks.calibration.calibration import capture_run
    from benchmarks.calibration.published import RUNS

    foundry = next(r for r in RUNS if r.name == "foundry 125M@8")
    assert foundry.amp and not foundry.memory_checked and foundry.attention_kernel == "efficient"
    small = dict(hidden=64, layers=2, heads=4, seq=64, vocab=128, batch=8)
    for amp, weights in ((True, torch.float32), (False, torch.bfloat16)):
        graph = capture_run(dataclasses.replace(foundry, amp=amp, **small))
        nodes = list(graph.gm.graph.nodes)
        params = [n for n in nodes if n.op == "placeholder" and n.name.startswith("p_")]
        assert {n.meta["val"].dtype for n in params} == {weights}
        linears = [n for n in nodes if "linear" in str(n.target)]
        assert linears and {n.meta["val"].dtype for n in linears} == {torch.bfloat16}
