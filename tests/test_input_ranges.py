"""Out-of-range token ids and targets raise on every rank, as one device raises, under layouts that hide them.

One launch of 2 ranks, two plans of the small GPT: a vocab-split embedding (pinned: each rank owns half
the rows and reads zero for the rest) and the planner's squeezed plan (batch-split loss: the rank holding
a bad target would raise alone). Cases: a token id = vocab size, a negative id, a target = vocab size, a
negative target, and targets at ignore_index (allowed: the loss must equal one device's). Every rank
must raise ``IndexRangeError``, an ``IndexError`` like one device's. Negative control: the same bad id
fed past the check (``pm.runner``) trains on silently under the vocab split.
"""
import copy

import pytest
import torch

import autopar
from autopar.errors import IndexRangeError
from tests.models import make_small_gpt
from tests.parity import layout_options

VOCAB_SPLIT = {"stages": 1, "pin": {"p_wte_weight": "RS(0)", "idx": "RR", "targets": "RR"}}


def bad_batches(batch) -> dict:
    idx, targets = batch
    out = {}
    for name, tensor, position, value in [("id=vocab", idx, 0, 256), ("id<0", idx, 1, -1),
                                          ("target=vocab", targets, 0, 256), ("target<0", targets, 1, -3)]:
        changed = tensor.clone()
        changed.view(-1)[tensor.numel() - 1 - position] = value  # in the last rows: a batch split's rank 1
        out[name] = (changed, targets) if tensor is idx else (idx, changed)
    return out


def ignored_batch(batch):
    idx, targets = batch
    targets = targets.clone()
    targets[:, ::3] = -100
    return idx, targets


def outcomes(pm, batch) -> dict:
    out = {}
    for name, bad in bad_batches(batch).items():
        try:
            pm.train_step(*bad)
            out[name] = "no error"
        except Exception as e:
            out[name] = (type(e).__name__, isinstance(e, IndexError), str(e))
    out["ignored"] = pm.train_step(*ignored_batch(batch)).item()
    return out


def rank_cases(rank: int, plans: dict) -> dict:
    out = {}
    for name, (cluster, plan_json) in plans.items():
        model, batch = make_small_gpt()
        pm = autopar.compile(model, cluster, batch, plan=autopar.Plan.from_json(plan_json))
        out[name] = outcomes(pm, batch)
        if name == "vocab":
            out["embedding kernel"] = pm.plan.stages[0].shardings["embedding"].kernels
            unchecked = bad_batches(batch)["id=vocab"]
            out["unchecked"] = pm.runner.train_step(unchecked, pm._loss_index).item()
    return out


@pytest.fixture(scope="module")
def runs():
    model, batch = make_small_gpt()
    vocab_cluster = autopar.Cluster.local(2)
    squeezed_cluster, options = layout_options("auto", "gpt", autopar.Cluster.local(2, mesh_shape=(1, 2)),
                                               model, batch)
    plans = {"vocab": (vocab_cluster, autopar.plan(model, vocab_cluster, batch, **VOCAB_SPLIT).to_json()),
             "squeezed": (squeezed_cluster, autopar.plan(model, squeezed_cluster, batch, **options).to_json())}
    reference = copy.deepcopy(model)(*ignored_batch(batch)).item()
    single = {}
    for name, bad in bad_batches(batch).items():
        with pytest.raises(IndexError) as err:
            copy.deepcopy(model)(*bad)
        single[name] = str(err.value)
    return autopar.launch(rank_cases, 2, plans, timeout=60), reference, single


@pytest.mark.distributed
@pytest.mark.parametrize("plan", ["vocab", "squeezed"])
def test_out_of_range_ids_and_targets_raise_index_error_on_every_rank(runs, plan):
    results, _, single = runs
    for rank, result in enumerate(results):
        for case in single:
            kind, is_index_error, message = result[plan][case]
            assert kind == IndexRangeError.__name__ and is_index_error, (rank, case, result[plan][case])
            assert "out of range" in message and "accepts 0..255" in message, message


@pytest.mark.distributed
@pytest.mark.parametrize("plan", ["vocab", "squeezed"])
def test_ignore_index_targets_are_allowed_and_match_one_device(runs, plan):
    results, reference, _ = runs
    for result in results:
        assert abs(result[plan]["ignored"] - reference) <= 1e-5 * abs(reference), (result[plan]["ignored"], reference)


@pytest.mark.distributed
def test_negative_control_the_vocab_split_hides_a_bad_id_without_the_check(runs):
    results, _, _ = runs
    assert results[0]["embedding kernel"] == ((1, "vocab_embedding"),), "the plan does not split the vocabulary"
    assert all(torch.isfinite(torch.tensor(r["unchecked"])) for r in results), "the layout did not hide it"
