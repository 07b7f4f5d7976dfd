"""The probe step's windows in the state a model's step leaves (``SpeedReference.measure(before_window=...)``,
``profiler_neighbour.model_step``).

No process group: the windows are timed on a scripted machine where the probe runs ``slowdown`` × slower in
a window that follows a model's step than in one that follows its own calls, and the reference costs the
same either way; the real ``model_step`` is run once to show it is a whole model's forward + backward.
"""
import pytest
import torch

from autopar.profiling import probes
from autopar.profiling.probes import SpeedReference
from autopar.profiling.profiler_neighbour import MODEL_LAYERS, NEIGHBOUR_SHAPE, model_step


class _Machine:
    """One rank: the reference costs 1 ms a call; the probe 30 ms, × ``slowdown`` in a window right after
    the model's step. Counts the model steps and how many of the probe's windows followed one."""

    kind, torch = "cpu", "cpu"

    def __init__(self, slowdown: float):
        self.slowdown, self.after_model, self.model_steps, self.windows_after_model = slowdown, False, 0, 0

    def model(self) -> None:
        self.model_steps += 1
        self.after_model = True

    def window_seconds(self, call, calls: int) -> float:
        if call is self.reference:
            return calls * 1e-3
        cold, self.after_model = self.after_model, False
        self.windows_after_model += cold
        return calls * 30e-3 * (self.slowdown if cold else 1.0)


def _measure(monkeypatch, machine, before_window) -> probes.Timing:
    monkeypatch.setattr(probes.dist, "barrier", lambda: None)
    monkeypatch.setattr(probes, "slowest_rank", lambda seconds, probe: seconds)
    reference = SpeedReference(machine)
    machine.reference = reference.call
    settings = type("Settings", (), {"warmup": 1, "windows": 5, "window_s": 0.1, "max_spread": 1.0,
                                     "max_windows": 5})()
    return reference.measure(lambda: None, settings, 0.1, before_window=before_window)


def test_every_probe_window_follows_a_model_step_and_reads_its_speed(monkeypatch):
    machine = _Machine(slowdown=1.07)
    timing = _measure(monkeypatch, machine, machine.model)
    assert timing.windows == 5 and machine.model_steps == 5 and machine.windows_after_model == 5
    assert timing.ratio == pytest.approx(30 * 1.07)
    # control: back-to-back windows (no before_window) read the probe's own speed, and no model step runs
    control = _Machine(slowdown=1.07)
    assert _measure(monkeypatch, control, None).ratio == pytest.approx(30.0)
    assert control.model_steps == 0


def test_the_model_step_is_a_whole_models_forward_and_backward():
    torch.manual_seed(0)
    step = model_step("cpu")
    assert len(step.blocks) == MODEL_LAYERS
    step()
    for block in step.blocks:  # the gradient reaches every layer (the first one only through all the others)
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in block.parameters())
    batch, tokens, width = NEIGHBOUR_SHAPE
    activations = MODEL_LAYERS * batch * tokens * 4 * width * 4  # the MLPs' hidden activations alone, fp32
    assert activations >= 16 * 2**20  # past a core's L2 and a 2-core VM's shared cache
    assert len(model_step("cpu", layers=2).blocks) == 2
