"""Training with activation recompute equals one device: recompute on all layers and on some, in a
single-stage (SPMD, tensor-parallel under a memory squeeze) plan and in 2 × 2 pipelines, 4 gloo ranks.

Tolerances as in test_parity (fp32, 3 AdamW steps): loss relative error ≤ 1e-5 at each step, parameters
≤ 1e-4. The single-stage cases also check that the recomputed regions ran collectives again in backward
(counted on every rank; checkpoint stops a replay after the last tensor backward needs, so a collective
whose output nothing saves is not re-run, which is why the pipelined cases need not replay any). The
negative control replays each recomputed region without its collectives (on every rank alike, so
nothing hangs) and must fail the same check.
"""
import pytest

CASES = [
    ("gpt", (1, 4), "auto:rc-full", None),
    ("gpt", (1, 4), "auto:rc-1", None),
    ("gpt", (1, 4), "pp2x2-1f1b:rc-full", None),
    ("hf_gpt2", (1, 4), "pp2x2-1f1b:rc-1", None),
]
NEGATIVE = [("gpt", (1, 4), "auto:rc-full", "replay")]

pytestmark = [pytest.mark.distributed]


PARITY_CASES = {4: CASES + NEGATIVE}  # one 4-rank launch with the other parity suites (conftest.parity_runs)


@pytest.fixture(scope="module")
def results(parity_runs):
    out = {case: dict(parity_runs[case][0]) for case in PARITY_CASES[4]}
    for case in CASES:
        out[case]["replayed_anywhere"] = sum(r["replayed_comm_calls"] for r in parity_runs[case])
        out[case]["regions_anywhere"] = sum(r["regions"] for r in parity_runs[case])
    return out


def _id(case):
    return f"{case[0]}-{case[2]}" + ("-sabotaged" if case[3] else "")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_recomputed_training_matches_single_device(results, case):
    r = results[case]
    wanted = case[2].split(":rc-")[1]
    recomputed = sorted(layer for stage in r["recompute"] for layer in stage)
    assert recomputed == ([0, 1] if wanted == "full" else [int(wanted)]), r["recompute"]
    assert r["regions_anywhere"] > 0, "no rank's generated code has a checkpointed region"
    if case[2].startswith("auto"):  # tensor parallel inside the regions: their collectives must replay
        assert r["replayed_anywhere"] > 0, "no collective ran again in backward"
    assert r["loss_err"] <= 1e-5, r
    assert r["param_err"] <= 1e-4, r
    assert r["keys_match"] and r["shapes_match"] and r["ranks_agree"]


@pytest.mark.parametrize("case", NEGATIVE, ids=_id)
def test_replay_without_its_collectives_breaks_parity(results, case):
    r = results[case]
    assert r["param_err"] > 1e-4, f"a replay that skipped its collectives went unnoticed: {r}"
