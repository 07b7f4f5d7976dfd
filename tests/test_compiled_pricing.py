"""The cost model under compile=True (``Cluster.compiled_time_scale``, ``Cluster.compiled_view``) and
``pm.step_stats()``'s arithmetic (``autopar.runtime.throughput``), without starting processes."""
import dataclasses
import json

import pytest
import torch

import autopar
from autopar.errors import ClusterError, UsageError
from autopar.passes.capture import capture
from autopar.profiling.probe_step import end_to_end_factor, probe_shape, probe_step_ops
from autopar.runtime.throughput import StepClock, model_flops, step_stats, work_per_step
from tests.models import make_mlp


def measured(cluster, scale=0.5):
    return dataclasses.replace(cluster, compiled_time_scale=scale)


def test_an_unmeasured_compiled_factor_stays_out_of_the_json_and_the_view():
    cluster = autopar.Cluster.local(2)
    assert "compiled_time_scale" not in json.loads(cluster.to_json())
    assert cluster.compiled_view() is cluster


def test_a_measured_compiled_factor_round_trips_and_prices_without_host_time():
    cluster = measured(autopar.Cluster.local(2), 0.4)
    assert autopar.Cluster.from_json(cluster.to_json()) == cluster
    view = cluster.compiled_view()
    assert view.op_overhead == 0.0 and view.compute_time_scale == 0.4 and cluster.op_overhead > 0
    assert "torch.compile" in view.source


def test_a_negative_compiled_factor_is_refused():
    with pytest.raises(ClusterError, match="compiled_time_scale"):
        measured(autopar.Cluster.local(2), -1.0)


def test_plans_without_compile_are_byte_identical_and_with_it_priced_by_the_factor():
    model, batch = make_mlp()
    base = autopar.Cluster.local(2)
    eager = autopar.plan(model, base, batch, compile=False)
    assert autopar.plan(model, base, batch, compile=True).to_json() == eager.to_json()  # unmeasured: as eager
    assert autopar.plan(model, base, batch).to_json() == eager.to_json()  # "auto" is off on CPU ranks
    cluster = measured(base, 0.25)
    off = autopar.plan(model, cluster, batch, compile=False)
    assert [s.shardings for s in off.stages] == [s.shardings for s in eager.stages]
    assert off.predicted == eager.predicted  # the factor is not used with compile off
    on = autopar.plan(model, cluster, batch, compile=True)
    assert on.cluster["op_overhead"] == 0.0 and on.cluster["compute_time_scale"] == 0.25
    assert on.predicted["compute"] < eager.predicted["compute"]  # negative control of the equality above


def test_the_compiled_probe_factor_is_measured_over_roofline_without_host_time():
    cluster = autopar.Cluster.local(2)
    ops = probe_step_ops(cluster)
    roofline = sum(r for r, _ in ops)
    assert end_to_end_factor(cluster, 3 * roofline, compiled=True) == pytest.approx(3.0)
    eager = end_to_end_factor(cluster, 3 * roofline)  # the eager factor subtracts the ops' host time first
    assert eager < 3.0 and probe_shape("cpu").dtype == "float32"


def test_model_flops_count_forward_and_backward_of_every_matmul():
    model, batch = make_mlp(batch_size=16)
    f1, f2, f3 = (2 * 16 * i * o for i, o in ((32, 128), (128, 128), (128, 16)))
    # forward 1x each; backward: weight gradients of all three, input gradients of fc2 and fc3 (x needs none)
    flops, how = model_flops(capture(model, batch), 2)
    assert flops == pytest.approx(2 * (2 * f1 + 3 * f2 + 3 * f3)) and how.startswith("flop_counter")


def test_model_flops_fall_back_to_three_times_the_forward_per_op(monkeypatch):
    """Negative control of the whole-graph count: an op flop_counter refuses sends it to the per-op count."""
    from torch.utils import flop_counter

    model, batch = make_mlp(batch_size=16)
    graph = capture(model, batch)
    original = flop_counter.FlopCounterMode.__exit__
    calls = []

    def refuse_once(self, *args):
        original(self, *args)
        if not calls:
            calls.append(1)
            raise RuntimeError("a formula refused")
    monkeypatch.setattr(flop_counter.FlopCounterMode, "__exit__", refuse_once)
    f1, f2, f3 = (2 * 16 * i * o for i, o in ((32, 128), (128, 128), (128, 16)))
    flops, how = model_flops(graph, 1)
    assert flops == pytest.approx(3 * (f1 + f2 + f3)) and "3 x forward" in how


def test_tokens_come_from_an_integer_input_and_samples_otherwise():
    assert work_per_step([((8, 32), "torch.int64"), ((8, 32), "torch.int64")]) == ("tokens", 256)
    assert work_per_step([((16, 32), "torch.float32"), ((16, 16), "torch.float32")]) == ("samples", 16)


def _plan_like(precision="fp32", devices=2, signature=None):
    stage = type("S", (), {"ranks": list(range(devices))})()
    return type("P", (), {"precision": precision, "cluster": {"peak_flops": {"float32": 1e9, "bfloat16": 4e9}},
                          "num_devices": devices, "input_signature": signature or [((4, 8), "torch.int64")],
                          "stages": [stage]})()


def test_step_stats_are_the_mean_interval_after_warm_up_and_mfu_over_the_peak():
    clock = StepClock()
    clock.starts.extend([0.0, 5.0, 6.0, 8.0])  # a slow first (compiling) step, then 1 s and 2 s
    clock.calls = 4
    stats = step_stats(clock, _plan_like(), flops=3e9, warmup=1)
    assert stats["steps"] == 2 and stats["step_time"] == pytest.approx(1.5)
    assert stats["tokens_per_s"] == pytest.approx(32 / 1.5)
    assert stats["mfu"] == pytest.approx(3e9 / 1.5 / (1e9 * 2))
    bf16 = step_stats(clock, _plan_like("bf16"), flops=3e9, warmup=1)
    assert bf16["peak_dtype"] == "bfloat16" and bf16["mfu"] == pytest.approx(stats["mfu"] / 4)
    assert step_stats(clock, _plan_like(), flops=3e9, warmup=0)["step_time"] == pytest.approx(8 / 3)


def test_step_stats_before_two_steps_or_with_a_bad_warmup_say_what_to_do():
    clock = StepClock()
    clock.tick()
    with pytest.raises(UsageError, match="run at least 3 train_steps"):
        step_stats(clock, _plan_like(), 1.0)
    with pytest.raises(UsageError, match="warmup"):
        step_stats(clock, _plan_like(), 1.0, warmup=-1)


def test_the_step_clock_window_drops_old_intervals_but_counts_them_as_warm_up():
    clock = StepClock()
    for t in range(10):
        clock.starts.append(float(t * t))
        clock.calls += 1
    assert clock.intervals(0) == [float(2 * t + 1) for t in range(9)]
    assert clock.intervals(2) == [float(2 * t + 1) for t in range(2, 9)]
    torch.testing.assert_close(torch.tensor(clock.intervals(12)), torch.tensor([]))


def test_the_profiler_applies_the_compiled_factor_on_cpu_ranks_and_only_notes_it_on_gpus():
    from types import SimpleNamespace

    from autopar.profiling.profiler_training import _apply_compiled_factor

    cluster = autopar.Cluster.local(2)
    roofline = sum(r for r, _ in probe_step_ops(cluster))
    side = probe_shape("cpu").reference_side
    reference = 2.0 * side**3 / cluster.matmul_flops("float32", 2.0 * side**3)  # as the curve predicts: q = 1
    per_rank = [{"probe_compiled": (2 * roofline, reference)}, {"probe_compiled": (2 * roofline, reference)}]
    notes = []
    cpu = _apply_compiled_factor(cluster, per_rank, SimpleNamespace(kind="cpu"), notes)
    assert cpu.compiled_time_scale == pytest.approx(2.0) and "compiled_time_scale 2.00" in notes[0]
    gpu = _apply_compiled_factor(cluster, per_rank, SimpleNamespace(kind="cuda"), notes)
    assert gpu.compiled_time_scale == 0.0 and "not applied" in notes[1]
    assert _apply_compiled_factor(cluster, [{"probe_compiled": None}], SimpleNamespace(kind="cpu"), []) is cluster
