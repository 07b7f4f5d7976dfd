"""Pipelined training equals one device: 2 stages × 2 devices, 4 × 1, and stages on 1 and 3 devices, each
with GPipe and 1F1B, on the GPT example and HF GPT-2 (tied embeddings across stages), 4 gloo ranks.

Tolerances as in test_parity: loss relative error ≤ 1e-5 at each of 3 AdamW steps, parameters ≤ 1e-4.
The negative control returns zero gradients between stages and must fail the same check.
"""
import pytest

from tests.parity import launch_cases

LAYOUTS = [f"{shape}-{schedule}" for shape in ("pp2x2", "pp4x1", "pp1+3") for schedule in ("1f1b", "gpipe")]
CASES = [(m, (1, 4), layout, None) for m in ("gpt", "hf_gpt2") for layout in LAYOUTS]
NEGATIVE = [("gpt", (1, 4), "pp2x2-1f1b", "transfer")]


@pytest.fixture(scope="module")
def results():
    return launch_cases(CASES + NEGATIVE, 4)[0]


def _id(case):
    return f"{case[0]}-{case[2]}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_pipelined_training_matches_single_device(results, case):
    r = results[case]
    shape, schedule = case[2].split("-")
    assert len(r["stages"]) == {"pp2x2": 2, "pp4x1": 4, "pp1+3": 2}[shape], r["stages"]
    assert r["schedule"] == schedule and r["microbatches"] == 4
    assert r["loss_err"] <= 1e-5, r
    assert r["param_err"] <= 1e-4, r
    assert r["keys_match"] and r["shapes_match"] and r["ranks_agree"]
    if shape == "pp2x2":
        assert r["sharded_params"] > 0, "each stage must itself be intra-op sharded"


@pytest.mark.parametrize("case", NEGATIVE, ids=_id)
def test_negative_control_breaks_pipeline_parity(results, case):
    r = results[case]
    assert r["param_err"] > 1e-4, f"zero gradients between stages went unnoticed: {r}"
