"""ZeRO-3 without processes: the memory terms, the spans of gathered units, and what the plan charges.

The runtime parity, memory and gather-count checks run in the shared 4-rank launch of tests/test_precision.py.
"""
import numpy as np
import pytest
import torch
import torch.fx as fx

import autopar
from autopar.cost_models.memory import TrainingSpec, held_state_bytes
from autopar.cost_models.zero3 import exposed_gather
from autopar.ir.buckets import parameter_sources, peak_gathered, prefetch_spans, unit_spans
from autopar.passes.ilp import IlpProblem, memory_of, solve_ilp
from tests.models import FACTORIES
from tests.precision_cases import options


def test_param_bytes_at_level_3_shard_weight_gradient_and_state():
    spec = TrainingSpec(zero=(("w", 3),))
    assert spec.param_bytes("w", 1, torch.float32, 4) == (4 + 4 + 8) / 4
    assert spec.param_bytes("w", 1, torch.float32, 1) == 16  # nothing to shard over


def test_held_state_bytes_at_level_3_keep_only_the_shard():
    held = held_state_bytes([{"numel": 10, "ways": 4, "level": 3, "count": 3}], [5], "adamw")
    assert held == {"params": (3 + 5) * 4, "grads": 3 * 4, "optimizer": 3 * 8 + 4 + 5 * 8 + 4}


def test_peak_gathered_sums_units_whose_spans_overlap():
    spans = {0: (0, 5), 1: (3, 8), 2: (9, 9), 3: (8, 12)}
    assert peak_gathered(spans, {0: 10.0, 1: 20.0, 2: 25.0, 3: 1.0}) == 30.0  # 0+1 at 3..5; 1+3 at 8; 3+2 at 9
    assert peak_gathered({}, {}) == 0.0


class _TwoUnits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.ones(4, 4))
        self.b = torch.nn.Parameter(torch.ones(4))
        self.c = torch.nn.Parameter(torch.ones(4, 4))

    def forward(self, x):
        h = x @ self.a.t() + self.b  # unit 0: a (through a view), b
        h = torch.relu(h) @ self.c   # unit 1: c
        return h @ self.a            # unit 0 read again last


def test_unit_spans_follow_views_of_parameters_to_their_readers():
    gm = fx.symbolic_trace(_TwoUnits())
    unit_of = {"a": 0, "b": 0, "c": 1}
    spans = unit_spans(gm.graph, unit_of, "get_attr")
    names = {k: (first.name, last.name) for k, (first, last) in spans.items()}
    assert names[0][0] == "t" and names[0][1] == "matmul_2", names  # the view a.t() reads a first
    assert names[1] == ("matmul_1", "matmul_1"), names
    sources = parameter_sources(gm.graph, unit_of, "get_attr")
    assert {n.name for n in sources} == {"a", "b", "c", "t"}


def test_prefetch_spans_issue_each_unit_at_the_previous_first_read_with_two_units_at_most():
    """Units read at 0-3, 4-7, 8-9: each is issued at the previous one's first read. With unit 0 read again
    at 9 (a tied weight) two units are held from 4 on, so unit 2 waits for unit 1's last read."""
    assert prefetch_spans({0: (0, 3), 1: (4, 7), 2: (8, 9)}) == {0: (0, 3), 1: (0, 7), 2: (4, 9)}
    assert prefetch_spans({0: (0, 9), 1: (4, 7), 2: (8, 9)}) == {0: (0, 9), 1: (0, 7), 2: (8, 9)}
    assert prefetch_spans({0: (0, 9), 1: (4, 5), 2: (8, 9)}) == {0: (0, 9), 1: (0, 5), 2: (6, 9)}
    assert prefetch_spans({0: (2, 2), 1: (2, 5)}) == {0: (2, 2), 1: (2, 5)}  # read first by one node: no room
    held = prefetch_spans({0: (0, 3), 1: (4, 7), 2: (8, 9)})
    assert peak_gathered(held, {0: 10.0, 1: 20.0, 2: 5.0}) == 30.0


def test_plan_at_level_3_charges_gathers_memory_and_records_the_level():
    """GPT, 2×2 data parallel (every parameter in the bucketed sync): against ZeRO-2, each microbatch's
    forward and backward gain what their compute does not hide of g = f3 · grad_sync / 2 (f3 = 1) over the
    stage's units, the held weights shrink 4 ways, and the gathered units add their transient peak to
    memory; in bf16 the gathers and the units take half as much."""
    model, batch = FACTORIES["gpt"]()
    cluster = autopar.Cluster.local(4, mesh_shape=(2, 2))
    z2, z3, b3 = (autopar.plan(model, cluster, batch, zero=z, bucket_bytes=20000, recompute="none", precision=p,
                               **options("gpt", "dp")) for z, p in ((2, "fp32"), (3, "fp32"), (3, "bf16")))
    p2, p3 = z2.stages[0].predicted, z3.stages[0].predicted
    assert p3["zero3_share"] == 1.0 and p3["zero_gather_share"] == 0.0 and p3["zero3_units"] == 10
    gather = p3["grad_sync"] / 2
    assert p3["zero3_gather"] == pytest.approx(gather)
    for phase in ("forward", "backward"):
        hidden = exposed_gather(gather, p2[phase], p3["zero3_units"])
        assert gather / 10 <= hidden < gather and p3[phase] - p2[phase] == pytest.approx(hidden)
    assert p3["state_params"] < p2["state_params"] / 3 and p3["state_grads"] == p2["state_grads"]
    assert 0 < p3["zero3_transient"] < p2["state_params"]
    pb = b3.stages[0].predicted
    assert pb["zero3_gather_scale"] == 0.5 and pb["zero3_gather"] == pytest.approx(pb["grad_sync"] / 4)
    assert pb["zero3_transient"] * 2 == p3["zero3_transient"]
    assert set(z3.stages[0].zero.values()) == {3} and autopar.Plan.from_json(z3.to_json()) == z3
    assert "ZeRO level(s) by stage: 3" in z3.summary()


def test_ilp_memory_row_counts_gathered_units_beside_the_transient():
    """Strategy 1 is cheaper and keeps less state, but a ZeRO-3 unit gathered on top of it breaks the budget;
    without the unit row (units=None) the same problem picks it."""
    cost, mem, peak = [np.array([2.0, 1.0]), np.array([0.0])], [np.array([7.0, 5.0]), np.array([0.0])], None
    units = [np.array([0.0, 4.0]), np.array([0.0])]
    with_units = IlpProblem(cost, mem, {}, 8.0, peak, units)
    assert solve_ilp(with_units).choice == [0, 0]
    assert memory_of(with_units, [1, 0]) == 9.0
    assert solve_ilp(IlpProblem(cost, mem, {}, 8.0, peak)).choice == [1, 0]
