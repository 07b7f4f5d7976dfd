"""The fidelity method: what the profiler's speed reference compares, and how the benchmark reads its rounds.

No process group. The profiler's compute_time_scale compares the reference mm with the square-mm curve as
measured, not with the curve after the training-matmul factor scaled it (that read the factor as a slower
machine and priced every roofline 1/factor too slow); its compute probes come back in reference units and
become seconds at one level; the benchmark divides each round's common speed out of its step times and
counts the signs of its errors.
"""
import dataclasses
import statistics

import pytest

from autopar.hardware.cluster import Cluster
from autopar.profiling.fidelity import round_normalized, sign_balance
from autopar.profiling.probe_step import end_to_end_factor, probe_step_prediction
from autopar.profiling.profiler_training import training_seconds


def _square_and_trained(factor: float) -> tuple[Cluster, Cluster]:
    """(a CPU device whose square mm runs at 1 GFLOP/s, the same with its curve scaled by ``factor``)."""
    square = dataclasses.replace(Cluster.local(1), peak_flops={"float32": 1e9}, matmul_efficiency=1.0,
                                 memory_bandwidth=1e30, op_overhead=1e-5,
                                 matmul_curve={"float32": [[1e6, 1e9], [1e9, 1e9]]})
    curve = [[x, rate * factor] for x, rate in square.matmul_curve["float32"]]
    return square, dataclasses.replace(square, matmul_curve={"float32": curve}, peak_flops={"float32": 1e9 * factor})


def test_the_reference_mm_is_compared_with_the_square_curve():
    square, trained = _square_and_trained(0.8)
    roofline, overhead = probe_step_prediction(trained)
    measured = overhead + 1.3 * roofline  # the probe ran 1.3× the trained pricing
    reference = 2.0 * 256**3 / 1e9  # the reference mm at exactly the square curve's speed: no drift
    assert end_to_end_factor(trained, measured, reference, square=square) == pytest.approx(1.3)
    # negative control: against the factor-scaled curve the same machine reads as 0.8× as fast, and s is
    # divided by the factor a second time
    assert end_to_end_factor(trained, measured, reference) == pytest.approx(1.3 / 0.8)
    # a real slowdown during the probe (reference twice as slow as the square curve) still halves s
    assert end_to_end_factor(trained, measured, 2 * reference, square=square) == pytest.approx(0.65)


def test_training_probes_become_seconds_at_the_reference_level():
    raw = {"tiny_step": 2.0, "probe_step": 30.0, "probe_reference": 1.0, "linears": {"float32": [4.0, 5.0]},
           "norm_act": [6.0], "probe_compiled": (20.0, 1.0), "attention": None, "mesh": {"k": [(1, 2, 0.5)]}}
    out = training_seconds(raw, 1e-3)
    assert out["tiny_step"] == pytest.approx(2e-3) and out["probe_step"] == pytest.approx(30e-3)
    assert out["probe_reference"] == pytest.approx(1e-3) and out["linears"]["float32"] == pytest.approx([4e-3, 5e-3])
    assert out["norm_act"] == pytest.approx([6e-3]) and out["probe_compiled"] == pytest.approx((20e-3, 1e-3))
    assert out["attention"] is None and out["mesh"] == raw["mesh"]  # collectives are timed in seconds already
    assert raw["probe_step"] == 30.0  # the rank's raw record is left as it was


def test_round_normalized_takes_out_what_slowed_a_whole_round():
    # two plans, 5 rounds; round 3 ran 1.5× slower for both, and plan b's own noise is in round 1
    a = [1.0, 1.0, 1.0, 1.5, 1.0]
    b = [2.0, 2.4, 2.0, 3.0, 2.0]
    steady = round_normalized({"a": a, "b": b})
    assert steady == pytest.approx({"a": 1.0, "b": 2.0})
    # a slow stretch of 3 rounds of 5 (more than the median can ignore) raises every plan alike
    slow = round_normalized({"a": [1.0, 1.5, 1.5, 1.5, 1.0], "b": [2.0, 3.0, 3.0, 3.0, 2.0]})
    assert slow["b"] / slow["a"] == pytest.approx(2.0)


def test_round_normalized_needs_the_same_rounds_for_every_plan():
    with pytest.raises(ValueError, match="same rounds"):
        round_normalized({"a": [1.0, 2.0], "b": [1.0]})
    with pytest.raises(ValueError, match="same rounds"):
        round_normalized({"a": []})


def test_sign_balance_counts_too_slow_and_too_fast():
    assert sign_balance([0.1, -0.2, 0.05, 0.0]) == (2, 1)
    assert sign_balance([0.1, 0.2]) == (2, 0)  # a single-sign bias


class _DriftingMachine:
    """A probe device whose clock reads each window as calls × cost × speed, the speed slowing by 10 % per
    window (other jobs' load arriving), so a figure timed alone depends on when it was timed."""

    kind = "cpu"
    torch = None

    def __init__(self, costs: dict):
        self.costs, self.windows = costs, 0  # costs: seconds per call of each call

    def window_seconds(self, call, calls: int) -> float:
        self.windows += 1
        return calls * self.costs[call] * (1.0 + 0.1 * self.windows)


def test_speed_reference_cancels_drift_that_plain_windows_keep(monkeypatch):
    from autopar.profiling import probes

    monkeypatch.setattr(probes.dist, "barrier", lambda: None)  # one process: nothing to agree with
    monkeypatch.setattr(probes, "slowest_rank", lambda seconds, probe: seconds)
    settings = type("Settings", (), {"warmup": 1, "windows": 5, "window_s": 0.01})()
    machine = _DriftingMachine({})
    reference = probes.SpeedReference(machine)
    step = lambda: None  # noqa: E731 - a call costing 3 reference calls
    machine.costs = {reference.call: 1e-3, step: 3e-3}
    assert reference.ratio(step, settings) == pytest.approx(3.0, rel=1e-9)  # the references around it cancel it
    assert reference.level() == pytest.approx(statistics.median(reference.windows))
    # negative control: the same call timed alone reads the drift (10 % per window) into its figure
    assert probes.seconds_per_call(step, 1, 5, machine) / 3e-3 > 1.5


def test_fresh_runs_refuses_bad_arguments_before_profiling(tmp_path, capsys):
    from benchmarks.fidelity.fresh_runs import main

    kept = tmp_path / "results.txt"
    kept.write_text("an earlier result\n")
    for argv, named in ((["--runs", "0", "--out", str(tmp_path / "new.txt")], "--runs must be at least 1"),
                        (["--out", str(kept)], "exists; name another --out")):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2 and named in capsys.readouterr().err
    assert kept.read_text() == "an earlier result\n"  # a results file is never overwritten


class _ScriptedMachine:
    """A probe device whose clock reads a window of ``calls`` calls as calls × cost × drift × noise: drift
    the whole machine's speed at that window (shared by every call), noise the next of the call's scripted
    per-window factors (1 once they run out): what moves the probe alone."""

    kind = "cpu"
    torch = None

    def __init__(self, drift_per_window: float = 0.0):
        self.costs, self.noise, self.windows, self.drift = {}, {}, 0, drift_per_window

    def window_seconds(self, call, calls: int) -> float:
        self.windows += 1
        noise = self.noise.get(call, [])
        return calls * self.costs[call] * (1.0 + self.drift * self.windows) * (noise.pop(0) if noise else 1.0)


def _reference_on(machine, monkeypatch):
    from autopar.profiling import probes

    monkeypatch.setattr(probes.dist, "barrier", lambda: None)  # one process: nothing to agree with
    monkeypatch.setattr(probes, "slowest_rank", lambda seconds, probe: seconds)
    reference = probes.SpeedReference(machine)
    machine.costs[reference.call] = 1e-3
    return reference


def _settings(max_windows: int):
    return type("Settings", (), {"warmup": 1, "windows": 5, "window_s": 0.01, "max_spread": 0.1,
                                 "max_windows": max_windows})()


def test_wide_spread_gets_more_windows_and_the_median_settles(monkeypatch):
    """A probe whose first windows scatter (0.6-1.6× its cost) on a drifting machine: the spread of its
    ratios is wide, so more windows are timed until it is not, and the median lands on the true ratio.
    (slowest_s given: no warm-up call, so every scripted factor falls on a timed window.)"""
    machine = _ScriptedMachine(drift_per_window=0.1)
    reference = _reference_on(machine, monkeypatch)
    step = lambda: None  # noqa: E731 - costs 3 reference calls
    machine.costs[step], machine.noise[step] = 3e-3, [1.6, 0.6, 1.5, 1.4, 1.0]
    timing = reference.measure(step, _settings(max_windows=20), slowest_s=3e-3)
    assert timing.ratio == pytest.approx(3.0, rel=1e-9) and timing.windows == 15
    assert timing.ratio_spread <= 0.1 and timing.reference_spread > 0.1  # the machine drifted 10 % a window
    # negative control: held to the first 5 windows, the scattered ones decide the median (1.4 × 3)
    machine = _ScriptedMachine(drift_per_window=0.1)
    reference = _reference_on(machine, monkeypatch)
    machine.costs[step], machine.noise[step] = 3e-3, [1.6, 0.6, 1.5, 1.4, 1.0]
    timing = reference.measure(step, _settings(max_windows=5), slowest_s=3e-3)
    assert timing.ratio == pytest.approx(4.2, rel=1e-9) and timing.windows == 5 and timing.ratio_spread > 0.1


def test_timing_tells_the_machine_moving_from_the_probe_moving(monkeypatch):
    """The machine drifting: the probe's own seconds and the reference spread, their ratio does not. The probe
    scattering on a steady machine: the ratio spreads with the probe while the reference holds."""
    step = lambda: None  # noqa: E731
    machine = _ScriptedMachine(drift_per_window=0.1)
    reference = _reference_on(machine, monkeypatch)
    machine.costs[step] = 2e-3
    moving_machine = reference.measure(step, _settings(max_windows=5), slowest_s=2e-3)
    assert moving_machine.ratio_spread == pytest.approx(0.0, abs=1e-9)
    assert moving_machine.probe_spread > 0.1 and moving_machine.reference_spread > 0.1
    machine = _ScriptedMachine()
    reference = _reference_on(machine, monkeypatch)
    machine.costs[step], machine.noise[step] = 2e-3, [1.3, 0.7, 1.0, 1.2, 0.9]
    moving_probe = reference.measure(step, _settings(max_windows=5), slowest_s=2e-3)
    assert moving_probe.ratio_spread == pytest.approx(moving_probe.probe_spread) and moving_probe.ratio_spread > 0.1
    assert moving_probe.reference_spread == 0.0


def test_relative_spread_is_the_interquartile_range_over_the_median():
    from autopar.profiling.probes import relative_spread

    assert relative_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((4.0 - 2.0) / 3.0)
    assert relative_spread([2.0, 2.0, 2.0]) == 0.0 and relative_spread([7.0]) == 0.0


def test_the_benchmark_prints_the_reference_speed_beside_the_profiles_level():
    from benchmarks.fidelity.cost_model_fidelity import profile_level, reference_line

    flops = 2.0 * 256**3
    cluster = dataclasses.replace(Cluster.local(2), source="...; compute probes timed against float32 mm 256³, "
                                  "their figures at its median speed (80.0 GFLOP/s per rank)")
    assert profile_level(cluster) == 80.0
    rounds = [flops / 60e9, flops / 60e9, flops / 40e9]  # seconds per call: two rounds at 60 GFLOP/s, one at 40
    launches = [[{"reference_mm": rounds}, {"reference_mm": rounds}]]
    line = reference_line(cluster, launches)
    assert "60.0 GFLOP/s per rank (rounds 40.0-60.0), 0.750 of the profile's 80.0" in line
    # a file profiled before the reference existed states no level: said so, not a number made up
    assert profile_level(Cluster.local(2)) is None
    assert "the profile states no level" in reference_line(Cluster.local(2), launches)


def test_reference_drift_is_the_reference_now_over_the_profiles_level():
    from benchmarks.fidelity.cost_model_fidelity import reference_drift

    flops = 2.0 * 256**3
    cluster = dataclasses.replace(Cluster.local(2), source="...; compute probes timed against float32 mm 256³, "
                                  "their figures at its median speed (80.0 GFLOP/s per rank)")
    launch = [{"reference_mm": [flops / 64e9, flops / 60e9, flops / 64e9]}, {"reference_mm": [flops / 64e9] * 3}]
    assert reference_drift(cluster, launch) == pytest.approx(80.0 / 64.0)  # the machine ran 1.25x slower
    assert reference_drift(Cluster.local(2), launch) is None  # no level stated: no correction made up


def test_step_parts_refuses_a_profile_without_a_reference_level(tmp_path, capsys):
    from benchmarks.fidelity.step_parts import main

    path = tmp_path / "old.json"
    Cluster.local(2).to_json(path)  # no "median speed (...)" in its source: nothing to express units in
    with pytest.raises(SystemExit):
        main(["--cluster", str(path)])
    assert "states no reference level" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--cluster", str(path), "--cycles", "0"])
    assert "--cycles must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--cluster", str(path), "--batch", "0"])
    assert "--batch must be at least 1" in capsys.readouterr().err


def test_probe_in_process_pairs_each_benchmark_round_with_the_fresh_rounds_around_it():
    from benchmarks.fidelity.probe_in_process import paired_ratios

    # rank 0: the benchmark's rounds 0-2 (bare, built, built); the fresh launch's rounds 0-2 ran after each
    bench = [[("bare", 30.0), ("built", 33.0), ("built", 36.0)]]
    fresh = [[("fresh", 30.0), ("fresh", 30.0), ("fresh", 30.0)]]
    assert paired_ratios(bench, fresh, "bare", 1) == [pytest.approx(1.0)]
    assert paired_ratios(bench, fresh, "built", 1) == [pytest.approx(1.1), pytest.approx(1.2)]
    # a machine that slows for everyone between rounds moves both sides of a pair: the pair stays at 1
    slowing = [[("built", 30.0), ("built", 40.0)]]
    assert paired_ratios(slowing, [[("fresh", 30.0), ("fresh", 50.0)]], "built", 1) == [
        pytest.approx(1.0), pytest.approx(1.0)]
    # negative control: set against the first fresh round alone, the second pair would read the slowdown
    assert slowing[0][1][1] / 30.0 != pytest.approx(1.0)
    assert paired_ratios(bench, fresh, "stepped", 1) == []


def test_probe_in_process_refuses_bad_arguments(capsys):
    from benchmarks.fidelity.probe_in_process import main

    for argv in ([], ["--cluster", "x.json", "--rounds", "1"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "--cluster is required and --rounds must be at least 2" in capsys.readouterr().err


def test_probe_in_process_reads_this_process_threads_by_name():
    import os

    from benchmarks.fidelity.probe_in_process import _thread_cpu

    threads = _thread_cpu()
    assert os.getpid() in threads  # the main thread's id is the process id
    assert all(isinstance(name, str) and seconds >= 0 for name, seconds in threads.values())


def test_item_4s_reference_mm_is_the_curves_call_and_allocates_nothing():
    import torch

    from autopar.profiling.probe_step import REFERENCE_SIDE, reference_mm_call

    a, b = (torch.randn(REFERENCE_SIDE, REFERENCE_SIDE) for _ in range(2))
    call = reference_mm_call(a, b)
    first, second = call(), call()  # both alive: an allocating call would need two buffers
    assert first.data_ptr() == second.data_ptr()
    assert torch.equal(second, a @ b)
    # negative control: the allocating mm q used to time needs a new buffer per call
    kept, again = torch.mm(a, b), torch.mm(a, b)
    assert kept.data_ptr() != again.data_ptr()
