"""Hand-computable cases for the calibration's cost terms: the scatter/gather pipeline send of Megatron-LM's
published runs, the profiler's end-to-end compute factor, and the fidelity benchmark's medians over launches."""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from autopar.hardware.cluster import Cluster
from autopar.plan import Plan, Stage
from autopar.planner.plan_builder import exposed_sync
from autopar.profiling.probe_step import ProbeShape, end_to_end_factor, probe_step_ops, probe_step_prediction
from benchmarks.calibration.published_schedule import op_sac_share, published_prediction
from benchmarks.fidelity.cost_model_fidelity import drift_corrected
from benchmarks.fidelity.fidelity_report import figures, median_rows


def _one_stage_plan(**predicted) -> Plan:
    base = {"forward": 1.0, "backward": 2.0, "latency": 3.0, "compute": 3.0, "comm": 0.0, "grad_sync": 0.0,
            "memory": 0.0, "peak_memory": 0.0}
    stage = Stage(index=0, ranks=[0], mesh_shape=(1, 1), submesh=(1, 1), nodes=[], shardings={},
                  predicted={**base, **predicted})
    return Plan(model="m", graph_fingerprint="", input_signature=[], cluster={}, stages=[stage],
                predicted={"step_time": -1.0})


def test_published_prediction_leaves_zero3_gathers_to_the_plan():
    """FSDP2's prefetched gathers are what autopar's runtime does and prices (``cost_models.zero3``): a ZeRO-3
    row with the plan's own gradient sync and recompute keeps the plan's prediction."""
    plan = _one_stage_plan(forward=1.33, backward=2.93, latency=4.26, zero3_gather=0.33)
    run = types.SimpleNamespace(grad_sync="overlapped", zero=3, recompute="full", layers=2)
    assert published_prediction(plan, run)["step_time"] == -1.0


class _Block(torch.nn.Module):
    """A Llama block's matmuls in Llama's order (q, k, v, attention, o, gate, up, down), norms left out."""

    def __init__(self, h: int = 64, kv: int = 32, ffn: int = 128):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(h, n, bias=False) for n in (h, kv, kv, h))
        self.gate, self.up = torch.nn.Linear(h, ffn, bias=False), torch.nn.Linear(h, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, h, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t.view(b, s, -1, 16).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        return x + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


class _TwoBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block(), _Block()])
        self.head = torch.nn.Linear(64, 8, bias=False)  # outside the blocks: not counted

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


def test_op_sac_reruns_every_second_matmul_of_a_block():
    """Two blocks (hidden 64, 4 heads, 2 kv heads, MLP 128) on 16 tokens: each block's matmuls in order are
    q, k, v, o, gate, up, down; op SAC reruns k, o and up, never attention:
    ρ = 2·16·64·(32 + 64 + 128) / (2·16·64·(64 + 32 + 32 + 64 + 3·128) + 4·16²·64) = 458752 / 1245184.
    The plan's 0.6 s of full recompute then shrinks to ρ · 0.6."""
    from autopar.passes.capture import capture

    graph = capture(_TwoBlocks(), (torch.zeros(1, 16, 64),))
    rho = 458752 / 1245184
    assert op_sac_share(graph) == pytest.approx(rho)
    plan = _one_stage_plan(backward=2.6, latency=3.6, recompute=0.6)
    run = types.SimpleNamespace(grad_sync="overlapped", zero=0, recompute="op_sac", layers=2)
    assert published_prediction(plan, run, graph)["step_time"] == pytest.approx(1.0 + 2.0 + rho * 0.6)


def test_a_sync_after_backward_is_all_exposed():
    """One buffer all-reduced after the last backward (Megatron's local DDP): nothing hides it."""
    assert exposed_sync(0.4, backward=1.6, buckets=1, gather_share=0.0) == pytest.approx(0.4)
    assert exposed_sync(0.4, backward=1.6, buckets=100, gather_share=0.0) == pytest.approx(0.004)


def _flat_cluster(op_overhead: float) -> Cluster:
    """One CPU device at 1 GFLOP/s for every op and memory traffic priced at ~0 s."""
    return dataclasses.replace(Cluster.local(1), peak_flops={"float32": 1e9}, matmul_efficiency=1.0,
                               memory_bandwidth=1e30, op_overhead=op_overhead)


def test_probe_prediction_counts_the_blocks_matmul_flops():
    """TinyBlock(w) on t tokens: linears qkv (w→3w), out (w→w), fc (w→w) = 10·t·w² FLOPs forward, the two
    attention products 4·t²·w; backward twice the forward (every matmul input but x needs a gradient)."""
    t, w = 4, 8
    roofline, overhead = probe_step_prediction(_flat_cluster(0.0), width=w, tokens=t)
    assert roofline == pytest.approx(3 * (10 * t * w * w + 4 * t * t * w) / 1e9, rel=0.02)
    assert overhead == 0.0


def test_end_to_end_factor_is_measured_less_overhead_over_roofline():
    cluster = _flat_cluster(1e-5)
    roofline, overhead = probe_step_prediction(cluster)
    assert overhead > 0
    assert end_to_end_factor(cluster, overhead + 1.3 * roofline) == pytest.approx(1.3)
    # the scale already on the cluster does not enter the prediction it is measured against
    scaled = dataclasses.replace(cluster, compute_time_scale=5.0)
    assert end_to_end_factor(scaled, overhead + 1.3 * roofline) == pytest.approx(1.3)
    # a machine running at half the curve's speed during the probe (reference mm twice as slow) halves it
    flops = 2.0 * 256**3
    assert end_to_end_factor(cluster, overhead + 1.3 * roofline, 2 * flops / 1e9) == pytest.approx(0.65)


def test_end_to_end_factor_on_gpus_overlaps_host_and_kernels():
    """On a GPU cluster the probe's ops cost max(s·r_i, o_i): the factor solves that sum, not the CPU one."""
    shape = ProbeShape(width=16, tokens=32, dtype="float32", reference_side=256)
    gpu = dataclasses.replace(_flat_cluster(2e-5), device_type="cuda", backend="nccl")
    ops = probe_step_ops(gpu, shape)
    assert any(2 * r > o for r, o in ops) and any(2 * r < o for r, o in ops)  # both regimes present
    measured = sum(max(2.0 * r, o) for r, o in ops)
    assert end_to_end_factor(gpu, measured, shape=shape) == pytest.approx(2.0, rel=1e-6)
    # negative control: the CPU formula (measured - overhead) / roofline reads another factor
    cpu = dataclasses.replace(gpu, device_type="cpu", backend="gloo")
    assert end_to_end_factor(cpu, measured, shape=shape) != pytest.approx(2.0, rel=0.05)


def _row(plan, pred_t, meas_t, mem_err):
    return {"plan": plan, "mesh": "1x4", "pred_t": pred_t, "meas_t": meas_t, "t_err": pred_t / meas_t - 1,
            "mem_err": mem_err}


def test_fidelity_figures_and_medians_over_launches():
    launches = [[_row("a", 1.0, 1.25, 0.1), _row("b", 2.0, 2.0, -0.3), _row("c", 3.0, 1.6, 0.0)],
                [_row("a", 1.0, 1.0, 0.2), _row("b", 2.0, 2.5, 0.1), _row("c", 3.0, 3.0, 0.0)],
                [_row("a", 1.0, 2.0, 0.0), _row("b", 2.0, 4.0, 0.0), _row("c", 3.0, 6.0, 0.0)]]
    first = figures(launches[0])
    assert first["time_err"] == pytest.approx(0.2)          # |errors| 0.2, 0, 0.875
    assert first["worst_mem_err"] == pytest.approx(0.3)
    assert first["spearman"] == pytest.approx(0.5)          # ranks 1, 2, 3 vs 1, 3, 2: 1 - 6·2 / (3·8)
    rows = median_rows(launches)
    assert [r["plan"] for r in rows] == ["a", "b", "c"]
    assert [r["meas_t"] for r in rows] == [1.25, 2.5, 3.0]
    assert rows[1]["mem_err"] == pytest.approx(0.0)


def test_drift_correction_prices_the_busiest_stage_compute_at_the_launch_speed():
    """Step 1.0 s, stages computing 0.2 and 0.3 s: a launch at 2/3 of the profiled speed (q = 1.5) adds
    0.5 · 0.3 s; q = 1 leaves the prediction alone."""
    plan = _one_stage_plan(compute=0.2)
    plan.stages.append(_one_stage_plan(compute=0.3).stages[0])
    plan.predicted["step_time"] = 1.0
    assert drift_corrected(plan, 1.5) == pytest.approx(1.15)
    assert drift_corrected(plan, 1.0) == pytest.approx(1.0)


def test_megatron_rows_keep_the_hidden_stream_replicated():
    """A one-block GPT with dropout: the LayerNorms, the hidden-state dropouts and the residual adds on
    [batch, seq, hidden] are pinned; the attention's dropout on [batch, heads, seq, seq] is not."""
    from autopar.passes.capture import capture
    from benchmarks.calibration.calibration import hidden_stream_ops
    from examples.gpt import GPT, GPTConfig, make_batch

    cfg = GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, n_embd=16, dropout=0.1, attention="materialized")
    graph = capture(GPT(cfg), make_batch(cfg, 2))
    names = set(hidden_stream_ops(graph, 16))
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    kinds = sorted(str(nodes[n].target) for n in names)
    assert kinds.count("aten.layer_norm.default") == 3  # ln1, ln2, ln_f
    assert kinds.count("aten.add.Tensor") >= 2  # the two residual adds
    attention_dropouts = [n for n in nodes.values() if str(n.target) == "aten.dropout.default"
                          and n.meta["val"].ndim == 4]
    assert attention_dropouts and not names & {n.name for n in attention_dropouts}
    assert all(nodes[n].meta["val"].shape[-1] == 16 for n in names)
