"""Training-loop idioms are exact under every plan kind: each case runs a loop on the sharded module and on a
single-device copy (``tests/loop_cases.py``), inside the shared parity launches of 2 and 4 gloo ranks.

Tolerances (fp32): loss relative error <= 1e-5, parameter relative error <= 1e-4 per tensor with a gradient;
fp16 (against one device under the same autocast + GradScaler): 1e-3 both. Every negative control puts back
the defect its idiom had and must fail the same check.
"""
import pytest

pytestmark = pytest.mark.distributed

ALL_2 = ["dp", "z1", "z2", "z3", "tp", "pp", "fp16"]
ALL_4 = ["tp", "z3", "ppv2"]
RUNS_2 = {"accum": ALL_2 + ["z2/frozen", "pp/frozen"], "clip": ALL_2, "plainopt": ["z1", "z2", "z3", "fp16"],
          "eval": ["dp", "z3", "tp", "pp"], "groups": ["dp", "tp", "pp", "dp/frozen"], "rng": ["tp", "dp", "z3"]}
RUNS_4 = {"accum": ALL_4, "clip": ALL_4, "eval": ["tp", "ppv2"], "rng": ["tp"]}
CONTROLS_2 = [("accum", k, "old_sync") for k in ("dp", "z2", "tp", "pp")] + [
    ("clip", "tp", "local_norm"), ("plainopt", "z2", "no_adopt"), ("eval", "dp", "no_eval"),
    ("groups", "tp", "one_group"), ("rng", "tp", "no_rng")]
CONTROLS_4 = [("accum", "z3", "old_sync"), ("accum", "ppv2", "old_sync"), ("clip", "ppv2", "local_norm")]
CASES = {
    2: [("loop", (1, 2), f"{i}/{k}", None) for i, kinds in RUNS_2.items() for k in kinds]
       + [("loop", (1, 2), f"{i}/{k}", s) for i, k, s in CONTROLS_2]
       + [("loop", (1, 2), "groups/z2", None)],  # refused: see test_groups_that_split_a_zero_shard_...
    4: [("loop", (2, 2), f"{i}/{k}", None) for i, kinds in RUNS_4.items() for k in kinds]
       + [("loop", (2, 2), f"{i}/{k}", s) for i, k, s in CONTROLS_4],
}
PARITY_CASES = CASES  # launched with the other parity suites' (conftest.parity_runs)
PARITY_TIMEOUT = 600

PARITY = [c for cases in CASES.values() for c in cases if not c[3] and c[2] != "groups/z2" and "rng/" not in c[2]]
RNG = [c for cases in CASES.values() for c in cases if not c[3] and c[2].startswith("rng/")]
NEGATIVE = [c for cases in CASES.values() for c in cases if c[3] and c[3] != "no_rng"]


@pytest.fixture(scope="module")
def results(parity_runs):
    return {case: parity_runs[case] for cases in CASES.values() for case in cases}


def _id(case):
    return f"{case[1][0] * case[1][1]}ranks-{case[2]}" + (f"-{case[3]}" if case[3] else "")


def _tolerance(case) -> float:
    return 1e-3 if case[2].endswith("fp16") else 1e-4


def _exact(r: dict, case) -> bool:
    loss_tolerance = 1e-3 if case[2].endswith("fp16") else 1e-5
    return r["loss_err"] <= loss_tolerance and r["param_err"] <= _tolerance(case)


@pytest.mark.parametrize("case", PARITY, ids=_id)
def test_loop_idiom_matches_single_device(results, case):
    for r in results[case]:  # every rank's view of the trained weights
        assert r["compared"] > 0, r
        assert _exact(r, case), r


@pytest.mark.parametrize("case", NEGATIVE, ids=_id)
def test_negative_control_fails_the_same_check(results, case):
    assert not _exact(results[case][0], case), f"the sabotage went unnoticed: {results[case][0]}"


@pytest.mark.parametrize("case", [c for c in PARITY if c[2].startswith("clip/")], ids=_id)
def test_clipping_uses_the_true_global_norm_on_every_rank(results, case):
    """Both steps clip (to half the true norm): the norm autopar returns equals one device's, bit for bit the
    same on every rank; torch's own clipping of this rank's tensors is refused, naming pm.clip_grad_norm_."""
    norms = [r["norms"] for r in results[case]]
    assert all(n == norms[0] for n in norms), f"ranks clipped by different norms: {norms}"
    for mine, true in norms[0]:
        assert abs(mine - true) <= _tolerance(case) * true, norms[0]
    assert all(r["refused"] for r in results[case]), results[case][0]


@pytest.mark.parametrize("case", [c for c in PARITY if c[2].startswith("eval/")], ids=_id)
def test_train_mode_turns_dropout_back_on(results, case):
    assert all(r["dropout_on"] for r in results[case]), "two training-mode forwards gave the same loss"


@pytest.mark.parametrize("case", [c for c in PARITY if c[2].startswith("groups/")], ids=_id)
def test_named_param_groups_and_a_scheduler_step_as_on_one_device(results, case):
    assert all(r["lrs"] == [1e-3 / 4] * 2 for r in results[case]), "LambdaLR stepped pm.optimizer's groups"


@pytest.mark.parametrize("case", [c for c in PARITY if c[2].endswith("/frozen")], ids=_id)
def test_frozen_parameters_stay_as_they_were(results, case):
    assert all(r["frozen_equal"] is True for r in results[case]), results[case][0]


def test_groups_that_split_a_zero_shard_are_one_clear_error(results):
    message = results[("loop", (1, 2), "groups/z2", None)][0]["refused"]
    assert message and "param groups" in message and "zero=0" in message, message


def _rng_agrees(per_rank: list) -> bool:
    """Every rank saw the same losses and replicated weights, and the step after loading the checkpoint
    repeated the saved step exactly (same dropout masks)."""
    return all(r["losses"] == per_rank[0]["losses"] for r in per_rank) and \
        all(r["repeat"] == r["losses"][-1][0] for r in per_rank)


@pytest.mark.parametrize("case", RNG, ids=_id)
def test_dropout_agrees_across_ranks_seeded_apart_and_resumes_from_checkpoints(results, case):
    assert _rng_agrees(results[case]), [(r["losses"], r["repeat"]) for r in results[case]]
    assert results[case][0]["own_draws"] >= 1, "no dropout on a sharded value drew its own mask"


def test_negative_control_per_rank_generators_disagree(results):
    assert not _rng_agrees(results[("loop", (1, 2), "rng/tp", "no_rng")])


def test_a_rank_local_norm_is_caught(results):
    r = [x["norms"] for x in results[("loop", (1, 2), "clip/tp", "local_norm")]]
    assert r[0] != r[1], "negative control: ranks that skip the all-reduce disagree on the norm"


def test_plan_kinds_are_what_they_claim(results):
    two = {c[2]: results[c][0] for c in CASES[2]}
    assert [two[f"accum/z{k}"]["zero"] for k in (1, 2, 3)] == [[1], [2], [3]]
    assert two["accum/tp"]["sharded_params"] == 3 and two["accum/pp"]["stages"] == 2
    four = {c[2]: results[c][0] for c in CASES[4]}
    assert four["accum/ppv2"]["virtual_stages"] == 2 and four["accum/tp"]["sharded_params"] == 3
