"""Hand-computable cases for the calibration's cost terms: the scatter/gather pipeline send of Megatron-LM's
published runs, the profiler's end-to-end compute factor, and the fidelity benchmark's medians over launches."""
from __future__ import annotations

import dataclasses
import types

import pytest

from autopar.cluster import Cluster
from autopar.plan_builder import exposed_sync
from autopar.presets import dgx_a100, p3_16xlarge
from autopar.profiler_training import end_to_end_factor, probe_step_prediction
from benchmarks.calibration.published_schedule import scatter_gather_seconds
from benchmarks.fidelity.cost_model_fidelity import figures, median_rows


def test_scatter_gather_send_is_a_slice_per_nic_then_an_nvlink_gather():
    """Two DGX A100 nodes, a (2, 8) stage mesh, an activation of 2 GB split over the data-parallel axis and
    replicated over the 8 tensor-parallel ranks: each replica holds 1 GB, each rank sends 1/8 of it over its
    own NIC (180 GB/s per node / 8), and the receiver all-gathers the 8 slices over NVSwitch."""
    sender, receiver = _stage("S(0)R", range(16)), _stage("S(0)R", range(16, 32))
    nic = 0.9 * 8 * 200e9 / 8 / 8
    send = 6e-6 + 1e9 / 8 / nic
    gather = 5e-6 + 1e-6 * 7 + 7 / 8 * 1e9 / 240e9  # α + 7 ring steps + (n-1)/n · m / β
    assert scatter_gather_seconds(sender, receiver, "h", 2e9, dgx_a100(nodes=4)) == pytest.approx(send + gather)


def _stage(spec: str, ranks, mesh=(2, 8)):
    return types.SimpleNamespace(shardings={"h": types.SimpleNamespace(out=spec)}, mesh_shape=mesh,
                                 submesh=(2, 8) if mesh == (2, 8) else (1, mesh[1]), ranks=list(ranks))


def test_scatter_gather_of_a_fully_sharded_value_is_only_the_send():
    sender, receiver = _stage("S(0)S(1)", range(16)), _stage("S(0)S(1)", range(16, 32))
    assert scatter_gather_seconds(sender, receiver, "h", 16e9, dgx_a100(nodes=4)) == pytest.approx(
        6e-6 + 1e9 / (180e9 / 8))


def test_scatter_gather_inside_a_node_uses_the_pair_link():
    """Two 1x2 stages on one V100 node: each rank sends its whole shard over the pair's one NVLink (25 GB/s)."""
    sender, receiver = _stage("S(0)S(1)", (0, 1), (1, 2)), _stage("S(0)S(1)", (2, 3), (1, 2))
    assert scatter_gather_seconds(sender, receiver, "h", 2e9, p3_16xlarge()) == pytest.approx(8e-6 + 1e9 / 25e9)


def test_a_sync_after_backward_is_all_exposed():
    """One buffer all-reduced after the last backward (Megatron's local DDP): nothing hides it."""
    assert exposed_sync(0.4, backward=1.6, buckets=1, gather_share=0.0) == pytest.approx(0.4)
    assert exposed_sync(0.4, backward=1.6, buckets=100, gather_share=0.0) == pytest.approx(0.004)


def _flat_cluster(op_overhead: float) -> Cluster:
    """One CPU device at 1 GFLOP/s for every op and memory traffic priced at ~0 s."""
    return dataclasses.replace(Cluster.local(1), peak_flops={"float32": 1e9}, matmul_efficiency=1.0,
                               memory_bandwidth=1e30, op_overhead=op_overhead)


def test_probe_prediction_counts_the_blocks_matmul_flops():
    """TinyBlock(w) on t tokens: linears qkv (w→3w), out (w→w), fc (w→w) = 10·t·w² FLOPs forward, the two
    attention products 4·t²·w; backward twice the forward (every matmul input but x needs a gradient)."""
    t, w = 4, 8
    roofline, overhead = probe_step_prediction(_flat_cluster(0.0), width=w, tokens=t)
    assert roofline == pytest.approx(3 * (10 * t * w * w + 4 * t * t * w) / 1e9, rel=0.02)
    assert overhead == 0.0


def test_end_to_end_factor_is_measured_less_overhead_over_roofline():
    cluster = _flat_cluster(1e-5)
    roofline, overhead = probe_step_prediction(cluster)
    assert overhead > 0
    assert end_to_end_factor(cluster, overhead + 1.3 * roofline) == pytest.approx(1.3)
    # the scale already on the cluster does not enter the prediction it is measured against
    scaled = dataclasses.replace(cluster, compute_time_scale=5.0)
    assert end_to_end_factor(scaled, overhead + 1.3 * roofline) == pytest.approx(1.3)
    # a machine running at half the curve's speed during the probe (reference mm twice as slow) halves it
    flops = 2.0 * 256**3
    assert end_to_end_factor(cluster, overhead + 1.3 * roofline, 2 * flops / 1e9) == pytest.approx(0.65)


def _row(plan, pred_t, meas_t, mem_err):
    return {"plan": plan, "mesh": "1x4", "pred_t": pred_t, "meas_t": meas_t, "t_err": pred_t / meas_t - 1,
            "mem_err": mem_err}


def test_fidelity_figures_and_medians_over_launches():
    launches = [[_row("a", 1.0, 1.25, 0.1), _row("b", 2.0, 2.0, -0.3), _row("c", 3.0, 1.6, 0.0)],
                [_row("a", 1.0, 1.0, 0.2), _row("b", 2.0, 2.5, 0.1), _row("c", 3.0, 3.0, 0.0)],
                [_row("a", 1.0, 2.0, 0.0), _row("b", 2.0, 4.0, 0.0), _row("c", 3.0, 6.0, 0.0)]]
    first = figures(launches[0])
    assert first["time_err"] == pytest.approx(0.2)          # |errors| 0.2, 0, 0.875
    assert first["worst_mem_err"] == pytest.approx(0.3)
    assert first["spearman"] == pytest.approx(0.5)          # ranks 1, 2, 3 vs 1, 3, 2: 1 - 6·2 / (3·8)
    rows = median_rows(launches)
    assert [r["plan"] for r in rows] == ["a", "b", "c"]
    assert [r["meas_t"] for r in rows] == [1.25, 2.5, 3.0]
    assert rows[1]["mem_err"] == pytest.approx(0.0)
