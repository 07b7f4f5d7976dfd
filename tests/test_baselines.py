"""The hand-written Megatron baselines (examples/megatron_baselines.py) train exactly like one device.

One 4-rank gloo launch trains every layout, and two deliberately broken ones, for 3 AdamW steps on the GPT
example; the tests compare every rank's losses and full state dict with single-device training on the same
global batch. Tolerances as in test_parity.py: loss relative error ≤ 1e-5 at each step, parameter relative
error ‖a−b‖/‖b‖ ≤ 1e-4 per tensor (fp32). The negative controls must fail that same check.

SEED = 4 makes the check measure parallelism rather than round-off. AdamW normalizes each gradient element,
so an element of a zero-initialized bias whose gradient is ~1e-8 (eps = 1e-6) moves by an amount set by
its last bits; with seed 0, single-device fp32 training itself ends 1.7e-4 away from fp64 on
blocks.1.mlp.fc.bias. test_reference_is_well_conditioned guards the margin.
"""
import contextlib
import copy
from unittest import mock

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.parallel import RowwiseParallel

import autopar
from examples import megatron_baselines
from examples.gpt import GPTConfig, make_gpt
from examples.megatron_baselines import LAYOUTS, Layout, block_ranges, build, check_fits, megatron_block_plan

LR, EPS, STEPS = 1e-3, 1e-6, 3
CONFIG, BATCH, SEED, MICROBATCHES = GPTConfig(n_layer=4), 8, 4, 4
LOSS_TOL, PARAM_TOL = 1e-5, 1e-4

# Broken on purpose: replicas that never all-reduce their gradients (data parallel forgotten: each rank
# steps on its own quarter of the batch), and row-parallel layers whose partial sums are never
# all-reduced (Megatron's forward "g" collective forgotten).
NO_ROW_ALL_REDUCE = {**megatron_block_plan(), "attn.o": RowwiseParallel(output_layouts=Partial()),
                     "mlp.proj": RowwiseParallel(output_layouts=Partial())}
BROKEN = {"DP4-no-grad-all-reduce": (Layout(dp=4), None),
          "TP4-no-row-all-reduce": (Layout(tp=4), NO_ROW_ALL_REDUCE)}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / (b.double().norm() + 1e-30))


def train_case(name: str) -> dict:
    """3 steps of one layout on this rank: its losses and the gathered full state dict."""
    model, batch = make_gpt(CONFIG, batch_size=BATCH, seed=SEED)
    layout, block_plan = BROKEN.get(name, (LAYOUTS.get(name), None))
    skip_replicate = mock.patch.object(megatron_baselines, "replicate_over_dp", lambda stage, dp_mesh: None)
    with skip_replicate if name == "DP4-no-grad-all-reduce" else contextlib.nullcontext():
        hp = build(layout, model, batch, MICROBATCHES, block_plan=block_plan)
    opt = torch.optim.AdamW(hp.parameters(), lr=LR, eps=EPS)
    losses = []
    for _ in range(STEPS):
        losses.append(hp.train_step(*batch))
        opt.step()
        opt.zero_grad()
    local = [p.to_local() if isinstance(p, DTensor) else p for p in hp.parameters()]
    return {"losses": losses, "state": hp.full_state_dict(), "local_numel": sum(p.numel() for p in local),
            "dtensor_params": sum(isinstance(p, DTensor) for p in hp.parameters())}


def wrong_world_error() -> str:
    """build's error for a 2-rank layout on this 4-rank world."""
    model, batch = make_gpt(CONFIG, batch_size=BATCH, seed=SEED)
    try:
        build(Layout(dp=2), model, batch)
    except ValueError as error:
        return str(error)
    return "no error"


def train_every_case(rank: int, names: list[str]) -> dict[str, dict | str]:
    return {**{name: train_case(name) for name in names}, "wrong-world": wrong_world_error()}


def single_device(dtype: torch.dtype) -> dict:
    model, batch = make_gpt(CONFIG, batch_size=BATCH, seed=SEED)
    model.to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for _ in range(STEPS):
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": copy.deepcopy(model.state_dict())}


def parity_errors(run: dict, ref: dict) -> tuple[float, float]:
    """(largest loss relative error over the steps, largest per-tensor parameter relative error)."""
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref["losses"]))
    return loss_err, max(rel(run["state"][k], v) for k, v in ref["state"].items())


@pytest.fixture(scope="module")
def runs() -> list[dict[str, dict]]:
    """Per rank, per case: losses and full state dict (one launch for everything: start-up costs seconds)."""
    return autopar.launch(train_every_case, 4, [*LAYOUTS, *BROKEN], timeout=60)


@pytest.fixture(scope="module")
def reference() -> dict:
    return single_device(torch.float32)


def test_reference_is_well_conditioned(reference):
    fp64 = single_device(torch.float64)
    _, drift = parity_errors(reference, fp64)
    assert drift <= 0.1 * PARAM_TOL, f"fp32 vs fp64 drift {drift:.2e}: this seed tests round-off, pick another"


def parity_failures(runs: list[dict[str, dict]], reference: dict, name: str) -> list[str]:
    """Every way case ``name`` differs from single-device training, on any rank (empty: parity holds)."""
    failures = []
    for rank, run in enumerate(per_case[name] for per_case in runs):
        if list(run["state"]) != list(reference["state"]):
            failures.append(f"rank {rank}: state_dict keys {list(run['state'])[:3]}... differ from the model's")
        elif any(run["state"][k].shape != v.shape for k, v in reference["state"].items()):
            failures.append(f"rank {rank}: state_dict shapes differ from the model's")
        loss_err, param_err = parity_errors(run, reference)
        if loss_err > LOSS_TOL:
            failures.append(f"rank {rank}: loss error {loss_err:.2e}, losses {run['losses']}")
        if param_err > PARAM_TOL:
            failures.append(f"rank {rank}: parameter error {param_err:.2e}")
    if len({tuple(per_case[name]["losses"]) for per_case in runs}) > 1:
        failures.append("ranks returned different losses")
    return failures


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_device(runs, reference, name):
    failures = parity_failures(runs, reference, name)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_shards_what_it_claims(runs, reference, name):
    """Guards against a parity test of nothing: tp and pp cut each rank's parameters, dp and tp make
    them DTensors (replicate's and parallelize_module's)."""
    layout, full_numel = LAYOUTS[name], sum(v.numel() for v in reference["state"].values())
    for run in (per_case[name] for per_case in runs):
        assert (run["local_numel"] < 0.75 * full_numel) == (layout.tp > 1 or layout.pp > 1), run["local_numel"]
        assert (run["dtensor_params"] > 0) == (layout.tp > 1 or layout.dp > 1), run["dtensor_params"]


@pytest.mark.parametrize("name", list(BROKEN))
def test_negative_control_breaks_parity(runs, reference, name):
    assert parity_failures(runs, reference, name), f"{name} went unnoticed"


def test_layout_for_another_world_raises_value_error(runs):
    assert "needs 2 ranks, got a world of 4" in runs[0]["wrong-world"]


def test_bad_inputs_raise_value_error():
    model, batch = make_gpt(GPTConfig(n_head=4), batch_size=6)
    with pytest.raises(ValueError, match="divisible by 8"):
        check_fits(Layout(pp=2, dp=2), model, batch, microbatches=4)
    with pytest.raises(ValueError, match="at least 4 microbatches"):
        check_fits(Layout(pp=4), model, batch, microbatches=2)
    with pytest.raises(ValueError, match="whole heads"):
        check_fits(Layout(tp=8), model, batch, microbatches=1)
    with pytest.raises(ValueError, match="at least 4 blocks"):
        block_ranges(3, 4)
    with pytest.raises(ValueError, match="positive"):
        Layout(dp=0)
    assert block_ranges(5, 2) == [range(0, 3), range(3, 5)]
