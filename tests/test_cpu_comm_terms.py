"""Two CPU-profile terms of the gradient sync and ZeRO-3, each only where measured: ``Cluster.comm_overlap``
(the share of a collective that compute beside it hides; gloo's threads share the ranks' cores) and ZeRO-3's
collectives priced from the in-step all-gather / reduce-scatter fits. Controls: clusters without them price
as before, byte for byte. Fast tier: planning on a simulated 2-rank CPU cluster, no process groups."""
import dataclasses

import pytest
import torch

import autopar
from autopar.cost_models.zero3 import exposed_gather
from autopar.errors import ClusterError
from autopar.hardware.cluster import CollectiveFit
from autopar.planner.plan_builder import exposed_sync
from autopar.profiling.profiler_in_step import comm_overlap, with_in_step_fits
from examples.gpt import GPT, GPTConfig, make_batch

CFG = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, n_embd=64)
DATA_PARALLEL = {"p_*": "RR", "idx": "RS(0)", "targets": "RS(0)"}  # on the 1x2 mesh: weights whole, batch split
FITS = {"all_reduce/2": CollectiveFit(alpha=5e-4, beta=2e-9),
        "all_gather/2@step": CollectiveFit(alpha=1e-3, beta=1.8e-9),  # ~0.9 of the all-reduce, not half
        "reduce_scatter/2@step": CollectiveFit(alpha=1e-3, beta=1.6e-9)}


def _cluster(fits=None, **fields) -> autopar.Cluster:
    base = autopar.Cluster.local(2)
    link = dataclasses.replace(base.intra_node, fits={**base.intra_node.fits, **(fits or {})})
    return dataclasses.replace(base, intra_node=link, inter_node=link, **fields)


def _plan(cluster, zero: int) -> autopar.Plan:
    torch.manual_seed(0)
    return autopar.plan(GPT(CFG), cluster, make_batch(CFG, 8), stages=1, recompute="none", microbatches=2,
                        zero=zero, pin=DATA_PARALLEL)


def test_overlap_scales_only_the_hidden_part():
    hidden_all = exposed_sync(1.0, 10.0, 4, 0.0)  # 4 buckets behind a long backward: s/K exposed
    assert hidden_all == pytest.approx(0.25)
    assert exposed_sync(1.0, 10.0, 4, 0.0, overlap=0.0) == pytest.approx(1.0)  # nothing hides: all of it
    assert exposed_sync(1.0, 10.0, 4, 0.0, overlap=0.5) == pytest.approx(0.625)
    assert exposed_sync(1.0, 10.0, 1, 0.0, overlap=0.0) == exposed_sync(1.0, 10.0, 1, 0.0)  # one bucket: exposed anyway
    assert exposed_gather(1.0, 10.0, 4) == pytest.approx(0.25)
    assert exposed_gather(1.0, 10.0, 4, overlap=0.0) == pytest.approx(1.0)


def test_profiler_reads_overlap_from_the_two_windows():
    assert comm_overlap({"all_reduce": (0.010, 0.007), "all_gather": (0.010, 0.009)}) == pytest.approx(0.2)
    assert comm_overlap({"all_reduce": (0.030, 0.021), "all_gather": (0.010, 0.010)}) == pytest.approx(0.225)  # pooled
    assert comm_overlap({"all_reduce": (0.010, 0.012)}) == 0.0  # slower beside compute: clipped
    assert comm_overlap({"all_reduce": (0.0, 0.001)}) is None  # nothing measurable after the burst
    cluster, note = with_in_step_fits(autopar.Cluster.local(2), [{"overlap": {"all_reduce": (0.01, 0.008)}}])
    assert cluster.comm_overlap == pytest.approx(0.2) and "compute hides 0.20" in note
    untouched, _ = with_in_step_fits(autopar.Cluster.local(2), [{}])  # control: GPUs and one rank measure none
    assert untouched.comm_overlap == 1.0


def test_comm_overlap_is_validated_and_absent_from_files_at_its_default():
    assert "comm_overlap" not in autopar.Cluster.local(2).to_dict()
    measured = _cluster(comm_overlap=0.3)
    assert autopar.Cluster.from_dict(measured.to_dict()).comm_overlap == 0.3
    for bad in (1.5, -0.1, "0.3", True):
        with pytest.raises(ClusterError, match="comm_overlap must be a share between 0 and 1"):
            _cluster(comm_overlap=bad)


def test_zero3_collectives_are_priced_from_the_in_step_fits_where_measured():
    plain, priced = _plan(_cluster({"all_reduce/2": FITS["all_reduce/2"]}), 3), _plan(_cluster(FITS), 3)
    p, q = plain.stages[0].predicted, priced.stages[0].predicted
    assert "zero3_gather_measured" not in p  # control: no in-step fit, the halves of the all-reduce as before
    assert q["zero3_gather_measured"] > p["zero3_gather"] > 0
    assert q["zero3_scatter_excess"] > 0
    assert priced.predicted["step_time"] > plain.predicted["step_time"]
    # levels 0-2 have no level-3 buckets: the in-step fits leave them alone
    assert "zero3_gather_measured" not in _plan(_cluster(FITS), 2).stages[0].predicted


def test_plans_without_the_terms_are_byte_identical():
    cluster = _cluster({"all_reduce/2": FITS["all_reduce/2"]})
    assert _plan(cluster, 3).to_json() == _plan(dataclasses.replace(cluster, comm_overlap=1.0), 3).to_json()
    slower = _plan(dataclasses.replace(cluster, comm_overlap=0.0), 0)
    assert slower.stages[0].predicted["comm_overlap"] == 0.0
    assert slower.predicted["step_time"] >= _plan(cluster, 0).predicted["step_time"]
