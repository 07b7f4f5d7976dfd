"""compile=True: every rank's generated module under torch.compile (inductor's C++ backend on CPU ranks).

The fast tier: the MLP, tensor-parallel on 2 gloo ranks, compiled, trains as one device does (fp32: loss ≤ 1e-5
relative at each of 3 AdamW steps, every parameter ≤ 1e-4), compiles one graph per rank in its first step and
none after (the recompile count, dynamo's ``unique_graphs``); the negative control breaks the all-reduce inside
the compiled graph and must fail the same check; a case whose inductor fails falls back to eager with one
warning naming the cause and still matches. The GPT example, HF Llama, pipelines, interleaving, recompute and
ZeRO-3 compiled are in tests/test_compiled_slow.py (each compile takes a minute or more on 2 cores). The
cases share the parity suites' 2-rank launch (conftest.parity_runs); each compiling rank uses a fresh
inductor cache in a temporary directory (tests/parity.py).
"""
import pytest

import autopar
from autopar.errors import OptionError
from autopar.runtime.compiled import resolve

CASE = ("mlp", (1, 2), "auto:c:nograd", None)
BROKEN = ("mlp", (1, 2), "auto:c", "all_reduce")
FALLBACK = ("mlp", (1, 2), "auto:c", "inductor")
PARITY_CASES, PARITY_TIMEOUT = {2: [CASE, BROKEN, FALLBACK]}, 600


@pytest.fixture(scope="module")
def results(parity_runs):
    return {case: parity_runs[case] for case in PARITY_CASES[2]}


def check_parity(r: dict) -> None:
    assert r["collectives"] > 0 and r["sharded_params"] > 0, "the plan must shard: nothing would be tested"
    assert r["loss_err"] <= 1e-5, r
    assert r["param_err"] <= 1e-4, r
    assert r["ranks_agree"], "train_step must return the same loss on every rank"


def check_one_compile(per_rank: list[dict], steps: int = 3) -> None:
    """Each rank compiled its module's graph(s) during the first step and never again in ``steps`` steps."""
    for r in per_rank:
        assert r["compile_failures"] == [] and r["compile_warnings"] == [], r["compile_warnings"]
        graphs = r["graphs"][:steps]
        assert graphs[0] >= 1, "nothing was compiled"
        assert graphs == [graphs[0]] * steps, f"recompiled after step 1: {graphs}"


@pytest.mark.distributed
def test_compiled_tensor_parallel_training_matches_one_device(results):
    check_parity(results[CASE][0])
    check_one_compile(results[CASE])
    assert results[CASE][0]["graphs"][0] == 1, "a tensor-parallel MLP compiles to one graph (no graph break)"


@pytest.mark.distributed
def test_negative_control_the_compile_count_sees_a_new_graph(results):
    """A call under torch.no_grad() after training is a new graph for dynamo: the count used above moves."""
    for r in results[CASE]:
        assert r["graphs"][3] == r["graphs"][2] + 1, r["graphs"]


@pytest.mark.distributed
def test_negative_control_a_broken_all_reduce_inside_the_compiled_graph_breaks_parity(results):
    r = results[BROKEN][0]
    assert r["graphs"][0] >= 1, "the sabotaged case must have compiled"
    assert r["loss_err"] > 1e-5 or r["param_err"] > 1e-4, f"a broken all-reduce went unnoticed: {r}"


@pytest.mark.distributed
def test_a_failing_inductor_falls_back_to_eager_with_one_warning(results):
    for r in results[FALLBACK]:
        assert r["compile_failures"] == ["RuntimeError: inductor made to fail by the test"]
        assert len(r["compile_warnings"]) == 1, r["compile_warnings"]
        assert "inductor made to fail by the test" in r["compile_warnings"][0]
    check_parity(results[FALLBACK][0])


def test_auto_compiles_on_cuda_only_and_bools_force_it():
    assert resolve("auto", "cuda") is True and resolve("auto", "cpu") is False
    assert resolve(True, "cpu") is True and resolve(False, "cuda") is False


@pytest.mark.parametrize("bad", ["yes", 1, None, "inductor"])
def test_a_compile_value_that_is_no_choice_is_refused(bad):
    with pytest.raises(OptionError, match="compile=.* is not a choice"):
        resolve(bad, "cpu")


def test_compile_refuses_a_bad_value_before_anything_runs():
    from tests.models import make_mlp

    model, batch = make_mlp()
    with pytest.raises(OptionError, match="is not a choice"):
        autopar.compile(model, autopar.Cluster.local(1), batch, compile="always")
