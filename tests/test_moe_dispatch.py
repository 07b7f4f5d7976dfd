"""MoE experts as one op, split by experts with all-to-all dispatch: parity against one device.

HF Mixtral, Qwen2-MoE and OLMoE reach ``autopar::moe_experts`` at capture (their experts' ExpertsInterface);
the GShard-style example (capacity factor 1.0) calls it through ``autopar.moe.moe_experts``. Each case pins
the op split by experts on one mesh axis with all-to-all dispatch ("a2a"; ``tests/parity.py``
``expert_split_pins``) or by gathered tokens ("gather") and trains 3 AdamW steps in fp32 on gloo ranks against
one device (loss ≤ 1e-5 relative each step, every parameter with a gradient ≤ 1e-4 relative). The HF models
("_aux") train on their loss plus 0.1 × the router's auxiliary load-balancing loss (``output_router_logits``),
which the plan computes outside the op from the router logits. The kernel alone runs skewed routing (experts
and ranks that get no rows: uneven splits) on 2 and 4 ranks and capacity drops against ``experts_math``.
Negative controls: a wrong un-permute and a wrong regrouping of the received rows must break parity. The
models on 4 ranks (EP × DP on a 2×2 mesh, EP in 2 pipeline stages, Mixtral on 1×4) and compiled runs are in
the slow tier (``tests/test_moe_dispatch_slow.py``).
"""
import pytest
import torch

from autopar.errors import UsageError
from autopar.ir.moe_op import capacity_keep, experts_math
from autopar.moe import moe_experts
from autopar.passes.capture import capture
from autopar.passes.capture_moe import keep_hf_experts
from autopar.passes.strategies import generate_strategies
from tests.models import FACTORIES

A2A = [("zoo_mixtral_aux", (1, 2), "a2a", None), ("zoo_qwen2_moe_aux", (1, 2), "a2a", None),
       ("olmoe_aux", (1, 2), "a2a", None), ("moe_example", (1, 2), "a2a", None),
       ("moe_example", (1, 2), "gather", None)]
OTHER_SPLITS = [("moe_example", (1, 2), "etp", None), ("moe_example", (1, 2), "tokens", None)]
NEGATIVE = [("zoo_mixtral_aux", (1, 2), "a2a", "unpermute"), ("moe_example", (1, 2), "a2a", "regroup")]
KERNEL = [("dispatch", (1, 2), "skewed", None), ("dispatch", (1, 2), "capacity", None)]
FOUR = [("dispatch", (1, 4), "skewed", None)]  # the models on 4 ranks: tests/test_moe_dispatch_slow.py
CASES = {2: A2A + OTHER_SPLITS + NEGATIVE + KERNEL, 4: FOUR}
PARITY_CASES, PARITY_TIMEOUT = CASES, 900  # launched with the other parity suites' (conftest.parity_runs)


def _id(case):
    model, mesh, layout, sabotage = case
    return f"{model}-{mesh[0]}x{mesh[1]}-{layout}" + (f"-sabotaged-{sabotage}" if sabotage else "")


@pytest.fixture(scope="module")
def results(parity_runs):
    return {case: parity_runs[case] for cases in CASES.values() for case in cases}


@pytest.mark.distributed
@pytest.mark.parametrize("case", [c for c in A2A + FOUR if c[0] != "dispatch"], ids=_id)
def test_expert_parallel_moe_matches_single_device(results, case):
    r = results[case][0]
    tag = "local_experts_op" if case[2] == "gather" else "expert_all_to_all"
    assert tag in r["kernels"], r["kernels"]
    assert r["loss_err"] <= 1e-5, r
    assert r["param_err"] <= 1e-4, r
    assert r["keys_match"] and r["shapes_match"] and r["ranks_agree"]
    if case[2].startswith("pp"):
        assert len(r["stages"]) == 2, r["stages"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", OTHER_SPLITS, ids=_id)
def test_moe_op_split_inside_experts_or_by_tokens_matches_single_device(results, case):
    """Expert tensor parallelism (the op on hidden-dim shards, out Partial) and the tokens split (the op on
    each rank's tokens, whole experts): the op itself runs on local shards, no dispatch kernel."""
    r = results[case][0]
    assert not {"expert_all_to_all", "local_experts_op"} & set(r["kernels"]), r["kernels"]
    assert r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-4, r
    assert r["ranks_agree"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", [c for c in KERNEL + FOUR if c[0] == "dispatch"], ids=_id)
def test_dispatch_kernel_with_uneven_routing_matches_one_device(results, case):
    for r in results[case]:
        assert max(r["errors"].values()) <= 1e-5, r
    if case[2] == "skewed":  # rank 0 sends nothing to other ranks; uneven splits
        assert results[case][0]["rows_sent_per_rank"][1:] == [0] * (case[1][1] - 1)


@pytest.mark.distributed
@pytest.mark.parametrize("case", NEGATIVE, ids=_id)
def test_wrong_dispatch_permutation_negative_control(results, case):
    r = results[case][0]
    assert "expert_all_to_all" in r["kernels"]
    assert r["loss_err"] > 1e-5 or r["param_err"] > 1e-4, f"a wrong permutation went unnoticed: {r}"


def test_hf_experts_are_captured_as_one_op_and_the_setting_restored():
    model, batch = FACTORIES["zoo_mixtral"]()
    graph = capture(model, batch)
    ops = [n for n in graph.gm.graph.nodes if str(n.target) == "autopar.moe_experts.default"]
    assert len(ops) == 2 and not any("grouped_mm" in str(n.target) for n in graph.gm.graph.nodes)
    assert model.model.config._experts_implementation == "grouped_mm"
    with keep_hf_experts():
        kept = capture(model, batch)
    assert not any(str(n.target) == "autopar.moe_experts.default" for n in kept.gm.graph.nodes)


def test_moe_op_strategies_offer_every_split():
    graph = capture(*FACTORIES["moe_example"]())
    node = next(n for n in graph.gm.graph.nodes if str(n.target) == "autopar.moe_experts.default")
    kernels = {k for s in generate_strategies(graph, (1, 2))[node.name] for _, k in s.kernels}
    assert kernels == {"local_experts_op", "expert_all_to_all"}
    outs = {str(s.out_spec) for s in generate_strategies(graph, (1, 2))[node.name]}
    assert len(outs) >= 3  # replicated, tokens split, Partial (gathered split, expert tensor parallel)


def test_capacity_drops_overflow_in_priority_order():
    index = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0]])  # group of 4 tokens, 4 experts, k 2: C = ceil(f·2)
    # C = 2: expert 0 takes the first choices of tokens 0, 1 (token 2's overflows); expert 1 token 3's first
    # choice, then token 0's second; token 1's second choice overflows, and token 3's (expert 0)
    keep = capacity_keep(index, 4, 1.0, 4)
    assert keep.tolist() == [[True, True], [True, False], [False, True], [True, False]]
    x, w = torch.randn(4, 3), torch.rand(4, 2)
    w_in, w_out = torch.randn(4, 3, 5), torch.randn(4, 5, 3)
    dropped = experts_math(x, index, w, w_in, w_out, "relu", False, True, 1.0, 4)
    manual = experts_math(x, index, w * keep, w_in, w_out, "relu", False, True, None, 0)
    torch.testing.assert_close(dropped, manual)


@pytest.mark.parametrize("bad", ["activation", "shape", "capacity"])
def test_moe_experts_bad_input_is_one_clear_error(bad):
    x, index, w = torch.randn(8, 4), torch.zeros(8, 2, dtype=torch.long), torch.rand(8, 2)
    w_in, w_out = torch.randn(2, 4, 6), torch.randn(2, 6, 4)
    kwargs = {"activation": {"activation": "swishy"}, "shape": {}, "capacity": {"capacity_factor": 1.0,
                                                                                   "group_size": 3}}[bad]
    if bad == "shape":
        w_out = torch.randn(2, 5, 4)
    with pytest.raises(UsageError, match="moe_experts"):
        moe_experts(x, index, w, w_in, w_out, **{"activation": "relu", **kwargs})


def test_experts_the_op_cannot_express_keep_transformers_path():
    """An activation outside the op's list (tanh) leaves the experts on grouped_mm; a meta-device model
    captures through the op's fake kernel."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from tests.zoo_models import _DECODER, _MOE, HFLoss

    cfg = dict(_DECODER, num_key_value_heads=2, use_cache=False, **_MOE)
    model = HFLoss(MixtralForCausalLM(MixtralConfig(**cfg, hidden_act="tanh")), ("input_ids", "labels"))
    ids = torch.zeros(2, 8, dtype=torch.long)
    targets = {str(n.target) for n in capture(model, (ids, ids)).gm.graph.nodes}
    assert "autopar.moe_experts.default" not in targets and any("grouped_mm" in t for t in targets)
    with torch.device("meta"):
        meta = HFLoss(MixtralForCausalLM(MixtralConfig(**cfg)), ("input_ids", "labels"))
    meta_ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    targets = [str(n.target) for n in capture(meta, (meta_ids, meta_ids)).gm.graph.nodes]
    assert targets.count("autopar.moe_experts.default") == 2


def test_the_example_parity_model_drops_tokens_at_capacity():
    """The parity cases' GShard example really exercises the capacity factor: some assignments overflow."""
    model, batch = FACTORIES["moe_example"]()
    layer = model.blocks[1].ffn
    seen = []
    layer.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    model(*batch)
    tokens = seen[0].reshape(-1, seen[0].shape[-1])
    index = (tokens @ layer.gate).softmax(-1).topk(2, dim=-1).indices
    keep = capacity_keep(index, layer.cfg.n_expert, layer.cfg.capacity_factor, layer.cfg.group_size)
    assert 0 < int((~keep).sum()) < keep.numel() // 2


@pytest.mark.parametrize("activation,gated,transposed,capacity", [
    ("silu", True, False, None), ("relu", False, True, 1.0), ("gelu", True, True, None),
    ("gelu_tanh", False, False, 0.5)])
def test_moe_op_backward_matches_autograd_of_its_forward(activation, gated, transposed, capacity):
    """The op's written-out backward against autograd through ``experts_math`` (routing with an expert that
    gets no token); a wrong activation derivative (silu's used for every activation) must be caught."""
    g = torch.Generator().manual_seed(3)
    x, weights = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.rand(8, 2, generator=g, dtype=torch.float64)
    index = torch.randint(0, 3, (8, 2), generator=g)  # expert 3 of 4 gets nothing
    width = 10 if gated else 5
    w_in = torch.randn(4, 6, width, generator=g, dtype=torch.float64)
    w_out = torch.randn(4, 5, 6, generator=g, dtype=torch.float64)
    if not transposed:
        w_in, w_out = w_in.transpose(1, 2).contiguous(), w_out.transpose(1, 2).contiguous()
    attrs = (activation, gated, transposed, capacity, 4 if capacity else 0)
    inputs = [t.clone().requires_grad_(t.is_floating_point()) for t in (x, index, weights, w_in, w_out)]
    probe = torch.randn(8, 6, generator=g, dtype=torch.float64)
    (torch.ops.autopar.moe_experts(*inputs, *attrs) * probe).sum().backward()
    leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in (x, index, weights, w_in, w_out)]
    (experts_math(*leaves, *attrs) * probe).sum().backward()
    for i in (0, 2, 3, 4):
        torch.testing.assert_close(inputs[i].grad, leaves[i].grad)
    if activation != "silu":
        wrong = torch.ops.autopar.moe_experts_backward(probe, x, index, weights, w_in, w_out, "silu", *attrs[1:])
        assert not torch.allclose(wrong[2], leaves[3].grad)


def test_capacity_groups_are_never_cut_by_a_token_split():
    """With a capacity factor, a strategy that leaves a device part of a routing group is not offered (the
    drop decision is per group): 64 tokens in one group of 64 cannot split over 2 devices; in groups of 32 they can."""
    from examples.moe import MoEConfig, make_moe

    def token_splits(group_size: int) -> set:
        graph = capture(*make_moe(MoEConfig(group_size=group_size), batch_size=2))
        node = next(n for n in graph.gm.graph.nodes if str(n.target) == "autopar.moe_experts.default")
        return {s.in_specs[0] for s in generate_strategies(graph, (1, 2))[node.name] if s.in_specs[0][1].is_shard()}

    assert token_splits(64) == set()
    assert token_splits(32)  # tokens split, all-to-all


@pytest.mark.parametrize("name", ["zoo_mixtral", "zoo_qwen2_moe", "olmoe"])
def test_the_aux_parity_models_add_the_router_loss(name):
    """The "_aux" models' loss is the plain model's plus 0.1 × the load-balancing loss (about 0.1 × top-k for
    balanced routing): the parity cases above train through the router's auxiliary loss."""
    (plain, batch), (aux, _) = FACTORIES[name](), FACTORIES[f"{name}_aux"]()
    with torch.no_grad():
        extra = (aux(*batch) - plain(*batch)).item()
    assert 0.05 < extra < 0.5, extra
