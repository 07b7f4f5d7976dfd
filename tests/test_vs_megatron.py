"""The autopar-vs-hand benchmark's building blocks, without any process group.

* a Megatron config becomes manual stages + pins that give Megatron's weight layout (column-parallel
  q/k/v/fc, row-parallel o/proj, vocab-parallel wte and lm_head) on the requested stages and meshes;
* Megatron's FLOP formula, the grid generators' constraints, the FLOP-balanced stage split;
* Wide-ResNet and MoE capture with a sharding rule for every op and plan on a simulated 8-GPU cluster;
* the conv and einsum rules are exact: every strategy's local computation, run for every device of a
  simulated 2×2 mesh in one process, matches the slice of the full result (Partial outputs summed over
  their axis), with a negative control.
"""
import itertools
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import autopar
from autopar.baselines.hand_grids import HandLayout, balanced_ranges, hand_grid, moe_pins, wrn_pins
from autopar.baselines.megatron_configs import (
    MegatronConfig,
    megatron_flops,
    megatron_grid,
    megatron_options,
    megatron_pins,
)
from autopar.errors import InfeasibleError
from autopar.ir.ops import OpView
from autopar.passes.capture import capture
from autopar.passes.strategies import generate_strategies
from autopar.passes.strategies.einsum import parse_equation
from autopar.placement import R, local_slice
from examples import moe, wide_resnet
from examples.gpt import GPT, GPTConfig, make_batch

TINY_GPT = GPTConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=4, n_embd=64)
MESH = (2, 2)
COORDS = list(itertools.product(range(MESH[0]), range(MESH[1])))


# ---- Megatron configs as plans ---------------------------------------------------------------------

def test_pins_spell_megatrons_specs_and_size_one_axes_are_replicated():
    pins = megatron_pins(MegatronConfig(dp=2, tp=4, pp=1, microbatches=1))
    assert pins["p_blocks_*_attn_[qkv]_weight"] == "RS(0)" and pins["p_blocks_*_mlp_fc_bias"] == "RS(0)"
    assert pins["p_blocks_*_attn_o_weight"] == "RS(1)" and pins["p_blocks_*_mlp_proj_bias"] == "RR"
    assert pins["p_wte_weight"] == "RS(0)" and pins["p_lm_head_weight"] == "RS(0)" and pins["p_wpe_weight"] == "RR"
    assert pins["idx"] == "S(0)R" and pins["targets"] == "S(0)R"
    no_tp = megatron_pins(MegatronConfig(dp=4, tp=1, pp=2, microbatches=2))
    assert set(v for k, v in no_tp.items() if k.startswith("p_")) == {"RR"}
    no_dp = megatron_pins(MegatronConfig(dp=1, tp=2, pp=1, microbatches=1))
    assert no_dp["idx"] == "RR" and no_dp["p_blocks_*_attn_o_weight"] == "RS(1)"


def test_megatron_config_plans_with_megatrons_layout_on_the_requested_stages():
    with torch.device("meta"):
        model = GPT(TINY_GPT)
    config = MegatronConfig(dp=2, tp=2, pp=2, microbatches=4)
    plan = autopar.plan(model, autopar.Cluster.preset("dgx-a100"), make_batch(TINY_GPT, 16, device="meta"),
                        **megatron_options(config, n_blocks=4, devices_per_node=8))
    assert [s.layers for s in plan.stages] == [(0, 1), (2, 3)]
    assert all(s.mesh_shape == (2, 2) and s.submesh == (1, 4) for s in plan.stages)
    assert plan.microbatches == 4 and plan.schedule == "1f1b"
    first, last = ({n: sh.out for n, sh in s.shardings.items()} for s in plan.stages)
    for name in ("attn_q_weight", "attn_k_weight", "attn_v_weight", "attn_v_bias", "mlp_fc_weight", "mlp_fc_bias"):
        assert first[f"p_blocks_0_{name}"] == "RS(0)" and last[f"p_blocks_3_{name}"] == "RS(0)", name
    for name in ("attn_o_weight", "mlp_proj_weight"):
        assert first[f"p_blocks_1_{name}"] == "RS(1)", name
    assert first["p_blocks_1_attn_o_bias"] == "RR" and first["p_blocks_0_ln1_weight"] == "RR"
    assert first["p_wte_weight"] == "RS(0)" and first["p_wpe_weight"] == "RR" and first["idx"] == "S(0)R"
    assert last["p_lm_head_weight"] == "RS(0)" and last["p_ln_f_weight"] == "RR" and last["targets"] == "S(0)R"


def test_distributed_optimizer_config_shards_optimizer_state_over_dp():
    with torch.device("meta"):
        model = GPT(TINY_GPT)
    batch, cluster = make_batch(TINY_GPT, 16, device="meta"), autopar.Cluster.preset("dgx-a100")
    plans = {dist: autopar.plan(model, cluster, batch, **megatron_options(
        MegatronConfig(dp=4, tp=2, pp=1, microbatches=1, distributed_optimizer=dist), n_blocks=4, devices_per_node=8))
        for dist in (False, True)}
    assert set(plans[True].stages[0].zero.values()) == {1} and not plans[False].stages[0].zero
    assert plans[True].predicted["peak_memory"] < plans[False].predicted["peak_memory"]


def test_the_hand_grid_is_priced_under_the_precision_policy_it_is_given():
    """A grid point's plan sees the policy's dtypes (as autopar.plan does): fp16 compute is faster on a V100."""
    from autopar.baselines.megatron_configs import capture_once, score_config

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=1024, seq_len=256, n_layer=4, n_head=8, n_embd=512))
    batch, cluster = make_batch(model.cfg, 32, device="meta"), autopar.Cluster.preset("p3.16xlarge")
    step = {}
    for precision in ("fp32", "fp16"):
        graph, recapture = capture_once(model, batch, precision)
        config = MegatronConfig(dp=4, tp=2, pp=1, microbatches=1, precision=precision)
        step[precision] = score_config(graph, cluster, config, 4, recapture).step_time
    assert step["fp16"] < 0.5 * step["fp32"], step


def test_a_megatron_config_that_does_not_fit_scores_out_of_memory():
    """Its pins are written for its (dp, tp) stage mesh, not the whole cluster's: the infeasible manual
    stages must still end as InfeasibleError ("OOM"), not as a pin error from the error message's hint."""
    from autopar.baselines.megatron_configs import capture_once, score_config

    with torch.device("meta"):
        model = GPT(TINY_GPT)
    batch = make_batch(TINY_GPT, 16, device="meta")
    tiny = autopar.Cluster.preset("dgx-a100").with_memory(2e5)
    graph, recapture = capture_once(model, batch)
    scored = score_config(graph, tiny, MegatronConfig(dp=4, tp=1, pp=2, microbatches=2), 4, recapture)
    assert scored.status == "OOM" and scored.step_time is None
    with pytest.raises(InfeasibleError):
        autopar.plan(model, tiny, batch, **megatron_options(MegatronConfig(dp=4, tp=1, pp=2, microbatches=2), 4, 8))


def test_the_grid_offers_interleaving_as_megatron_allows_it():
    """v > 1 only with pp > 1, pp·v dividing the blocks and microbatches a multiple of pp (Megatron's rules)."""
    grid = list(megatron_grid(8, 8, 8, 64, n_heads=8))
    interleaved = [c for c in grid if c.virtual_stages > 1]
    assert {c.virtual_stages for c in interleaved} == {2, 4}
    assert all(c.pp > 1 and 8 % (c.pp * c.virtual_stages) == 0 and c.microbatches % c.pp == 0 for c in interleaved)
    assert {(c.pp, c.virtual_stages) for c in interleaved} == {(2, 2), (2, 4), (4, 2)}, "pp·v divides 8 blocks"
    options = megatron_options(MegatronConfig(dp=1, tp=2, pp=2, microbatches=4, virtual_stages=2), 8, 8)
    assert options["schedule"] == "interleaved" and options["virtual_stages"] == 2
    assert [s["layers"] for s in options["stages"]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="multiple of pp"):
        megatron_options(MegatronConfig(dp=1, tp=1, pp=4, microbatches=2, virtual_stages=2), 8, 8)


def test_an_interleaved_grid_point_is_scored_with_the_interleaved_schedule():
    """A v = 2 config plans 4 chunks round robin on 2 devices and is priced by the interleaved schedule."""
    from autopar.baselines.megatron_configs import capture_once, score_config

    with torch.device("meta"):
        model = GPT(TINY_GPT)
    graph, recapture = capture_once(model, make_batch(TINY_GPT, 16, device="meta"))
    cluster = autopar.Cluster.preset("dgx-a100", gpus=2)
    scored = {v: score_config(graph, cluster, MegatronConfig(dp=1, tp=1, pp=2, microbatches=4, virtual_stages=v),
                              4, recapture) for v in (1, 2)}
    plan = scored[2].plan
    assert plan.schedule == "interleaved" and plan.virtual_stages == 2
    assert [s.layers for s in plan.stages] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert [s.ranks for s in plan.stages] == [[0], [1], [0], [1]]
    assert scored[1].plan.schedule == "1f1b" and scored[2].step_time != scored[1].step_time


def _scorer(times: dict, out_of_memory: set, fitting: dict | None = None):
    """score(name, unbounded) of search_hand: ``times`` with memory ignored, names in ``out_of_memory`` OOM,
    ``fitting`` the times of configs whose layout memory slows where it fits (default: ``times``)."""
    from autopar.baselines.hand_search import Scored

    def score(name, unbounded=False):
        if unbounded:
            return Scored(name, times[name])
        if name in out_of_memory:
            return Scored(name, None, "OOM")
        return Scored(name, (fitting or times).get(name, times[name]))
    return score


def test_memory_binds_only_where_a_layout_that_does_not_fit_would_win():
    """search_hand: every config ``memory_free`` admits is scored again with memory ignored; the fastest is the
    ceiling, and memory binds when one that did not fit beats the best that fits."""
    from autopar.baselines.hand_search import search_hand

    times = {"a": 1.0, "b": 2.0, "c": 3.0}
    bound = search_hand(list(times), _scorer(times, {"a"}), lambda name: name, parallel=False)
    assert bound.best.config == "b" and bound.unbounded.config == "a" and bound.memory_binds
    assert bound.ceiling == 2.0, "best that fits / fastest with memory ignored"
    assert [r.config for r in bound.scored] == ["a", "b", "c"], "the memory-ignored scores are kept apart"
    assert [r.config for r in bound.free] == ["a", "b", "c"], "all of them, not the first that wins"
    slow_oom = search_hand(list(times), _scorer(times, {"c"}), lambda name: name, parallel=False)
    assert slow_oom.best.config == "a" and slow_oom.unbounded.config == "a" and not slow_oom.memory_binds
    assert slow_oom.ceiling == 1.0
    skipped = search_hand(list(times), _scorer(times, {"a"}), lambda name: name, memory_free=lambda n: n != "a",
                          parallel=False)
    assert not skipped.memory_binds, "a config memory_free rules out (e.g. recompute) is not retried"
    squeezed = search_hand(list(times), _scorer(times, set(), {"a": 1.5}), lambda name: name, parallel=False)
    assert not squeezed.memory_binds and squeezed.ceiling == 1.5, "a config that fits, faster with memory ignored"
    nothing_fits = search_hand(list(times), _scorer(times, set(times)), lambda name: name, parallel=False)
    assert nothing_fits.best is None and nothing_fits.memory_binds and nothing_fits.ceiling is None


def test_grid_search_stops_a_layout_at_its_first_config_that_does_not_fit():
    """Most microbatches first: fewer microbatches (bigger ones) cannot fit where more did not, so they are
    recorded OOM unplanned; fitting ones stop after ``patience`` slower in a row."""
    from autopar.baselines.hand_search import grid_search

    configs = [("x", b) for b in (1, 2, 4, 8, 16)] + [("y", b) for b in (1, 2, 4, 8, 16)]
    times = {("x", 16): 5.0, ("x", 8): 4.0, ("x", 4): 4.5, ("x", 2): 4.6, ("x", 1): 3.0, ("y", 16): 6.0}
    planned = []

    def score(config):
        planned.append(config)
        return _scorer(times, set(configs) - set(times))(config)

    best, scored = grid_search(configs, score, lambda c: c[0], parallel=False)
    assert best.config == ("x", 8) and [r.config for r in scored if r.config[0] == "x"] == planned[:4]
    assert planned == [("x", 16), ("x", 8), ("x", 4), ("x", 2), ("y", 16), ("y", 8)]
    assert [r.status for r in scored if r.config[0] == "y"] == ["ok"] + ["OOM"] * 4


def test_grid_search_on_both_cores_returns_the_serial_answer_ties_included():
    """Layouts in forked workers, the costliest first, merged in grid order: the same best config (the first
    of equal times, as the serial search keeps it) and the same scores in the same order."""
    from autopar.baselines.hand_search import grid_search

    configs = [(layout, b) for layout in "pqrs" for b in (1, 2, 4, 8)]
    times = {c: 1.0 + (c[1] % 3) * 0.5 + (0.0 if c[0] in "qs" else 0.25) for c in configs}
    out_of_memory = {("r", 1), ("r", 2), ("p", 1)}
    score = _scorer(times, out_of_memory)
    serial = grid_search(configs, score, lambda c: c[0], parallel=False)
    forked = grid_search(configs, score, lambda c: c[0], cost=lambda c: 4 if c[0] == "s" else 1, parallel=True)
    assert serial[0].config == forked[0].config == ("q", 4), "q and s tie: q comes first in the grid"
    assert [(r.config, r.status, r.step_time) for r in serial[1]] == \
        [(r.config, r.status, r.step_time) for r in forked[1]]


def test_shared_captures_score_each_config_as_a_fresh_capture_does():
    """capture_once: one capture per microbatch count, shared by every config planned at it, with caches
    (strategies per mesh and pins) carried over from config to config. A batch equal to the sequence
    length rescales exactly (the position ids are read as constants), so no config re-captures."""
    from autopar.baselines.hand_search import capture_once, precapture
    from autopar.baselines.megatron_configs import score_config
    from autopar.passes.batch_dims import rescale_is_exact

    with torch.device("meta"):
        model = GPT(TINY_GPT)
    batch = make_batch(TINY_GPT, TINY_GPT.seq_len, device="meta")
    cluster = autopar.Cluster.preset("p3.16xlarge", gpus=8)
    configs = [MegatronConfig(dp=2, tp=2, pp=2, microbatches=4, precision="fp16"),
               MegatronConfig(dp=2, tp=2, pp=2, microbatches=4, recompute="selective", precision="fp16"),
               MegatronConfig(dp=2, tp=2, pp=2, microbatches=16, distributed_optimizer=True, precision="fp16"),
               MegatronConfig(dp=2, tp=2, pp=2, microbatches=4, virtual_stages=2, precision="fp16")]
    graph, recapture = capture_once(model, batch, "fp16")
    assert rescale_is_exact(graph)
    precapture(graph, recapture, {c.microbatches for c in configs})
    assert recapture(4) is recapture(4)
    shared = [score_config(graph, cluster, c, 4, recapture).step_time for c in configs + configs]

    def on_fresh_capture(config):
        new_graph, new_recapture = capture_once(model, batch, "fp16")
        return score_config(new_graph, cluster, config, 4, new_recapture).step_time

    fresh = [on_fresh_capture(c) for c in configs]
    assert shared == fresh + fresh and all(t is not None for t in fresh)


def test_stages_span_whole_nodes_beyond_one_node():
    stages = megatron_options(MegatronConfig(dp=4, tp=4, pp=2, microbatches=2), 8, 8)["stages"]
    assert [s["submesh"] for s in stages] == [[2, 8], [2, 8]] and stages[1]["mesh"] == [4, 4]
    assert [s["layers"] for s in stages] == [[0, 3], [4, 7]]
    with pytest.raises(ValueError, match="inside a node"):
        megatron_options(MegatronConfig(dp=1, tp=8, pp=1, microbatches=1), 8, 4)


def test_megatron_flop_formula_on_a_hand_computed_case():
    # 72·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) with B=1, s=2, l=1, h=3, V=16: 1296·(1 + 1/9 + 1/3) = 1872.
    assert megatron_flops(batch=1, seq=2, layers=1, hidden=3, vocab=16) == pytest.approx(1872.0)
    assert megatron_flops(2, 2, 1, 3, 16) == pytest.approx(2 * 1872.0)


def test_megatron_grid_constraints():
    grid = list(megatron_grid(64, 48, 8, 1024, n_heads=64))
    assert grid and len(set(grid)) == len(grid)
    for c in grid:
        assert c.dp * c.tp * c.pp == 64 and c.tp in (1, 2, 4, 8)
        assert 48 % c.pp == 0 and c.microbatches % c.pp == 0 and 1024 % (c.microbatches * c.dp) == 0
        assert c.dp * c.tp <= 8 or (c.dp * c.tp) % 8 == 0
    layouts = {(c.dp, c.tp, c.pp) for c in grid}
    assert (1, 8, 8) in layouts and (64, 1, 1) in layouts and (4, 1, 16) in layouts
    assert not any(c.pp == 3 for c in grid), "pp must divide the devices too"
    assert {c.tp for c in megatron_grid(8, 4, 8, 64, n_heads=4)} == {1, 2, 4}, "tp divides the heads"
    assert {c.tp for c in megatron_grid(4, 4, 2, 64)} == {1, 2}, "tp stays inside a node"
    assert {c.distributed_optimizer for c in grid if c.dp > 1} == {False, True}, "the distributed optimizer lever"
    assert not any(c.distributed_optimizer for c in grid if c.dp == 1), "no distributed optimizer without dp"


def test_distributed_optimizer_and_precision_become_autopar_options():
    config = MegatronConfig(dp=2, tp=2, pp=1, microbatches=1, distributed_optimizer=True, precision="bf16")
    options = megatron_options(config, 4, 8)
    assert options["zero"] == 1 and options["precision"] == "bf16"
    assert str(config).endswith("·distopt")
    plain = megatron_options(MegatronConfig(dp=2, tp=2, pp=1, microbatches=1), 4, 8)
    assert plain["zero"] == 0 and plain["precision"] == "fp32"


def test_hand_grids_and_pins():
    grid = list(hand_grid(16, 8, 8, 1024, n_experts=8, pp_must_divide_layers=True))
    assert all(c.dp * c.ep * c.pp == 16 and 8 % c.ep == 0 and 8 % c.pp == 0 for c in grid)
    assert {c.ep for c in grid} == {1, 2, 4, 8}
    assert not any(c.ep > 1 for c in hand_grid(8, 4, 8, 64)), "no experts, no expert parallelism"
    layout = HandLayout(dp=2, ep=4, pp=1, microbatches=1)
    assert layout.mesh == [2, 4] and moe_pins(layout)["p_blocks_*_ffn_w_in"] == "RS(0)"
    assert moe_pins(layout)["idx"] == "S(0)S(0)" and list(moe_pins(layout))[0] == "p_*"
    assert wrn_pins(HandLayout(dp=8, pp=1, microbatches=1)) == {"p_*": "RR", "images": "RS(0)", "labels": "RS(0)"}


def test_balanced_ranges_minimize_the_largest_stage():
    assert balanced_ranges([1, 1, 1, 1], 2) == [(0, 1), (2, 3)]
    assert balanced_ranges([4, 1, 1, 1, 1], 2) == [(0, 0), (1, 4)]
    assert balanced_ranges([1, 2, 3], 3) == [(0, 0), (1, 1), (2, 2)]


# ---- Wide-ResNet and MoE: rules for every op, and plans ----------------------------------------------

SMALL_WRN = wide_resnet.WideResNetConfig(depth=26, base_channels=16, width_factor=2, groups=8, image_size=32)
SMALL_MOE = moe.MoEConfig(n_layer=2, n_expert=8, group_size=32)


@pytest.mark.parametrize("factory,cfg", [(wide_resnet.make_wide_resnet, SMALL_WRN), (moe.make_moe, SMALL_MOE)],
                         ids=["wide_resnet", "moe"])
def test_every_op_has_a_rule_and_the_model_plans_on_8_gpus(factory, cfg):
    model, batch = factory(cfg, batch_size=16)
    graph = capture(model, batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate_strategies(graph, (2, 4))
        plan = autopar.plan(model, autopar.Cluster.preset("p3.16xlarge"), batch, stages=1)
    missing = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    assert not missing, missing
    plan.validate(graph, world_size=8)
    assert plan.predicted["step_time"] > 0


def test_moe_plan_shards_experts_when_they_do_not_fit():
    from autopar.planner.driver import PlanOptions, memory_bounds

    model, batch = moe.make_moe(moe.MoEConfig(n_layer=2, n_expert=8, n_embd=256, group_size=32), batch_size=16)
    cluster = autopar.Cluster.preset("p3.16xlarge")
    floor, replicated = memory_bounds(capture(model, batch), cluster, PlanOptions())
    plan = autopar.plan(model, cluster.with_memory(floor + 0.2 * (replicated - floor)), batch, stages=1)
    experts = plan.stages[0].shardings["p_blocks_1_ffn_w_in"].out
    assert "S(0)" in experts, f"expert weights should be split by expert, got {experts}"


# ---- conv and einsum rules are exact -----------------------------------------------------------------

class ConvNet(torch.nn.Module):
    def forward(self, x, w, b, w2):
        y = F.conv2d(x, w, b, padding=1)
        z = F.conv2d(y, w2, stride=2)
        pooled = F.max_pool2d(z, 2) + F.avg_pool2d(z, 2)
        normed = F.batch_norm(y, None, None, b, b, training=True)
        return pooled.sum() + F.adaptive_avg_pool2d(normed, 1).sum() + F.group_norm(y, 2).sum()


class Router(torch.nn.Module):
    def forward(self, d, t, w, h, e):
        expert_in = torch.einsum("gsec,gsm->egcm", d, t)
        hidden = torch.einsum("egcm,emh->egch", expert_in, w)
        batched = torch.einsum("...ij,jk->...ik", h, e)
        return hidden.sum() + batched.sum() + torch.einsum("gsec,egcm->gsm", d, expert_in).sum()


CONV_INPUTS = (torch.randn(4, 6, 6, 6), torch.randn(8, 6, 3, 3), torch.randn(8), torch.randn(4, 8, 1, 1))
ROUTER_INPUTS = (torch.randn(4, 6, 2, 3), torch.randn(4, 6, 8), torch.randn(2, 8, 4), torch.randn(2, 4, 6, 8),
                 torch.randn(8, 2))


def _group(coord, axis):
    return [c for c in COORDS if all(c[b] == coord[b] for b in range(2) if b != axis)]


def local_result(node: fx.Node, strategy, full: dict, coord, apply_kernels: bool = True) -> torch.Tensor:
    """The op on this device's input shards, with the rule's local rewrite (bias scaled by 1/W)."""
    view = OpView(node)
    local = {a.name: local_slice(full[a.name], spec, MESH, coord)
             for a, spec in zip(view.tensor_args, strategy.in_specs)}
    for axis, tag in strategy.kernels:
        assert tag == "scale_additive", tag
        if apply_kernels:
            bias = view.tensor_args[2].name
            local[bias] = local[bias] / MESH[axis]
    args, kwargs = fx.map_arg((node.args, node.kwargs), lambda n: local[n.name])
    out = node.target(*args, **kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


def strategy_is_exact(node: fx.Node, strategy, full: dict, apply_kernels: bool = True) -> bool:
    outs = {c: local_result(node, strategy, full, c, apply_kernels) for c in COORDS}
    for axis, p in enumerate(strategy.out_spec):
        if p.is_partial():
            outs = {c: sum(outs[g] for g in _group(c, axis)) for c in COORDS}
    want_spec = tuple(R if p.is_partial() else p for p in strategy.out_spec)
    wants = {c: local_slice(full[node.name], want_spec, MESH, c) for c in COORDS}
    return all(outs[c].shape == wants[c].shape and torch.allclose(outs[c], wants[c], atol=1e-9) for c in COORDS)


def ops_with_strategies(module, inputs, targets):
    graph = capture(module, tuple(t.double() for t in inputs))
    full = {}
    for node in graph.gm.graph.nodes:  # run the graph on real inputs, keeping every value
        if node.op == "placeholder":
            full[node.name] = inputs[len(full)].double()
        elif node.op == "call_function":
            args, kwargs = fx.map_arg((node.args, node.kwargs), lambda n: full[n.name])
            out = node.target(*args, **kwargs)
            full[node.name] = out[0] if isinstance(out, (tuple, list)) else out
    strategies = generate_strategies(graph, MESH)
    nodes = [n for n in graph.gm.graph.nodes if n.op == "call_function" and n.target.overloadpacket in targets]
    return nodes, strategies, full


def test_conv_pool_and_norm_strategies_are_exact():
    aten = torch.ops.aten
    targets = {aten.conv2d, aten.max_pool2d, aten.avg_pool2d, aten.adaptive_avg_pool2d, aten.batch_norm,
               aten.group_norm}
    nodes, strategies, full = ops_with_strategies(ConvNet(), CONV_INPUTS, targets)
    assert {n.target.overloadpacket for n in nodes} == targets
    for node in nodes:
        assert len(strategies[node.name]) > 1, f"{node.name} has only the replicated strategy"
        for s in strategies[node.name]:
            assert strategy_is_exact(node, s, full), f"{node.name}: {s}"
    conv = nodes[0]
    kinds = {str(s) for s in strategies[conv.name]}
    assert "S(0)S(1) <- (S(0)R,RS(0),RS(0))" in kinds, "batch × output-channel split"
    assert "PR <- (S(1)R,S(1)R,RR)" in kinds, "input-channel split gives Partial"


def test_conv_negative_control_dropping_the_bias_rewrite_is_caught():
    nodes, strategies, full = ops_with_strategies(ConvNet(), CONV_INPUTS, {torch.ops.aten.conv2d})
    partial = [s for s in strategies[nodes[0].name] if s.kernels]
    assert partial and not any(strategy_is_exact(nodes[0], s, full, apply_kernels=False) for s in partial)


def test_einsum_strategies_are_exact():
    nodes, strategies, full = ops_with_strategies(Router(), ROUTER_INPUTS, {torch.ops.aten.einsum})
    assert len(nodes) == 4
    for node in nodes:
        assert len(strategies[node.name]) > 4, node.args[0]
        for s in strategies[node.name]:
            assert strategy_is_exact(node, s, full), f"{node.args[0]}: {s}"
    dispatch = {str(s) for s in strategies[nodes[0].name]}
    assert "RS(0) <- (RS(2),RR)" in dispatch, "expert split of the dispatch (output dim e)"
    assert "PR <- (S(1)R,S(1)R)" in dispatch, "token split contracts s: Partial"


def test_einsum_negative_control_a_wrong_output_dim_is_caught():
    from torch.distributed.tensor import Shard

    from autopar.passes.strategies.base import Strategy

    nodes, _, full = ops_with_strategies(Router(), ROUTER_INPUTS, {torch.ops.aten.einsum})
    right = Strategy(((R, Shard(2)), (R, R)), (R, Shard(0)))  # split e: the output is split on e (dim 0)
    wrong = Strategy(((R, Shard(1)), (R, Shard(1))), (R, Shard(1)))  # split s, which is contracted: not S
    assert strategy_is_exact(nodes[0], right, full) and not strategy_is_exact(nodes[0], wrong, full)


def test_parse_equation():
    assert parse_equation("gsec,gsm->egcm", [4, 3]) == (["gsec", "gsm"], "egcm")
    assert parse_equation("...ij,jk->...ik", [4, 2]) == (["YZij", "jk"], "YZik")
    assert parse_equation("ij,jk", [2, 2]) is None, "implicit output"
    assert parse_equation("ii->i", [2]) is None, "diagonal"


def test_replan_plans_the_autopar_side_again_and_keeps_the_hand_grid(tmp_path, monkeypatch):
    """``vs_megatron --replan``: a saved row's autopar side is planned with this tree (the same predicted
    step as ``autopar.plan`` gives now), its hand grid and options other than the default schedule kept."""
    import json

    from benchmarks.vs_hand import vs_megatron, vs_megatron_report

    monkeypatch.setattr(vs_megatron_report, "RESULTS", str(tmp_path))
    hand = {"hand": "dp1·tp1·pp1·B32", "hand_step": 12.5, "scored": [["dp1·tp1·pp1·B32", "ok", 12.5]],
            "memory_ignored": [], "memory_binds": False, "hand_unbounded": None, "hand_unbounded_step": None,
            "ceiling": None, "grid_s": 49.0}
    row = {"point": "gpt:350M:1:dgx-a100", "family": "gpt", "model": "350M", "gpus": 1, "cluster": "dgx-a100",
           "flops": 1e15, "auto_step": 99.0, "auto_plan": "stale", "plan_s": 1.0,
           "autopar_options": {"schedule": "auto", "time_limit": 300.0}, **hand}
    (tmp_path / "vs_megatron_simulate.json").write_text(json.dumps([row]))
    assert vs_megatron.replan("simulate", "fp16", "# header") == 0
    (new,) = json.loads((tmp_path / "vs_megatron_simulate.json").read_text())
    work = vs_megatron.build_workload("gpt", "350M", "fp16")
    now = autopar.plan(work.model, autopar.Cluster.preset("dgx-a100", gpus=1), work.batch, precision="fp16",
                       time_limit=300.0)
    assert new["auto_step"] == pytest.approx(float(now.predicted["step_time"]), rel=1e-9)
    assert new["auto_plan"] == vs_megatron_report.describe_plan(now) and new["auto_step"] != 99.0
    assert {k: new[k] for k in hand} == hand, "the hand grid is kept as saved"
    assert new["autopar_options"] == {"time_limit": 300.0} and new["replanned"].startswith("# re-planned")
