"""collective_share's recorder: the seconds it charges to the collectives are those spent inside the calls and
inside their ``wait``, and nothing outside them. No process group: plain functions stand in for the calls.
"""
import time

import pytest

from benchmarks.fidelity.collective_share import _Recorder, ratio


class _Work:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def wait(self):
        time.sleep(self.seconds)
        return True


def test_a_call_and_its_wait_are_charged():
    recorder = _Recorder()
    started = recorder.wrap(lambda t: _Work(0.03))
    begin = time.perf_counter()
    work = started("buffer")
    time.sleep(0.05)  # compute between launch and wait: not the collective's
    assert work.wait() is True
    total = time.perf_counter() - begin
    assert 0.03 <= recorder.seconds <= total - 0.05, (recorder.seconds, total)
    assert [(args, kwargs) for _, args, kwargs in recorder.calls] == [(("buffer",), {})]


def test_a_blocking_call_is_charged_and_time_outside_is_not():
    recorder = _Recorder()
    blocking = recorder.wrap(lambda: time.sleep(0.02))
    begin = time.perf_counter()
    blocking()
    time.sleep(0.05)  # negative control: time outside every call
    total = time.perf_counter() - begin
    assert 0.02 <= recorder.seconds <= total - 0.05, (recorder.seconds, total)
    assert len(recorder.calls) == 1


@pytest.mark.parametrize("a, b, shown", [(3.0, 2.0, "1.50"), (1.0, 0.0, "-")])
def test_ratio_prints_a_dash_without_a_price(a, b, shown):
    assert ratio(a, b).strip() == shown
