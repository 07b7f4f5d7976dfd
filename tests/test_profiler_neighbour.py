"""The profile's level as a training step meets the machine (``autopar.profiling.profiler_neighbour``).

No process group: the windows are timed on a scripted machine that runs the reference slower beside a
neighbour's step, and the priced probe step of a cluster assembled from the same raw figures at two levels
shows that ρ moves every compute price by itself.
"""
import dataclasses

import pytest

from autopar.hardware.cluster import Cluster
from autopar.profiling import profiler_neighbour as neighbour
from autopar.profiling.probe_step import probe_step_ops
from autopar.profiling.profiler import figures_at
from autopar.profiling.profiler_device import ProbeDevice
from autopar.profiling.profiler_training import apply_training_measurements


class _Neighbours:
    """One rank of two on a machine where the reference costs 1 ms beside the reference and ``beside_step`` ms
    beside a neighbour's step; the phase of a round (every rank times / rank 0 times / rank 1 times) is
    counted by the barriers, as the ranks agree on it."""

    kind, torch = "cpu", "cpu"

    def __init__(self, beside_step: float, rank: int = 0):
        self.beside_step, self.rank, self.barriers, self.steps = beside_step, rank, 0, 0

    def window_seconds(self, call, calls: int) -> float:
        phase = (self.barriers - 2) % 3  # after the warm-up barrier: 0 all time, 1 even ranks time, 2 odd ranks
        if call is not self.reference:
            self.steps += 1
            return calls * 5e-3
        return calls * 1e-3 * (1.0 if phase == 0 else self.beside_step)


def _measure(monkeypatch, machine, rounds: int = 6) -> dict:
    monkeypatch.setattr(neighbour.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(neighbour.dist, "get_rank", lambda: machine.rank)
    monkeypatch.setattr(neighbour.dist, "barrier", lambda: setattr(machine, "barriers", machine.barriers + 1))
    monkeypatch.setattr(neighbour, "slowest_rank", lambda seconds, probe: seconds)
    monkeypatch.setattr(neighbour, "warm_up", lambda call, times, probe: 1e-3)
    monkeypatch.setattr(neighbour, "neighbour_step", lambda device: (lambda: None))
    reference = type("Reference", (), {"call": staticmethod(lambda: None)})()
    machine.reference = reference.call
    settings = type("Settings", (), {"warmup": 1, "windows": 3, "window_s": 0.01, "probe_window_s": 0.01})()
    return neighbour.measure_neighbour(settings, machine, reference, rounds=rounds)


@pytest.mark.parametrize("rank", [0, 1])
def test_the_reference_beside_a_step_is_timed_apart_from_beside_the_reference(monkeypatch, rank):
    machine = _Neighbours(1.08, rank)
    raw = _measure(monkeypatch, machine)
    assert len(raw["beside_reference"]) == len(raw["beside_step"]) == 6 and machine.steps == 6  # steps when not timing
    assert neighbour.neighbour_factor([raw]) == pytest.approx(1.08)
    assert "compute figures × 1.080" in neighbour.neighbour_note([raw, raw])
    # controls: a neighbour's step that costs nothing reads 1; one that reads faster (other jobs' load) too
    assert neighbour.neighbour_factor([_measure(monkeypatch, _Neighbours(1.0, rank))]) == pytest.approx(1.0)
    assert neighbour.neighbour_factor([_measure(monkeypatch, _Neighbours(0.9, rank))]) == 1.0


def test_nothing_is_measured_on_gpus_or_one_rank(monkeypatch):
    monkeypatch.setattr(neighbour.dist, "get_world_size", lambda: 1)
    assert neighbour.measure_neighbour(None, ProbeDevice("cpu"), None) == {}
    monkeypatch.setattr(neighbour.dist, "get_world_size", lambda: 2)
    assert neighbour.measure_neighbour(None, type("P", (), {"kind": "cuda"})(), None) == {}
    assert neighbour.neighbour_factor([{}, {}]) == 1.0 and neighbour.neighbour_note([{}, None]) == ""


def _raw_rank() -> dict:
    """One rank's figures in reference units: the square-mm ladder has the reference (256³, 3.4e7 FLOPs) at 1."""
    training = {"mesh": {}, "tiny_step": 0.2, "linears": {"float32": [3.0, 2.5, 4.0, 3.5, 3.0]},
                "probe_step": 40.0, "probe_reference": 1.0, "norm_act": [5.0, 4.0, 6.0], "pipeline": None}
    return {"matmul": {"float32": [(2.0 * 256**3, 1.0), (1e9, 28.0)]}, "training": training}


def _cluster_at(level: float) -> Cluster:
    mine = figures_at(_raw_rank(), level)
    curve = [[flops, flops / t] for flops, t in mine["matmul"]["float32"]]
    isolated = dataclasses.replace(Cluster.local(2), matmul_curve={"float32": curve}, matmul_efficiency=1.0,
                                   peak_flops={"float32": max(r for _, r in curve)}, memory_bandwidth=1e10)
    return apply_training_measurements(isolated, [mine["training"]], ProbeDevice("cpu"))[0]


def _priced_probe_step(cluster: Cluster) -> float:
    return sum(cluster.compute_time_scale * r + o for r, o in probe_step_ops(cluster))


def test_rho_moves_every_compute_price_by_itself():
    """Figures at level · ρ: op_overhead, the matmul curves and the norm/activation bandwidth all move by ρ, and
    compute_time_scale makes the priced probe step match the probe timed at that level: ρ times the price."""
    at_level, beside_step = _cluster_at(1e-3), _cluster_at(1e-3 * 1.07)
    assert beside_step.op_overhead == pytest.approx(1.07 * at_level.op_overhead)
    assert beside_step.norm_act_bandwidth == pytest.approx(at_level.norm_act_bandwidth / 1.07)
    assert beside_step.peak_flops["float32"] == pytest.approx(at_level.peak_flops["float32"] / 1.07)
    assert _priced_probe_step(beside_step) == pytest.approx(1.07 * _priced_probe_step(at_level), rel=1e-6)
    # control: the same figures at the same level price the same step
    assert _priced_probe_step(_cluster_at(1e-3)) == pytest.approx(_priced_probe_step(at_level), rel=1e-12)


def test_the_benchmark_reads_rho_where_it_re_prices_the_probe():
    """cost_model_fidelity's drift reads the probe timed beside the probe at the profile's level × ρ, so a
    steady machine reads q = 1 with ρ in the file (control: the same file without ρ reads the probe's time
    1/ρ faster than priced)."""
    from benchmarks.fidelity.cost_model_fidelity import drift, neighbour_level

    note = neighbour.neighbour_note([{"beside_reference": [1e-3] * 3, "beside_step": [1.06e-3] * 3}] * 2)
    plain = dataclasses.replace(_cluster_at(1e-3), source="profiled")
    with_rho = dataclasses.replace(_cluster_at(1.06e-3), source="profiled" + note)
    assert neighbour_level(with_rho) == 1.06 and neighbour_level(plain) == 1.0
    probe = [{"probe_step": [40.0 * 1e-3] * 3}] * 2  # the probe at the profile's level, beside the probe
    assert drift(plain, probe) == pytest.approx(1.0, rel=1e-6)
    assert drift(with_rho, probe) == pytest.approx(1.0, rel=1e-6)
    assert drift(dataclasses.replace(with_rho, source="profiled"), probe) < 0.96  # ρ not read back: "faster"


def test_replay_cost_refuses_bad_arguments(tmp_path, capsys):
    from benchmarks.fidelity.replay_cost import main

    path = tmp_path / "old.json"
    Cluster.local(2).to_json(path)  # no reference level in its source: no units to price in
    with pytest.raises(SystemExit):
        main(["--cluster", str(path)])
    assert "states no reference level" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--cluster", str(path), "--cycles", "0"])
    assert "--cycles and --batch must be at least 1" in capsys.readouterr().err


def test_probe_after_model_refuses_bad_arguments(capsys):
    from benchmarks.fidelity.probe_after_model import main

    for argv in (["--seconds", "5"], ["--nprocs", "0"]):  # no late window to read / no rank to run it
        with pytest.raises(SystemExit):
            main(argv)
        assert "--seconds must exceed 6 and --nprocs be at least 1" in capsys.readouterr().err
