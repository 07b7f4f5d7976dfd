"""Pricing of the MoE experts op's expert parallelism in the ILP, and what the plan says about it.

The all-to-all dispatch (kernel ``expert_all_to_all``) is priced by the token rows that cross devices
(``cost_models.experts``): checked against the α-β formula by hand, with uniform routing and with a
measured histogram (the busiest expert shard bounds both the exchange and the work). The planner offers
expert parallelism with data parallelism on the other mesh axis, and inside pipeline stages, and chooses
it where it pays (simulated clusters, no process group). A bad ``expert_routing`` is one OptionError.
"""
import warnings

import pytest
import torch
import torch.nn as nn

import autopar
import autopar.ir.moe_op  # noqa: F401  (registers torch.ops.autopar.moe_experts)
from autopar.baselines import hand_grids
from autopar.cost_models import experts
from autopar.cost_models.communication import axis_links
from autopar.errors import OptionError
from autopar.passes.capture import capture
from autopar.passes.intra_op import CostEnv
from autopar.passes.intra_op_groups import GroupBuilder
from autopar.passes.strategies import generate_strategies
from autopar.planner.options import PlanOptions
from autopar.views.visualize import plan_to_html

MiB = 2**20


class RoutedMoE(nn.Module):
    """Blocks of a softmax router, top-k, and the experts op (non-gated GELU experts, [E, in, out] weights)."""

    def __init__(self, hidden=64, n_experts=8, inner=128, top_k=2, layers=2):
        super().__init__()
        self.top_k = top_k
        self.routers = nn.ModuleList(nn.Linear(hidden, n_experts, bias=False) for _ in range(layers))
        self.w_in = nn.ParameterList(nn.Parameter(torch.randn(n_experts, hidden, inner) * 0.02) for _ in range(layers))
        self.w_out = nn.ParameterList(nn.Parameter(torch.randn(n_experts, inner, hidden) * 0.02)
                                      for _ in range(layers))
        self.head = nn.Linear(hidden, 1)

    def forward(self, x, y):
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        for router, w_in, w_out in zip(self.routers, self.w_in, self.w_out):
            weights, index = router(tokens).softmax(-1).topk(self.top_k, dim=-1)
            tokens = tokens + torch.ops.autopar.moe_experts(tokens, index, weights, w_in, w_out, "gelu", False, True,
                                                            None, 0)
        return ((self.head(tokens).reshape(b, s) - y) ** 2).mean()


def big_moe(layers=4, sequences=64):
    """Experts large enough that splitting them pays: 8 × (1024 → 4096 → 1024), 32768 tokens."""
    with torch.device("meta"):
        model = RoutedMoE(hidden=1024, n_experts=8, inner=4096, layers=layers)
    length = 32768 // sequences
    return model, (torch.empty(sequences, length, 1024, device="meta"), torch.empty(sequences, length, device="meta"))


def _plan(model, batch, cluster, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, cluster, batch, **options)


def _moe_shardings(plan):
    return [(s.index, n, s.shardings[n]) for s in plan.stages for n in s.nodes
            if plan.node_ops.get(n) == experts.MOE_OP]


# ---- the formulas by hand ------------------------------------------------------------------------------

def test_crossing_fraction_and_load_by_hand():
    assert experts.crossing_fraction([0.25] * 4) == pytest.approx(0.75)  # (W-1)/W out and in
    assert experts.crossing_fraction([1.0]) == 0.0
    # expert shard 0 gets half the assignments: it receives 3 × 0.5 of a device's rows
    shares = experts.device_shares([0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05], 8, 4)
    assert shares == pytest.approx([0.5, 0.2, 0.2, 0.1])
    assert experts.crossing_fraction(shares) == pytest.approx(1.5)
    assert experts.imbalance(shares) == pytest.approx(2.0)
    assert experts.imbalance(experts.device_shares(None, 8, 4)) == pytest.approx(1.0)


def test_all_to_all_price_of_a_captured_layer_by_hand():
    model = RoutedMoE(layers=1)
    graph = capture(model, (torch.randn(4, 32, 64), torch.randn(4, 32)))
    node = next(n for n in graph.gm.graph.nodes if experts.is_moe_op(n))
    mesh = (1, 4)
    strategy = next(s for s in generate_strategies(graph, mesh)[node.name]
                    if s.kernels == ((1, "expert_all_to_all"),))
    cluster = autopar.Cluster.preset("dgx-h100", 1)
    link = axis_links(cluster, mesh)[1]
    rows = 128 // 4 * 2 * 64 * 4  # local tokens × top-k × hidden × fp32 bytes
    alpha = link.latency + link.link.hop_latency * 3  # all-to-all over 4: 3 steps
    one = alpha + 0.75 * rows / link.bandwidth
    counts = alpha + 0.75 * 8 * 8 / link.bandwidth
    view = graph.view(node)
    assert experts.dispatch_seconds(view, 1, strategy, mesh, link, None) == pytest.approx(4 * one + counts)
    # the ILP's price of the op under that strategy carries exactly this communication
    env = CostEnv(cluster, mesh)
    builder = GroupBuilder(graph, generate_strategies(graph, mesh), env)
    k = builder.strategies[node.name].index(strategy)
    assert builder.node_time_k(node.name, k)[1] == pytest.approx(4 * one + counts)
    # a measured histogram moves the busiest shard's rows: 0.5 of the rows to shard 0 → 3 × 0.5 in
    skew = experts.check_expert_routing([3, 2, 1, 1, 1, 1, 0.5, 0.5])
    hot = alpha + 1.5 * rows / link.bandwidth
    assert experts.dispatch_seconds(view, 1, strategy, mesh, link, skew) == pytest.approx(4 * hot + counts)


def test_op_flops_and_the_busiest_shard_bound_its_compute():
    model = RoutedMoE(layers=1)
    graph = capture(model, (torch.randn(4, 32, 64), torch.randn(4, 32)))
    node = next(n for n in graph.gm.graph.nodes if experts.is_moe_op(n))
    per_row = 2 * (64 * 128 + 128 * 64)
    assert experts.moe_flops(node) == (128 * 2 * per_row, 2 * 128 * 2 * per_row)
    strategy = next(s for s in generate_strategies(graph, (1, 4))[node.name] if s.kernels)
    view = graph.view(node)
    skew = experts.check_expert_routing([3, 2, 1, 1, 1, 1, 0.5, 0.5])
    loaded = experts.with_expert_load(view, strategy, (1, 4), skew)
    assert loaded.work_fraction == pytest.approx(strategy.work_fraction * 2.0)
    assert experts.with_expert_load(view, strategy, (1, 4), None) is strategy


def test_what_backward_keeps_and_recomputes():
    """The expert-split kernels keep their rows' activations (2H + N_in + I per row, busiest device); the op
    run whole keeps only its inputs and recomputes its forward (4 forward-equivalents instead of 3)."""
    model = RoutedMoE(layers=1)
    graph = capture(model, (torch.randn(4, 32, 64), torch.randn(4, 32)))
    node = next(n for n in graph.gm.graph.nodes if experts.is_moe_op(n))
    view, strategies = graph.view(node), generate_strategies(graph, (1, 4))[node.name]
    a2a = next(s for s in strategies if s.kernels == ((1, "expert_all_to_all"),))
    gather = next(s for s in strategies if s.kernels == ((1, "local_experts_op"),))
    whole = next(s for s in strategies  # tokens split, experts replicated: the op runs whole on its tokens
                 if s.in_specs[0][1].is_shard() and all(p.is_replicate() for p in s.in_specs[3]))
    per_row = (2 * 64 + 128 + 128) * 4
    assert experts.kernel_saved_bytes(view, a2a, (1, 4), None) == 32 * 2 * 4 * 0.25 * per_row  # 4 senders
    assert experts.kernel_saved_bytes(view, gather, (1, 4), None) == 128 * 2 * 0.25 * per_row  # every token
    skew = experts.check_expert_routing([3, 2, 1, 1, 1, 1, 0.5, 0.5])
    assert experts.kernel_saved_bytes(view, a2a, (1, 4), skew) == 32 * 2 * 4 * 0.5 * per_row
    assert experts.kernel_saved_bytes(view, whole, (1, 4), None) == 0.0
    assert experts.with_expert_load(view, whole, (1, 4), None).work_fraction == pytest.approx(
        whole.work_fraction * 4 / 3)
    assert experts.with_expert_load(view, whole, (1, 4), None, differentiable=False) is whole


# ---- the planner's choices -----------------------------------------------------------------------------

def test_planner_chooses_all_to_all_expert_parallelism_with_data_parallelism_on_2d_mesh():
    model, batch = big_moe()
    plan = _plan(model, batch, autopar.Cluster.preset("dgx-h100", 2), stages=1)
    assert plan.stages[0].mesh_shape == (2, 8)
    for _, name, sh in _moe_shardings(plan):
        assert sh.kernels == ((1, "expert_all_to_all"),), (name, sh)
        assert sh.ins[0] == "S(0)S(0)" and sh.ins[3] == "RS(0)", (name, sh)  # DP on axis 0, EP on axis 1
    moved = [c for c in plan.stages[0].collectives if c.kind == "expert_all_to_all"]
    assert len(moved) == 4 * 4  # dispatch and combine, forward and backward, per layer
    assert moved[0].nbytes == pytest.approx(32768 // 16 * 2 * 1024 * 4 * 7 / 8)
    text = plan.summary()
    assert "mixture-of-experts layers: 4 of 4 dispatch tokens by all-to-all" in text
    assert "all-to-all on axis 1 (size 8), 56.00 MiB per device per step each" in text
    html = plan_to_html(plan)
    assert "Mixture-of-experts layers" in html and "56.00 MiB" in html


def test_expert_parallelism_inside_pipeline_stages():
    model, batch = big_moe()
    stages = [{"layers": [0, 1], "submesh": [1, 8]}, {"layers": [2, 3], "submesh": [1, 8]}]
    plan = _plan(model, batch, autopar.Cluster.preset("dgx-h100", 2), stages=stages, layers=4, microbatches=4)
    chosen = _moe_shardings(plan)
    assert {stage for stage, _, _ in chosen} == {0, 1}
    assert all(sh.kernels == ((1, "expert_all_to_all"),) for _, _, sh in chosen), chosen
    assert "stage 1: " in plan.summary().split("mixture-of-experts layers")[1]


def test_a_skewed_histogram_moves_the_planner_off_expert_parallelism():
    """Negative control of the histogram: the same model, uniform routing splits the experts; nearly all
    tokens routed to one expert make any expert split wait for that expert's device."""
    model, batch = big_moe(layers=2)
    cluster = autopar.Cluster.preset("p3.16xlarge", 1)
    uniform = _plan(model, batch, cluster, stages=1)
    assert all(sh.kernels for _, _, sh in _moe_shardings(uniform))
    skewed = _plan(model, batch, cluster, stages=1, expert_routing=[0.93] + [0.01] * 7)
    assert not any(t in experts.EXPERT_SPLIT_KERNELS for _, _, sh in _moe_shardings(skewed) for _, t in sh.kernels)
    assert skewed.planner["expert_routing"] == pytest.approx([0.93] + [0.01] * 7)
    assert "expert_routing" not in uniform.planner  # the default plan records nothing new


# ---- bad input -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("routing,needle", [
    ([], "is not a routing histogram"),
    ("uniform", "is not a routing histogram"),
    (0.5, "is not a routing histogram"),
    ([0.5, -0.1, 0.6], "-0.1, which is not a finite non-negative number"),
    ([0.5, float("nan")], "nan, which is not a finite non-negative number"),
    ([1, True], "True, which is not a finite non-negative number"),
    ([0, 0, 0], "sums to 0"),
])
def test_a_bad_routing_histogram_is_one_option_error(routing, needle):
    with pytest.raises(OptionError) as err:
        PlanOptions(expert_routing=routing)
    assert needle in str(err.value) and "one number per expert" in str(err.value), str(err.value)


def test_a_histogram_that_does_not_fit_the_model_is_refused():
    model = RoutedMoE(layers=1)
    batch = (torch.randn(4, 32, 64), torch.randn(4, 32))
    with pytest.raises(OptionError, match="has 4 entries but the model's MoE layers have 8 experts"):
        _plan(model, batch, autopar.Cluster.local(2), expert_routing=[1, 1, 1, 1])
    with pytest.raises(OptionError, match="the model has no mixture-of-experts layer"):
        _plan(nn.Linear(4, 4), (torch.randn(2, 4),), autopar.Cluster.local(2), expert_routing=[1, 1])
    # negative control: counts that fit plan, normalized
    plan = _plan(model, batch, autopar.Cluster.local(2), expert_routing=[2] * 8, stages=1)
    assert plan.planner["expert_routing"] == [0.125] * 8


# ---- the hand grid with all-to-all expert parallelism ----------------------------------------------------

def _hand_pins(layout):
    return hand_grids.moe_pins(layout, experts=("p_w_in_*", "p_w_out_*"), inputs=("x", "y"))


def test_hand_layout_dispatches_by_all_to_all_on_its_expert_axis():
    model, batch = big_moe(layers=2)
    layout = hand_grids.HandLayout(dp=2, ep=4, pp=2, microbatches=2)
    options = hand_grids.hand_options(layout, [(0, 0), (1, 1)], 8, _hand_pins(layout))
    plan = _plan(model, batch, autopar.Cluster.preset("p3.16xlarge", 2), **options)
    chosen = _moe_shardings(plan)
    assert {stage for stage, _, _ in chosen} == {0, 1}
    for _, name, sh in chosen:  # DP on axis 0, all-to-all EP on axis 1, in both pipeline stages
        assert sh.kernels == ((1, "expert_all_to_all"),) and sh.ins[0] == "S(0)S(0)" and sh.ins[3] == "RS(0)", sh


def test_autopar_at_least_matches_the_best_hand_layout_on_a_small_simulated_point():
    model, batch = big_moe(layers=2, sequences=8)  # 8 sequences: few microbatch counts to grid over
    cluster = autopar.Cluster.preset("p3.16xlarge", 1)
    search = hand_grids.best_hand(model, cluster, batch, _hand_pins, n_experts=8)
    assert search.best is not None and search.best.config.ep > 1  # the hand grid's best splits the experts
    plan = _plan(model, batch, cluster)
    assert search.best.step_time / plan.predicted["step_time"] >= 1.0 - 1e-9
    assert any(sh.kernels for _, _, sh in _moe_shardings(plan))


def test_moe_goal_line():
    from benchmarks.vs_hand.vs_megatron_moe import goal_line

    assert goal_line([1.0, 2.25, None]) == "MoE points: geometric mean autopar / best hand 1.500 over 2 points, " \
                                           "min 1.000; goal 1.5x met"
    assert goal_line([1.2, 1.0]).endswith("goal 1.5x not met")
    assert goal_line([None]) == "MoE points: none with both sides planned (goal 1.5x)"


def test_hand_all_to_all_only_where_each_device_holds_whole_routing_groups():
    """The GShard example drops tokens per routing group of 32: a device's share of a microbatch must be whole
    groups for the all-to-all (else the hand layout leaves the experts' dispatch to the ILP)."""
    from examples import moe

    model, batch = moe.make_moe(moe.MoEConfig(n_layer=2, n_expert=8, group_size=32), batch_size=16)
    op = next(n for n in capture(model, batch).gm.graph.nodes if experts.is_moe_op(n))  # 512 tokens
    assert hand_grids.all_to_all_fits(op, hand_grids.HandLayout(dp=1, ep=8, pp=1, microbatches=1))  # 64 each
    assert hand_grids.all_to_all_fits(op, hand_grids.HandLayout(dp=2, ep=4, pp=2, microbatches=2))  # 32 each
    assert not hand_grids.all_to_all_fits(op, hand_grids.HandLayout(dp=2, ep=8, pp=1, microbatches=2))  # 16
