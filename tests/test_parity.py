"""Sharded training equals one device: losses at every step and parameters after 3 AdamW steps.

Two launches (2 and 4 gloo ranks, shared with the other parity suites) run every case; each test reads its
case's figures. Tolerances: loss relative error ≤ 1e-5 at each step, parameter relative error ≤ 1e-4 per
tensor (fp32). The negative controls break all-reduce and must fail the same check.
"""
import pytest

MODELS = ["mlp", "gpt", "hf_gpt2"]
CASES = {
    2: [(m, (1, 2), "auto", None) for m in MODELS] + [("gpt", (1, 2), "dp", None), ("mlp", (1, 2), "dp", "all_reduce")],
    4: [(m, mesh, "auto", None) for m in MODELS for mesh in [(1, 4), (2, 2)]]
       + [("gpt", (2, 2), "dp", None), ("gpt", (2, 2), "auto", "all_reduce")],
}


PARITY_CASES = CASES  # launched with the other parity suites' (conftest.parity_runs)


@pytest.fixture(scope="module")
def results(parity_runs):
    return {case: parity_runs[case][0] for cases in CASES.values() for case in cases}


PARITY = [c for cases in CASES.values() for c in cases if not c[3]]
NEGATIVE = [c for cases in CASES.values() for c in cases if c[3]]


def _id(case):
    model, mesh, layout, sabotage = case
    return f"{model}-{mesh[0]}x{mesh[1]}-{layout}" + ("-sabotaged" if sabotage else "")


@pytest.mark.parametrize("case", PARITY, ids=_id)
def test_sharded_training_matches_single_device(results, case):
    r = results[case]
    assert r["collectives"] > 0, "the plan inserted no collective: nothing was tested"
    assert r["sharded_params"] > 0 or case[2] == "dp", "an auto plan under memory pressure must shard parameters"
    assert r["loss_err"] <= 1e-5, r
    assert r["param_err"] <= 1e-4, r
    assert r["keys_match"] and r["shapes_match"]
    assert r["ranks_agree"], "train_step must return the same loss on every rank"


@pytest.mark.parametrize("case", NEGATIVE, ids=_id)
def test_negative_control_breaks_parity(results, case):
    r = results[case]
    assert r["loss_err"] > 1e-5 or r["param_err"] > 1e-4, f"a broken all-reduce went unnoticed: {r}"
