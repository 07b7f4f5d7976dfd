"""Context parallelism: attention split over the sequence equals one device, on 2 and 4 gloo ranks.

Cases (sequence 256, 3 AdamW steps, tolerances of test_parity): the GPT example with ``is_causal`` SDPA (the
``causal_context`` kernel: prefix keys, offset mask, zig-zag swap), the same GPT attending both ways (the
plain query-row split), and a Hugging Face Llama (rotary positions, GQA, and the materialized causal mask
its SDPA path passes, split by rows); on a sequence axis alone and beside a data-parallel axis. Keys and
values are all-gathered; their gradients reduce-scattered. Negative controls: the zig-zag swap skipped
(each rank attends with its mirror's offsets) and the sum of the gathered keys' gradients dropped.
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
        ("gpt_long", (1, 2), "cp", "cp_swap")],
    4: [("gpt_long", (1, 4), "cp", None), ("gpt_long", (2, 2), "cp", None), ("llama_long", (2, 2), "cp", None),
        ("llama_long", (2, 2), "cp", "kv_grad")],
}
PARITY_CASES = CASES
PARITY_TIMEOUT = 300
PARITY = [c for cases in CASES.values() for c in cases if not c[3]]
NEGATIVE = [c for cases in CASES.values() for c in cases if c[3]]


def _id(case):
    return f"{case[0]}-{case[1][0]}x{case[1][1]}" + (f"-{case[3]}" if case[3] else "")


@pytest.fixture(scope="module")
def results(parity_runs):
    return {case: parity_runs[case][0] for case in PARITY + NEGATIVE}


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
