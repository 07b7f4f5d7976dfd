"""Context parallelism: attention split over the sequence equals one device, on 2 and 4 gloo ranks.

Cases (sequence 256, 3 AdamW steps, tolerances of test_parity): the GPT example with ``is_causal`` SDPA (the
``causal_context`` kernel: prefix keys, offset mask, zig-zag swap), the same GPT attending both ways (the
plain query-row split), and a Hugging Face Llama (rotary positions, GQA, and the materialized causal mask
its SDPA path passes, split by rows); on a sequence axis alone and beside a data-parallel axis. Keys and
values are all-gathered; their gradients reduce-scattered. Negative controls: the zig-zag swap skipped
(each rank attends with its mirror's offsets) and the sum of the gathered keys' gradients dropped. Megatron's
sequence parallelism (the residual stream split over the sequence between tensor-parallel blocks) is the
same vocabulary, Shard(seq) on the hidden stream: a parity case pins it. Planner tests: a budget only a
sequence split meets gets one (and none without the split: the negative control); without memory pressure
the batch is split instead.
"""
import pytest
from torch.distributed.tensor import Shard

from autopar.ir.ops import OpView
from autopar.passes.capture import capture
from autopar.passes.strategies import generate_strategies
from autopar.passes.strategies.attention import sdpa_rule
from tests.models import make_long_gpt

CASES = {
    2: [("gpt_long", (1, 2), "cp", None), ("gpt_long_bidir", (1, 2), "cp", None), ("llama_long", (1, 2), "cp", None),
        ("gpt_long", (1, 2), "cp", "cp_swap"), ("gpt_long", (1, 2), "sp", None)],
    4: [("gpt_long", (1, 4), "cp", None), ("gpt_long", (2, 2), "cp", None), ("llama_long", (2, 2), "cp", None),
        ("llama_long", (2, 2), "cp", "kv_grad")],
}
PARITY_CASES = CASES
PARITY_TIMEOUT = 300
PARITY = [c for cases in CASES.values() for c in cases if not c[3] and c[2] == "cp"]
SEQUENCE_PARALLEL = ("gpt_long", (1, 2), "sp", None)
NEGATIVE = [c for cases in CASES.values() for c in cases if c[3]]


def _id(case):
    return f"{case[0]}-{case[1][0]}x{case[1][1]}" + (f"-{case[3]}" if case[3] else "")


@pytest.fixture(scope="module")
def results(parity_runs):
    return {case: parity_runs[case][0] for case in PARITY + NEGATIVE + [SEQUENCE_PARALLEL]}


@pytest.mark.distributed
@pytest.mark.parametrize("case", PARITY, ids=_id)
def test_context_parallel_training_matches_one_device(results, case):
    r = results[case]
    assert r["loss_err"] <= 1e-5, r
    assert r["param_err"] <= 1e-4, r
    assert r["ranks_agree"], "every rank must return the same loss"
    assert ("causal_context" in r["kernels"]) == (case[0] == "gpt_long"), r["kernels"]
    assert r["collectives"] > 0


@pytest.mark.distributed
@pytest.mark.parametrize("case", NEGATIVE, ids=_id)
def test_negative_control_breaks_context_parallel_parity(results, case):
    r = results[case]
    assert r["loss_err"] > 1e-5 or r["param_err"] > 1e-4, f"a broken context-parallel exchange went unnoticed: {r}"


@pytest.mark.distributed
def test_megatron_sequence_parallelism_matches_one_device(results):
    """The residual stream split over the sequence between tensor-parallel blocks: a reduce-scatter after each
    row-parallel matmul and an all-gather before each column-parallel one, in forward."""
    r = results[SEQUENCE_PARALLEL]
    assert r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-4, r
    assert {("reduce_scatter", "forward"), ("all_gather", "forward")} <= set(r["collective_kinds"]), r
    assert r["sharded_params"] > 0


def _sdpa_views(causal: bool):
    model, batch = make_long_gpt(causal=causal)
    graph = capture(model, batch)
    nodes = [n for n in graph.gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    return graph, nodes


def test_causal_attention_splits_the_sequence_with_its_kernel():
    graph, nodes = _sdpa_views(causal=True)
    rules = sdpa_rule(OpView(nodes[0]))
    seq = [r for r in rules if r.output == Shard(2)]
    assert len(seq) == 1 and seq[0].kernel == "causal_context" and not seq[0].inputs[1].is_shard()
    strategies = generate_strategies(graph, (2, 2))[nodes[0].name]
    both = [s for s in strategies if all(p == Shard(2) for p in s.out_spec)]
    assert not both, "the sequence may be split on one mesh axis only (the swap runs in one axis's group)"
    assert any(s.out_spec == (Shard(0), Shard(2)) for s in strategies), "data parallel beside context parallel"


def test_bidirectional_attention_splits_the_sequence_without_a_kernel():
    _, nodes = _sdpa_views(causal=False)
    seq = [r for r in sdpa_rule(OpView(nodes[0])) if r.output == Shard(2)]
    assert len(seq) == 1 and seq[0].kernel is None


def _without_context_parallel(monkeypatch):
    """The attention rule less its causal sequence split: the planner without context parallelism."""
    import torch

    from autopar.passes.strategies import registry

    packet = torch.ops.aten.scaled_dot_product_attention
    full = registry._RULES[packet]
    monkeypatch.setitem(registry._RULES, packet, lambda view: [r for r in full(view) if r.kernel != "causal_context"])


def _long_single_head_gpt():
    """Sequence 2048, batch 1, one head: neither the batch nor the heads can be split, only the sequence."""
    from examples.gpt import GPTConfig, make_gpt

    return make_gpt(GPTConfig(seq_len=2048, n_embd=32, n_head=1, vocab_size=64, n_layer=2), batch_size=1)


def test_a_budget_only_context_parallelism_meets_gets_a_context_parallel_plan(monkeypatch):
    import autopar
    from autopar.errors import AutoparError
    from autopar.planner.driver import PlanOptions, memory_bounds

    model, batch = _long_single_head_gpt()
    cluster, options = autopar.Cluster.local(4), PlanOptions(zero=0, recompute="none")
    with_cp = memory_bounds(capture(model, batch), cluster, options)[0]
    with monkeypatch.context() as m:
        _without_context_parallel(m)
        without_cp = memory_bounds(capture(model, batch), cluster, options)[0]
        budget = (with_cp + without_cp) / 2
        with pytest.raises(AutoparError):  # negative control: no plan fits without the sequence split
            autopar.plan(model, cluster.with_memory(budget), batch, stages=1, zero=0, recompute="none")
    assert with_cp < 0.95 * without_cp
    plan = autopar.plan(model, cluster.with_memory(budget), batch, stages=1, zero=0, recompute="none")
    attention = [sh for s in plan.stages for n, sh in s.shardings.items() if "scaled_dot_product" in n]
    assert attention and all(sh.out == "RS(2)" and [1, "causal_context"] in [list(k) for k in sh.kernels]
                             for sh in attention), [(sh.out, sh.kernels) for sh in attention]


def test_without_memory_pressure_a_batch_is_split_rather_than_the_sequence():
    import autopar
    from examples.gpt import GPTConfig, make_gpt

    model, batch = make_gpt(GPTConfig(seq_len=256, n_embd=32, n_head=1, vocab_size=64, n_layer=2), batch_size=8)
    plan = autopar.plan(model, autopar.Cluster.local(4), batch, stages=1, zero=0, recompute="none")
    attention = [sh for s in plan.stages for n, sh in s.shardings.items() if "scaled_dot_product" in n]
    assert attention and not any(sh.kernels for sh in attention), [(sh.out, sh.kernels) for sh in attention]
