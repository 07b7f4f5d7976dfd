"""Models that write buffers in forward (BatchNorm statistics, counters, EMAs) are not microbatched unless asked.

A plan of B microbatches calls forward B times per step, so such a buffer would update B times on smaller
batches, unlike one device. The planner keeps B = 1 and says so (a warning and ``plan.planner``); an explicit
``microbatches=N`` is allowed with a warning. Negative control: the same model without the writes gets more
candidates. (That BatchNorm's statistics then match one device exactly under data and tensor parallelism is
checked by tests/test_training_loop.py's eval cases.)
"""
import warnings

import pytest
import torch

import autopar
from autopar.ir.buffer_writes import written_buffers
from autopar.passes.capture import capture
from autopar.planner.options import PlanOptions, microbatch_candidates
from tests.loop_cases import BatchNormMLP
from tests.models import make_mlp


class Counting(torch.nn.Module):
    def __init__(self, writes: bool = True):
        super().__init__()
        self.fc1, self.fc2, self.writes = torch.nn.Linear(32, 32), torch.nn.Linear(32, 16), writes
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(16))

    def forward(self, x, y):
        out = self.fc2(torch.relu(self.fc1(x)))
        if self.writes:
            self.steps += 1
            self.ema.mul_(0.9).add_(out.detach().mean(0) * 0.1)
        return torch.nn.functional.mse_loss(out, y)


def _batch():
    return make_mlp()[1]


def test_written_buffers_are_found():
    assert written_buffers(capture(Counting(), _batch())) == ["ema", "steps"]
    assert written_buffers(capture(BatchNormMLP(), _batch())) == ["bn.num_batches_tracked", "bn.running_mean",
                                                                  "bn.running_var"]
    eval_bn = BatchNormMLP().eval()  # BatchNorm in eval mode reads its statistics only
    assert written_buffers(capture(eval_bn, _batch())) == []


def test_the_planner_keeps_one_microbatch_and_says_why():
    with pytest.warns(UserWarning, match="writes buffers in forward.*one microbatch.*microbatches=N"):
        plan = autopar.plan(Counting(), autopar.Cluster.local(2), _batch(), stages=2, layers=2, time_limit=10)
    assert plan.microbatches == 1
    assert plan.planner["buffers_written_in_forward"] == ["ema", "steps"]


def test_explicit_microbatches_are_allowed_with_a_warning():
    graph = capture(Counting(), _batch())
    with pytest.warns(UserWarning, match="update once per microbatch"):
        assert microbatch_candidates(graph, PlanOptions(microbatches=4)) == [4]


def test_negative_control_a_model_without_writes_is_microbatched():
    graph = capture(Counting(writes=False), _batch())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert microbatch_candidates(graph, PlanOptions()) == [1, 2, 4, 8, 16]
    with pytest.warns(UserWarning):
        assert microbatch_candidates(capture(Counting(), _batch()), PlanOptions()) == [1]
