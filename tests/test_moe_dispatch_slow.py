"""Opt-in (slow tier): the rest of the MoE models on 4 ranks under all-to-all expert parallelism.

The default run covers Mixtral on (1, 4), the example on a 2×2 mesh (EP × DP) and Qwen2-MoE in 2 pipeline
stages (``tests/test_moe_dispatch.py``); here OLMoE, Qwen2-MoE and the example with one expert per rank on
(1, 4), and Mixtral with EP × DP on 2×2, each 3 AdamW steps in fp32 against one device (same bounds).
"""
import pytest

from tests.test_moe_dispatch import _id

CASES = [("olmoe", (1, 4), "a2a", None), ("zoo_qwen2_moe", (1, 4), "a2a", None), ("moe_example", (1, 4), "a2a", None),
         ("zoo_mixtral", (2, 2), "a2a", None)]
PARITY_CASES, PARITY_TIMEOUT = {4: CASES}, 900


@pytest.fixture(scope="module")
def results(parity_runs):
    return {case: parity_runs[case][0] for case in CASES}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_four_rank_all_to_all_experts_match_the_reference(results, case):
    r = results[case]
    assert "expert_all_to_all" in r["kernels"], r["kernels"]
    assert r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-4, r
    assert r["keys_match"] and r["shapes_match"] and r["ranks_agree"]
