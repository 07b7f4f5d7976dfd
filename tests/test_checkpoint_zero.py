"""Sharded ZeRO optimizer state survives pm.save/load into other plans and world sizes.

Two launches. 4 ranks train the GPT example 3 AdamW steps at ZeRO 1 (one 2×2 stage, parameters replicated,
optimizer state in flat bucket shards) and save; then again at ZeRO 3 (parameters sharded between uses too)
and save that. 2 fresh ranks load the ZeRO-1 checkpoint into three other plans, and the ZeRO-3 one into two,
train 3 more steps each, and must match one device trained 6 steps (tolerances of tests/parity.py):
ZeRO 0 data parallel, ZeRO 2 data parallel (2-way shards from 4-way ones), Megatron tensor parallel; from
ZeRO 3: ZeRO 1 and ZeRO 3 data parallel. Negative control: the same resume loading only the model (a fresh
optimizer) must fail that check.
"""
import itertools

import pytest
import torch

import autopar
from autopar.runtime.checkpoint_zero import boxes
from tests.models import make_small_gpt
from tests.parity import EPS, LR, rel
from tests.test_checkpoint import LOSS_TOL, PARAM_TOL, STEPS, single_device_run, train

DP = {"stages": 1, "pin": {"p_*": "RR", "idx": "S(0)S(0)", "targets": "S(0)S(0)"}}   # on the 2×2 mesh
DP2 = {"stages": 1, "pin": {"p_*": "RR", "idx": "RS(0)", "targets": "RS(0)"}}        # on the 1×2 mesh
TP = {"stages": 1, "pin": {"p_*_q_weight": "RS(0)", "p_*_k_weight": "RS(0)", "p_*_v_weight": "RS(0)",
                           "p_*_fc_weight": "RS(0)", "p_*_o_weight": "RS(1)", "p_*_proj_weight": "RS(1)",
                           "idx": "RR", "targets": "RR"}}
SAVED_AT = (1, 3)  # the ZeRO levels the 4-rank run saves at, one directory each
RESUMES = {"zero0-dp": (1, 0, DP2, True), "zero2-dp": (1, 2, DP2, True), "zero0-tp": (1, 0, TP, True),
           "no-optimizer-state": (1, 1, DP2, False), "zero3>zero1-dp": (3, 1, DP2, True),
           "zero3>zero3-dp": (3, 3, DP2, True)}  # name: (level saved at, level resumed at, layout, optimizer?)


def save_at_zero1_and_zero3(rank: int, directory: str) -> dict:
    out = {}
    for level in SAVED_AT:
        model, batch = make_small_gpt()
        pm = autopar.compile(model, autopar.Cluster.local(4, mesh_shape=(2, 2)), batch, zero=level, **DP)
        opt = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
        losses = train(pm, opt, batch, STEPS)
        pm.save(f"{directory}-zero{level}", opt)
        out[level] = {"losses": losses, "zero": sorted(set(pm.plan.stages[0].zero.values())),
                      "shards": sum(1 for b in pm.runner.gradsync.buckets if b.level >= 1)}
    return out


def resume_on_two_ranks(rank: int, directory: str) -> dict:
    out = {}
    for name, (saved_at, zero, options, with_optimizer) in RESUMES.items():
        model, batch = make_small_gpt()
        pm = autopar.compile(model, autopar.Cluster.local(2, mesh_shape=(1, 2)), batch, zero=zero, **options)
        opt = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
        pm.load(f"{directory}-zero{saved_at}", opt if with_optimizer else None)
        losses = train(pm, opt, batch, STEPS)
        sharded = sum(1 for n, s in pm.plan.stages[0].shardings.items() if n.startswith("p_") and "S" in s.out)
        out[name] = {"losses": losses, "state": pm.full_state_dict(), "sharded": sharded,
                     "zero": sorted(set(pm.plan.stages[0].zero.values()))}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("zero_checkpoint") / "step3")
    first = autopar.launch(save_at_zero1_and_zero3, 4, directory, timeout=180)
    resumed = autopar.launch(resume_on_two_ranks, 2, directory, timeout=240)
    reference, snapshots = single_device_run(2 * STEPS)
    return {"first": first[0], "resumed": resumed[0], "reference": reference, "final": snapshots[2 * STEPS]}


def errors(result: dict, runs) -> tuple[float, float]:
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], runs["reference"][STEPS:]))
    param_err = max(rel(result["state"][k], v) for k, v in runs["final"].items())
    return loss_err, param_err


@pytest.mark.distributed
@pytest.mark.parametrize("level", SAVED_AT)
def test_saving_run_shards_optimizer_state(runs, level):
    first = runs["first"][level]
    assert first["zero"] == [level] and first["shards"] > 0
    assert max(abs(a - b) / abs(b) for a, b in zip(first["losses"], runs["reference"][:STEPS])) <= LOSS_TOL


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["zero0-dp", "zero2-dp", "zero0-tp", "zero3>zero1-dp", "zero3>zero3-dp"])
def test_zero_checkpoint_resumes_exactly_under_another_plan(runs, name):
    result = runs["resumed"][name]
    assert result["zero"] == ([RESUMES[name][1]] if RESUMES[name][1] else [])
    assert (result["sharded"] > 0) == (name == "zero0-tp"), "the TP plan must shard parameters, the DP ones not"
    loss_err, param_err = errors(result, runs)
    assert loss_err <= LOSS_TOL and param_err <= PARAM_TOL, (name, loss_err, param_err)


@pytest.mark.distributed
def test_resume_without_the_optimizer_state_fails_the_same_check(runs):
    loss_err, param_err = errors(runs["resumed"]["no-optimizer-state"], runs)
    assert param_err > PARAM_TOL, f"a resume with a fresh optimizer went unnoticed: {param_err}"


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), ()])
def test_flat_ranges_cut_into_boxes_cover_each_element_once(shape):
    numel = max(1, torch.Size(shape).numel())
    flat = torch.arange(numel).reshape(shape)
    for start, end in itertools.combinations(range(numel + 1), 2):
        seen = []
        for offsets, sizes in boxes(shape, start, end):
            box = flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            seen += box.reshape(-1).tolist()
        assert seen == list(range(start, end)), (shape, start, end)
