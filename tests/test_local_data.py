"""data="local" trains as data="global": each rank passes only the rows ``pm.data_shard`` names.

One 4-rank launch (gloo, fp32). Per case, the same model is compiled twice, data="global" (every rank passes
the batch) and data="local" (each rank passes rows [index·B/count, (index+1)·B/count)), and trained 3 AdamW
steps side by side: losses within 1e-5 and moved parameters within 1e-4 (relative), as tests/parity.py.
Cases: a 2×2 mesh whose batch is split on one axis only (the other axis's ranks pass the same rows), a
2-stage pipeline (4 microbatches, 1F1B), an interleaved plan (2 model chunks per device), ZeRO-3 over 4
ranks, and 3 stages where each rank passes by name only the inputs its stage reads (the middle one reads
none and passes nothing: ``pm.train_step()``).
Negative control in every case: before training, ranks whose share is not the first pass the first one
instead; the forward loss must then fail the 1e-5 check the right shares pass.
Bad shares (2×2 case): a share of the wrong size, peers passing different rows, and a token id out of
range on one rank are each the same error on every rank, not a hang.
"""
import copy

import pytest
import torch

import autopar
from tests.models import make_small_gpt
from tests.parity import EPS, LR, _with_gradient, rel

STEPS = 3
PP2 = [{"layers": [0, 0], "submesh": [1, 2]}, {"layers": [1, 1], "submesh": [1, 2]}]
CASES = {
    "2x2": ((2, 2), 2, {"stages": 1, "pin": {"idx": "S(0)R", "targets": "S(0)R"}}),
    "pp2": ((1, 4), 2, {"stages": PP2, "layers": 2, "microbatches": 4, "schedule": "1f1b",
                        "pin": {"idx": "RS(0)", "targets": "RS(0)"}}),
    "interleaved": ((1, 4), 4, {"stages": [{"layers": [k, k], "submesh": [1, 2]} for k in range(4)], "layers": 4,
                                "virtual_stages": 2, "schedule": "interleaved", "microbatches": 4,
                                "pin": {"idx": "RS(0)", "targets": "RS(0)"}}),
    "zero3": ((1, 4), 2, {"stages": 1, "zero": 3, "pin": {"idx": "RS(0)", "targets": "RS(0)", "p_*": "RR"}}),
    "pp3": ((1, 4), 2, {"stages": [{"layers": [0, 0], "submesh": [1, 2]}, {"layers": [1, 1], "submesh": [1, 1]},
                                   {"layers": [2, 2], "submesh": [1, 1]}], "layers": 3, "microbatches": 2,
                        "schedule": "1f1b", "pin": {"p_*": "RR"}}),
}


def share(batch, data_shard) -> tuple:
    index, count = data_shard
    return tuple(t.chunk(count)[index] for t in batch)


def local_inputs(pm, batch, name: str) -> tuple:
    """(args, kwargs) a rank passes: its share; in the pp3 case, by name and only the inputs its stages
    read (the middle rank reads none and passes nothing)."""
    if name != "pp3":
        return share(batch, pm.data_shard), {}
    read = {i for per_stage in pm._local_data.blocks.values() for i in per_stage}
    mine = share(batch, pm.data_shard)
    return (), {key: mine[i] for i, key in enumerate(("idx", "targets")) if i in read}


def _optimizer(pm, zero: bool):
    return pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS) if zero else torch.optim.AdamW(pm.parameters(), lr=LR,
                                                                                           eps=EPS)


def run_case(name: str) -> dict:
    mesh, layers, options = CASES[name]
    model, batch = make_small_gpt(n_layer=layers)
    cluster = autopar.Cluster.local(4, mesh_shape=mesh)
    pm_g = autopar.compile(copy.deepcopy(model), cluster, batch, **options)
    pm_l = autopar.compile(copy.deepcopy(model), cluster, batch, data="local", **options)
    index, count = pm_l.data_shard
    with torch.no_grad():
        ref = pm_g(*batch).item()
        args, named = local_inputs(pm_l, batch, name)
        right = pm_l(*args, **named).item()
        wrong_share = share(batch, (0, count)) if pm_l._local_data.reads_input() else ()
        wrong = pm_l(*wrong_share).item()  # every rank of a share other than the first passes the first one
    zero = options.get("zero") == 3
    opt_g, opt_l = _optimizer(pm_g, zero), _optimizer(pm_l, zero)
    loss_err = 0.0
    for _ in range(STEPS):
        lg = pm_g.train_step(*batch)
        ll = pm_l.train_step(*args, **named)
        for opt in (opt_g, opt_l):
            opt.step()
            opt.zero_grad()
        loss_err = max(loss_err, abs(ll.item() - lg.item()) / abs(lg.item()))
    reference = copy.deepcopy(model)  # which parameters a step moves: one single-device backward
    reference(*batch).backward()
    moved = _with_gradient(reference)
    full_g, full_l = pm_g.full_state_dict(), pm_l.full_state_dict()
    return {"data_shard": (index, count), "loss_err": loss_err, "forward_err": abs(right - ref) / abs(ref),
            "negative_err": abs(wrong - ref) / abs(ref), "param_err": max(rel(full_l[k], full_g[k]) for k in moved),
            "stages": len(pm_l.plan.stages), "reads": pm_l._local_data.reads_input(), "named": sorted(named),
            "errors": bad_shares(pm_l, batch) if name == "2x2" else {}}


def bad_shares(pm, batch) -> dict:
    """{mistake: (error type, message)} on this rank, each made by one rank only."""
    from torch.distributed import get_rank

    rank, mine = get_rank(), share(batch, pm.data_shard)
    idx, targets = mine
    bad_id = idx.clone()
    bad_id[0, 0] = 10 ** 6
    mistakes = {"size": (idx[:-1], targets[:-1]) if rank == 3 else mine,
                "peer": share(batch, (1, 2)) if rank == 0 else mine,
                "index": (bad_id, targets) if rank == 2 else mine,
                "device": tuple(t.to("meta") for t in mine) if rank == 1 else mine}
    out = {}
    for what, inputs in mistakes.items():
        try:
            pm.train_step(*inputs)
            out[what] = None
        except Exception as e:  # noqa: BLE001 - the test checks the type
            out[what] = (type(e).__name__, str(e))
    return out


def run_all(rank: int) -> dict:
    return {name: run_case(name) for name in CASES}


@pytest.fixture(scope="module")
def runs():
    return autopar.launch(run_all, 4, timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_local_data_trains_as_global_data(runs, name):
    for rank, r in enumerate(runs):
        r = r[name]
        assert r["loss_err"] <= 1e-5, (rank, r)
        assert r["param_err"] <= 1e-4, (rank, r)
        assert r["forward_err"] <= 1e-5, (rank, r)
        assert r["negative_err"] > 1e-5, ("a rank passing another share must fail the same check", rank, r)


def test_data_shard_follows_the_plans_input_placement(runs):
    shards = {name: [r[name]["data_shard"] for r in runs] for name in CASES}
    assert shards["2x2"] == [(0, 2), (0, 2), (1, 2), (1, 2)], "batch split on mesh axis 0 only"
    assert shards["pp2"] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert shards["interleaved"] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert shards["zero3"] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert shards["pp3"][:2] == [(0, 2), (1, 2)] and shards["pp3"][3] == (0, 1)
    assert [r["pp3"]["reads"] for r in runs] == [True, True, False, True]


@pytest.mark.parametrize("mistake, kind, words", [("size", "InputError", "rank 3"),
                                                  ("peer", "InputError", "different rows"),
                                                  ("index", "IndexRangeError", "out of range"),
                                                  ("device", "InputError", "0 of 2): input 0 is on meta")])
def test_a_bad_share_on_one_rank_is_one_error_on_every_rank(runs, mistake, kind, words):
    seen = [r["2x2"]["errors"][mistake] for r in runs]
    assert all(s is not None for s in seen), seen
    assert {s[0] for s in seen} == {kind}, seen
    assert len({s[1] for s in seen}) == 1 and words in seen[0][1], seen
