"""ZeRO-3 without processes: the memory terms, the spans of gathered units, and what the plan charges.

The runtime parity, memory and gather-count checks run in the shared 4-rank launch of tests/test_precision.py.
"""
import numpy as np
import torch
import torch.fx as fx

import autopar
from autopar.cost_models.memory import TrainingSpec, held_state_bytes
from autopar.ir.buckets import parameter_sources, peak_gathered, unit_spans
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


def test_plan_at_level_3_charges_gathers_memory_and_records_the_level():
    """GPT, 2×2 data parallel (every parameter in the bucketed sync): against ZeRO-2, each microbatch's
    forward and backward gain f3 · grad_sync / 2 (f3 = 1), the held weights shrink 4 ways, and the gathered
    units add their transient peak to memory."""
    model, batch = FACTORIES["gpt"]()
    cluster = autopar.Cluster.local(4, mesh_shape=(2, 2))
    z2, z3 = (autopar.plan(model, cluster, batch, zero=z, bucket_bytes=20000, recompute="none", **options("gpt", "dp"))
              for z in (2, 3))
    p2, p3 = z2.stages[0].predicted, z3.stages[0].predicted
    assert p3["zero3_share"] == 1.0 and p3["zero_gather_share"] == 0.0
    gather = p3["grad_sync"] / 2
    assert abs(p3["forward"] - p2["forward"] - gather) < 1e-12 and abs(p3["backward"] - p2["backward"] - gather) < 1e-12
    assert p3["state_params"] < p2["state_params"] / 3 and p3["state_grads"] == p2["state_grads"]
    assert 0 < p3["zero3_transient"] < p2["state_params"]
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
