"""compile=True on the models and layouts whose compilation takes minutes on 2 cores (the slow tier).

On 2 gloo ranks, each compiled, each against one device (fp32: loss ≤ 1e-5 relative at each of 3 AdamW
steps, every parameter ≤ 1e-4 relative): the GPT example tensor-parallel, with full recompute (the regions
traced as activation-checkpoint regions), pipelined (2 stages, 1F1B, 4 microbatches), interleaved (2 chunks
per rank), and data parallel at ZeRO-3 (the unit gathers and frees are graph breaks); HF Llama
tensor-parallel. Each rank compiles its module(s) in the first step and
never again (dynamo's graph count stays put over the 3 steps: 4 microbatches and 2 chunks reuse their graphs).
Negative controls: the all-reduce broken inside the compiled Llama, the backward transfer broken in the
compiled pipeline.
"""
import pytest

from tests.test_compiled import check_one_compile, check_parity

# Interleaved, compiled, measured before element-wise cancellation was left out of the comparison:
# blocks.1.mlp.fc.bias at 1.07e-4 relative (eager 4.4e-6), all of it one element whose step-1 gradient was
# 6.9e-9 against a median |g| of 1.6e-3: inductor's reduction order changes such a gradient by ~2e-9, and
# AdamW (lr/eps = 1000) turns that into a 2.3e-6 step (tests/parity.py, ``_cancelled_elements``).
INTERLEAVED = ("gpt4", (1, 2), "pp2x1v2-interleaved:c", None)
PARITY = [("gpt", (1, 2), "auto:c", None), ("gpt", (1, 2), "auto:rc-full:c", None),
          ("gpt", (1, 2), "pp2x1-1f1b:c", None), INTERLEAVED,
          ("gpt", (1, 2), "dp:z3:c", None), ("zoo_llama", (1, 2), "auto:c", None)]
NEGATIVE = [("zoo_llama", (1, 2), "auto:c", "all_reduce"), ("gpt", (1, 2), "pp2x1-1f1b:c", "transfer")]
PARITY_CASES, PARITY_TIMEOUT = {2: PARITY + NEGATIVE}, 900
pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def results(parity_runs):
    return {case: parity_runs[case] for case in PARITY_CASES[2]}


def _id(case):
    return f"{case[0]}-{case[2]}" + (f"-sabotaged-{case[3]}" if case[3] else "")


@pytest.mark.parametrize("case", PARITY, ids=_id)
def test_compiled_training_matches_one_device_and_compiles_once(results, case):
    r = results[case][0]
    if "dp" not in case[2] and "pp" not in case[2]:
        check_parity(r)
    else:  # data parallel and 1-device stages shard no parameter: parity and agreement only
        assert r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-4, r
        assert r["ranks_agree"]
    check_one_compile(results[case])
    if "rc-full" in case[2]:
        assert r["regions"] > 0, "no recomputed region was generated"
    if ":z3" in case[2]:
        assert r["zero"] == [3]


@pytest.mark.parametrize("case", NEGATIVE, ids=_id)
def test_negative_controls_break_compiled_parity(results, case):
    r = results[case][0]
    assert r["graphs"][0] >= 1, "the sabotaged case must have compiled"
    assert r["loss_err"] > 1e-5 or r["param_err"] > 1e-4, f"the sabotage went unnoticed: {r}"
