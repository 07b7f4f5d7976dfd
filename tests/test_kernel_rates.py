"""Kernel kinds priced at the cluster's measured rate for them, on hand-computable cases with the ops each
term must leave alone as negative controls, and the profiler's reading of its measurements: normalization,
activation and softmax ops at ``Cluster.norm_act_bandwidth`` (``compute.memory_bound_bandwidth``), fused
fused attention (flash on GPUs, torch's CPU kernel on profiled CPU clusters) at ``Cluster.attention_efficiency``
of the matmul rate (``compute.attention_rate``)."""
import dataclasses
import types

import pytest
import torch

from autopar.cost_models.compute import ATTENTION_RATE, attention_kernel, compute_time, memory_bound_bandwidth
from autopar.errors import ClusterError
from autopar.hardware.cluster import Cluster
from autopar.passes.capture import capture
from autopar.placement import R
from autopar.profiling.profiler_training import (
    attention_efficiency,
    attention_flops,
    norm_act_bandwidth,
    norm_act_bytes,
)
from examples.gpt import GPT, GPTConfig, make_batch


class NormAct(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(64)

    def forward(self, x):
        return (torch.nn.functional.gelu(self.ln(x)) + x).softmax(-1).sum()


def _nodes():
    with torch.device("meta"):
        graph = capture(NormAct(), (torch.empty(32, 64, device="meta"),))
    nodes = {str(n.target).split(".")[1]: n for n in graph.gm.graph.nodes if n.op == "call_function"}
    return nodes


def _time(node, cluster):
    vals = [a.meta["val"] for a in node.args if isinstance(a, torch.fx.Node)]
    strategy = types.SimpleNamespace(work_fraction=1.0, in_specs=[(R,) * v.dim() for v in vals],
                                     out_spec=(R,) * node.meta["val"].dim())
    return compute_time(node, strategy, vals, [node.meta["val"]], (1, 1), cluster, differentiable=True)


def _cluster(norm_act: float) -> Cluster:
    return dataclasses.replace(Cluster.local(1), memory_bandwidth=10e9, op_overhead=0.0, compute_time_scale=1.0,
                               norm_act_bandwidth=norm_act)


def test_norms_activations_and_softmax_stream_at_their_measured_rate():
    nodes = _nodes()
    x_bytes = 32 * 64 * 4
    for name in ("layer_norm", "gelu", "softmax"):
        node = nodes[name]
        fast, slow = _time(node, _cluster(0.0)), _time(node, _cluster(1e9))
        moved = fast * 10e9  # bytes the roofline counted: 3 · (inputs + outputs)
        assert moved >= 6 * x_bytes
        assert slow == pytest.approx(moved / 1e9)  # the same bytes at 1 GB/s: 10x the time
        assert memory_bound_bandwidth(node, _cluster(1e9)) == 1e9


def test_plain_elementwise_ops_keep_the_streaming_bandwidth():
    """Negative control: an add is no norm or activation; its price does not move with norm_act_bandwidth."""
    add = _nodes()["add"]
    assert _time(add, _cluster(1e9)) == _time(add, _cluster(0.0)) == pytest.approx(3 * 3 * 32 * 64 * 4 / 10e9)
    assert memory_bound_bandwidth(add, _cluster(1e9)) == 10e9


def test_unmeasured_clusters_price_every_memory_bound_op_as_before():
    assert Cluster.local(1).norm_act_bandwidth == 0.0  # unprofiled; GPU presets carry the H100-derived rate
    ln = _nodes()["layer_norm"]
    assert memory_bound_bandwidth(ln, _cluster(0.0)) == 10e9
    old = Cluster.from_dict({k: v for k, v in _cluster(0.0).to_dict().items() if k != "norm_act_bandwidth"})
    assert old.norm_act_bandwidth == 0.0  # cluster files written before the field load unchanged


def test_a_negative_norm_act_bandwidth_is_a_cluster_error():
    with pytest.raises(ClusterError, match="norm_act_bandwidth"):
        _cluster(-1.0)


def test_profiler_reads_bytes_over_seconds_less_two_op_calls_on_cpus_and_the_median_op():
    per_rank = [{"norm_act": [2e-3, 4e-3, 8e-3]}, {"norm_act": [2e-3, 6e-3, 8e-3]}]
    nbytes = norm_act_bytes("cpu")
    assert nbytes == 6 * 4096 * 512 * 4
    # medians over ranks 2, 5, 8 ms; less 2 × 0.5 ms of op calls: 1, 4, 7 ms; the median op: 4 ms
    assert norm_act_bandwidth(per_rank, "cpu", overhead=0.5e-3) == pytest.approx(nbytes / 4e-3)
    # GPUs overlap launches with kernels: no host time taken off
    assert norm_act_bandwidth(per_rank, "cuda", overhead=0.5e-3) == pytest.approx(norm_act_bytes("cuda") / 5e-3)
    assert norm_act_bandwidth([{"norm_act": None}], "cpu", 0.0) == 0.0  # nothing measured: unmeasured


# ---- fused attention ------------------------------------------------------------------------------
def _attention_node():
    cfg = GPTConfig(n_layer=1, n_embd=512, n_head=4, seq_len=1024, vocab_size=64)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
    graph = capture(model, make_batch(cfg, 8, device="meta"))
    return next(n for n in graph.gm.graph.nodes if "scaled_dot_product" in str(n.target))


def _attention_time(node, cluster):
    vals = [a.meta["val"] for a in node.args[:3] if isinstance(a, torch.fx.Node)]
    strategy = types.SimpleNamespace(work_fraction=1.0, in_specs=[(R,) * v.dim() for v in vals],
                                     out_spec=(R,) * node.meta["val"].dim())
    return compute_time(node, strategy, vals, [node.meta["val"]], (1, 1), cluster, differentiable=True)


def test_flash_attention_runs_at_the_measured_share_of_the_matmul_rate():
    node, a100 = _attention_node(), Cluster.preset("dgx-a100")
    assert attention_kernel(node, a100) == "flash"
    default = _attention_time(node, a100)
    measured = _attention_time(node, dataclasses.replace(a100, attention_efficiency=ATTENTION_RATE["flash"] / 2))
    assert measured == pytest.approx(2 * default)  # compute-bound: half the rate, twice the time
    same = _attention_time(node, dataclasses.replace(a100, attention_efficiency=ATTENTION_RATE["flash"]))
    assert same == pytest.approx(default)


def test_cpu_attention_is_priced_by_its_measured_rate_and_other_ops_are_not():
    """A CPU cluster that measured fused attention prices composite SDPA at that share of the fp32 curve, causal
    FLOPs halved; negative controls: without the measurement it keeps the plain roofline, and a LayerNorm is
    no attention."""
    node = _attention_node()
    cpu = Cluster.local(1)
    assert attention_kernel(node, cpu) is None
    measured = dataclasses.replace(cpu, attention_efficiency=0.25)
    assert attention_kernel(node, measured) == "flash"
    slower = dataclasses.replace(cpu, attention_efficiency=0.125)
    host = 2 * cpu.op_overhead
    assert (_attention_time(node, slower) - host) / (_attention_time(node, measured) - host) == pytest.approx(2.0)
    ln = _nodes()["layer_norm"]
    assert _time(ln, dataclasses.replace(_cluster(0.0), attention_efficiency=0.1)) == _time(ln, _cluster(0.0))


def test_profiler_reads_attention_efficiency_against_the_bf16_curve():
    fwd, bwd = attention_flops()
    assert fwd == 4 * 8 * 16 * 2048 * 2048 * 128 and bwd == 2 * fwd  # the two and four matmuls of attention
    rate = 500e12
    cluster = dataclasses.replace(Cluster.preset("dgx-h100"), matmul_curve={"bfloat16": [[1e6, rate], [1e15, rate]]})
    ideal = 0.5 * (fwd + bwd) / rate  # causal: half the FLOPs, at the curve's rate
    per_rank = [{"attention": 2 * ideal}, {"attention": 3 * ideal}, {"attention": 2.5 * ideal}]
    assert attention_efficiency(cluster, per_rank) == pytest.approx(1 / 2.5)
    assert attention_efficiency(cluster, [{"attention": None}]) == 0.0  # not measured
    assert attention_efficiency(dataclasses.replace(cluster, matmul_curve={}), per_rank) == 0.0


def test_profiler_reads_cpu_attention_less_its_two_op_calls():
    fwd, bwd = attention_flops("cpu")
    assert fwd == 4 * 4 * 4 * 256 * 256 * 64 and bwd == 2 * fwd
    rate, overhead = 50e9, 20e-6
    cluster = dataclasses.replace(Cluster.local(1), matmul_curve={"float32": [[1e3, rate], [1e12, rate]]})
    ideal = 0.5 * (fwd + bwd) / rate
    per_rank = [{"attention": 3 * ideal + 2 * overhead}]
    assert attention_efficiency(cluster, per_rank, "cpu", overhead) == pytest.approx(1 / 3)
    assert attention_efficiency(cluster, per_rank, "cpu") < 1 / 3  # control: the host time left in reads slower
