"""Cost models on hand-computable cases: saved tensors, parameter state, op overhead, in-mesh fits, and the
predicted peak memory of a step against torch.profiler's measurement (one process, no process group).

Matmul FLOPs and the all_reduce/all_gather formulas are covered by tests/test_profiler.py.
"""
import math
import types

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.cost_models.communication import axis_links, redistribute_cost
from autopar.cost_models.compute import compute_time, optimizer_step_time
from autopar.cost_models.memory import TrainingSpec, saved_nodes
from autopar.cost_models.saved_tensors import saved_rule
from autopar.errors import ClusterError
from autopar.hardware.cluster import Cluster, CollectiveFit, Link
from autopar.ir.ops import OpView, requires_grad_nodes
from autopar.passes.capture import capture
from autopar.placement import R, S, local_shape
from autopar.profiling.fidelity import peak_allocated_bytes, spearman
from examples.gpt import GPTConfig, make_gpt

B, T, C, H = 2, 8, 16, 2  # batch, tokens, width, heads (head dim 8)
F32 = 4


class Ops(nn.Module):
    """layer_norm -> q/k/v linears -> causal sdpa -> dropout(0.5) -> dropout(0) -> cross_entropy."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(C)
        self.q, self.k, self.v = nn.Linear(C, C), nn.Linear(C, C), nn.Linear(C, C)

    def forward(self, x, y):
        h = self.ln(x)
        q, k, v = (m(h).view(B, T, H, C // H).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        d = F.dropout(F.dropout(a, 0.5, training=True), 0.0, training=True)
        return F.cross_entropy(d.transpose(1, 2).reshape(B * T, C), y)


@pytest.fixture(scope="module")
def ops_graph():
    torch.manual_seed(0)
    graph = capture(Ops(), (torch.randn(B, T, C), torch.randint(0, C, (B * T,))))
    trainable = {p.name for p in graph.placeholders if p.kind == "parameter"}
    return graph.gm, requires_grad_nodes(graph.gm, trainable)


def _nodes(gm, op) -> list:
    return [n for n in gm.graph.nodes if getattr(n.target, "overloadpacket", None) is op]


# ---- what backward keeps -------------------------------------------------------------------------
def test_linear_keeps_its_input_and_weight_not_its_output(ops_graph):
    gm, grad = ops_graph
    rule = saved_rule(_nodes(gm, torch.ops.aten.linear)[0], grad)
    assert rule.measured and rule.inputs == (0, 1) and not rule.output and rule.new_bytes == 0


def test_layer_norm_keeps_input_and_two_statistics_per_row(ops_graph):
    gm, grad = ops_graph
    rule = saved_rule(_nodes(gm, torch.ops.aten.layer_norm)[0], grad)
    assert 0 in rule.inputs and not rule.output
    assert rule.new_bytes == 2 * B * T * F32  # mean and rstd, (B, T, 1) each


def test_sdpa_on_cpu_keeps_q_k_v_output_and_logsumexp(ops_graph):
    gm, grad = ops_graph
    rule = saved_rule(_nodes(gm, torch.ops.aten.scaled_dot_product_attention)[0], grad)
    assert rule.inputs == (0, 1, 2) and rule.output
    assert rule.new_bytes == B * H * T * F32  # logsumexp: one float per query row, no T x T matrix


def test_dropout_keeps_a_mask_cpu_float_cuda_bool_and_p0_is_an_alias(ops_graph):
    gm, grad = ops_graph
    drop, drop0 = _nodes(gm, torch.ops.aten.dropout)
    numel = B * H * T * (C // H)
    assert saved_rule(drop, grad).new_bytes == numel * F32  # CPU: input * float noise
    assert saved_rule(drop, grad, "cuda").new_bytes == numel  # CUDA native_dropout: bool mask
    rule0 = saved_rule(drop0, grad)
    assert rule0.alias_of == 0 and rule0.inputs == () and rule0.new_bytes == 0


def test_saved_nodes_follow_views_to_the_tensor_that_owns_the_bytes(ops_graph):
    gm, grad = ops_graph
    saved = saved_nodes(gm, grad)
    linears = [n.name for n in _nodes(gm, torch.ops.aten.linear)]
    assert all(saved[name] == 1.0 for name in linears)  # q, k, v reach sdpa through view + transpose
    assert not any(n.name in saved for n in gm.graph.nodes if n.op == "placeholder")
    sdpa = _nodes(gm, torch.ops.aten.scaled_dot_product_attention)[0].name
    assert saved[sdpa] == pytest.approx(1.0 + 1.0 / (C // H))  # output + logsumexp (1/head_dim of it)
    # dropout(0.5): its float noise (1.0), plus cross_entropy's log-softmax and 4-byte total weight, charged
    # to the logits cross_entropy reads, whose storage is dropout's output (through the p=0 alias, a
    # transpose and a reshape that is a view: CPU sdpa returns (B, T, H, D)-contiguous memory)
    drop = _nodes(gm, torch.ops.aten.dropout)[0].name
    logits_bytes = B * T * C * F32
    assert saved[drop] == pytest.approx(1.0 + (logits_bytes + 4) / logits_bytes)


# ---- parameter state -----------------------------------------------------------------------------
def test_adamw_state_of_a_replicated_and_a_sharded_linear():
    spec = TrainingSpec(optimizer="adamw")
    per_element = spec.param_state_bytes_per_element(torch.float32)
    assert per_element == 16  # weight 4 + grad 4 + exp_avg 4 + exp_avg_sq 4
    assert spec.param_state_bytes_per_element(torch.bfloat16) == 2 + 2 + 8 + 4  # + fp32 master
    assert TrainingSpec(optimizer="sgd").param_state_bytes_per_element(torch.float32) == 8
    weight = (128, 64)  # nn.Linear(64, 128)
    replicated = math.prod(local_shape(weight, (R, R), (1, 4))) * per_element
    column = math.prod(local_shape(weight, (R, S(0)), (1, 4))) * per_element
    assert replicated == 128 * 64 * 16 and column == replicated / 4
    with pytest.raises(ValueError, match="not modelled"):
        TrainingSpec(optimizer="lion")


# ---- op overhead and optimizer time --------------------------------------------------------------
def _cluster(**changes) -> Cluster:
    link = Link(latency=1e-4, bandwidth=1e9)
    fields = dict(name="t", nodes=1, devices_per_node=4, peak_flops={"float32": 1e10}, matmul_efficiency=1.0,
                  memory_bandwidth=1e15, memory_per_device=1e9, intra_node=link, inter_node=link, op_overhead=1e-5)
    return Cluster(**{**fields, **changes})


def test_op_overhead_is_charged_per_call_forward_and_backward(ops_graph):
    """On CPU ranks the host time adds to the kernels' (on GPUs it overlaps: test_cost_terms)."""
    gm, _ = ops_graph
    cluster = _cluster(device_type="cpu", backend="gloo")
    def strategy(v):
        return types.SimpleNamespace(work_fraction=1.0, in_specs=[(R, R)] * len(v.in_vals), out_spec=(R, R))

    view = next(n for n in gm.graph.nodes if getattr(n.target, "overloadpacket", None) is torch.ops.aten.transpose)
    v = OpView(view)
    assert compute_time(view, strategy(v), v.in_vals, v.out_vals, (1, 4), cluster, True) == pytest.approx(2e-5)
    assert compute_time(view, strategy(v), v.in_vals, v.out_vals, (1, 4), cluster, False) == pytest.approx(1e-5)
    linear = _nodes(gm, torch.ops.aten.linear)[0]
    v = OpView(linear)
    flops = 6 * B * T * C * C  # forward + two backward matmuls (bias add is not counted as FLOPs)
    t = compute_time(linear, strategy(v), v.in_vals, v.out_vals, (1, 4), cluster, True)
    assert t == pytest.approx(flops / 1e10 + 2e-5, rel=0.02)
    assert optimizer_step_time(1000, 2, 4, "adamw", cluster) == pytest.approx(1000 * 4 * 7 / 1e15 + 2 * 11 * 1e-5)


def test_op_overhead_round_trips_and_old_files_load_as_zero():
    cluster = _cluster(op_overhead=3e-5)
    assert Cluster.from_json(cluster.to_json()).op_overhead == 3e-5
    old = cluster.to_dict()
    del old["op_overhead"]
    assert Cluster.from_dict(old).op_overhead == 0.0
    with pytest.raises(ClusterError, match="op_overhead"):
        _cluster(op_overhead=-1.0)


# ---- in-mesh collective fits ---------------------------------------------------------------------
def test_in_mesh_fit_is_preferred_on_its_mesh_only():
    fits = {"all_reduce/2": CollectiveFit(alpha=1e-3, beta=1e-9),
            "all_reduce/2@2x2": CollectiveFit(alpha=3e-3, beta=1e-9)}
    cluster = _cluster(intra_node=Link(latency=1e-4, bandwidth=1e9, fits=fits))
    on_2x2 = axis_links(cluster, (2, 2))
    assert on_2x2[0].time("all_reduce", 1) == pytest.approx(3e-3 + 1e-9)
    assert on_2x2[1].time("all_reduce", 1) == pytest.approx(3e-3 + 1e-9)
    assert axis_links(cluster, (1, 2), devices_per_node=2)[1].time("all_reduce", 1) == pytest.approx(1e-3 + 1e-9)
    assert Cluster.from_json(cluster.to_json()).intra_node.fits["all_reduce/2@2x2"].alpha == 3e-3
    with pytest.raises(ClusterError, match="rows"):
        _cluster(intra_node=Link(latency=1e-4, bandwidth=1e9, fits={"all_reduce/2@1x4": fits["all_reduce/2"]}))


def test_bucketed_gradient_sync_pays_only_the_bandwidth_term():
    fits = {"all_reduce/4": CollectiveFit(alpha=5e-3, beta=2e-9)}
    links = axis_links(_cluster(intra_node=Link(latency=1e-4, bandwidth=1e9, fits=fits)), (1, 4))
    m = 256 * 256 * F32  # a replicated 256x256 weight read by a batch-sharded matmul: Partial gradient
    args = ((256, 256), F32, (R, R), (R, R), (1, 4), links, (1,))
    assert redistribute_cost(*args) == pytest.approx((0.0, 5e-3 + m * 2e-9))
    assert redistribute_cost(*args, bucketed_sync=True) == pytest.approx((0.0, m * 2e-9))


# ---- predicted peak vs measured ------------------------------------------------------------------
def test_predicted_peak_of_a_step_matches_torch_profiler_within_20_percent():
    """One process trains a 2-layer GPT with AdamW; measured = parameters + optimizer state + the peak of
    the allocations torch.profiler sees over one step. The model counts every gradient on top of every
    saved activation (an upper bound: they are never all alive at once), so it may only over-predict."""
    torch.manual_seed(0)
    model, batch = make_gpt(GPTConfig(n_layer=2, n_embd=64, n_head=4, seq_len=64, vocab_size=256), batch_size=8)
    plan = autopar.plan(model, Cluster.local(1), batch)
    opt = torch.optim.AdamW(model.parameters())

    def step():
        model(*batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    state = sum(p.numel() * 4 for p in model.parameters())
    state += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    measured = state + peak_allocated_bytes(step)
    predicted = float(plan.predicted["peak_memory"])
    assert measured <= predicted <= 1.2 * measured, (predicted, measured)


def test_spearman_with_ties_matches_the_textbook_value():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks (1, 2.5, 2.5, 4) vs (1, 2, 3, 4): Pearson of the ranks
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(np.corrcoef([1, 2.5, 2.5, 4], [1, 2, 3, 4])[0, 1])
