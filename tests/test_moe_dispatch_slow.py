"""Opt-in (slow tier): the MoE models on 4 ranks under all-to-all expert parallelism, and compiled dispatch.

The default run covers every model on 2 ranks and the dispatch kernel on 4 (``tests/test_moe_dispatch.py``).
Here, each 3 AdamW steps in fp32 against one device (same bounds): the example with experts split on one
axis of a 2×2 mesh and data parallelism on the other (EP × DP), Mixtral on (1, 4), Qwen2-MoE in 2 pipeline
stages each splitting its experts (EP × PP), OLMoE, Qwen2-MoE and the example with one expert per rank on
(1, 4), Mixtral with EP × DP on 2×2; the wrong un-permute on the 2×2 example must break the match. Compiled
(``compile=True``, 2 ranks): the example and Mixtral (with the router's auxiliary loss) dispatching by
all-to-all inside the compiled modules, matching one device, each rank compiling in the first step only;
the wrong un-permute must break the compiled match too.
"""
import pytest

from tests.test_compiled import check_one_compile
from tests.test_moe_dispatch import _id

CASES = [("moe_example", (2, 2), "a2a", None), ("zoo_mixtral", (1, 4), "a2a", None),
         ("zoo_qwen2_moe", (1, 4), "pp2x2a2a-1f1b", None),
         ("olmoe", (1, 4), "a2a", None), ("zoo_qwen2_moe", (1, 4), "a2a", None), ("moe_example", (1, 4), "a2a", None),
         ("zoo_mixtral", (2, 2), "a2a", None)]
WRONG = [("moe_example", (2, 2), "a2a", "unpermute")]
COMPILED = [("moe_example", (1, 2), "a2a:c", None), ("zoo_mixtral_aux", (1, 2), "a2a:c", None)]
COMPILED_WRONG = [("moe_example", (1, 2), "a2a:c", "unpermute")]
PARITY_CASES, PARITY_TIMEOUT = {2: COMPILED + COMPILED_WRONG, 4: CASES + WRONG}, 900
pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def results(parity_runs):
    return {case: parity_runs[case] for cases in PARITY_CASES.values() for case in cases}


@pytest.mark.parametrize("case", CASES + COMPILED, ids=_id)
def test_four_rank_and_compiled_all_to_all_experts_match_the_reference(results, case):
    r = results[case][0]
    assert "expert_all_to_all" in r["kernels"], r["kernels"]
    assert r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-4, r
    assert r["keys_match"] and r["shapes_match"] and r["ranks_agree"]
    if case[2].startswith("pp"):
        assert len(r["stages"]) == 2, r["stages"]
    if case[2].endswith(":c"):
        check_one_compile(results[case])


@pytest.mark.parametrize("case", WRONG + COMPILED_WRONG, ids=_id)
def test_a_wrong_permutation_breaks_the_match(results, case):
    r = results[case][0]
    assert "expert_all_to_all" in r["kernels"]
    if case[2].endswith(":c"):
        assert r["graphs"][0] >= 1, "the sabotaged case must have compiled"
    assert r["loss_err"] > 1e-5 or r["param_err"] > 1e-4, f"a wrong permutation went unnoticed: {r}"
