"""An in-place elementwise op that takes its out-of-place form's rule (``strategies.registry``) follows its
producer's group like the out-of-place op would (``intra_op_groups.is_light``): one ILP decision fewer, and
the plan is the one the ILP makes when the op leads its own group. An in-place write a view would see keeps
the replicated strategy alone and stays a group of its own (the control)."""
import pytest
import torch
import torch.nn as nn

import autopar
from autopar.passes.capture import capture
from autopar.passes.intra_op import CostEnv, solve_intra_op
from autopar.passes.intra_op_groups import GroupBuilder, is_light
from autopar.passes.strategies import generate_strategies, strategy_signature
from tests.test_in_place_rules import WriteThroughView

aten = torch.ops.aten
MESH = (2, 2)


class ScaledInPlace(nn.Module):
    """Routing weights scaled in place by a learned per-expert scale and a constant: each write reads only its
    producer's value (and a parameter it alone reads)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(256, 64)
        self.scale = nn.Parameter(torch.rand(64) + 0.5)
        self.head = nn.Linear(64, 256)

    def forward(self, x):
        w = self.router(x).softmax(-1) * 2.0
        w.div_(self.scale)
        w.mul_(3.0)
        return self.head(w).pow(2).mean()


def _built(model):
    torch.manual_seed(0)
    graph = capture(model, (torch.randn(4096, 256),))
    strategies = generate_strategies(graph, MESH)
    env = CostEnv(autopar.Cluster.local(4), MESH)
    b = GroupBuilder(graph, strategies, env)
    b.build_groups()
    writes = [n for n in graph.gm.graph.nodes if str(n.target) in ("aten.div_.Tensor", "aten.mul_.Scalar",
                                                                    "aten.mul_.Tensor")]
    return graph, strategies, env, b, writes


def _plan(graph, strategies, env):
    solution = solve_intra_op(graph, strategies, None, env)
    return {name: (s.in_specs, s.out_spec) for name, s in solution.strategies.items()}, solution.step_time


def test_in_place_op_joins_its_producers_group_and_plans_alike(monkeypatch):
    graph, strategies, env, b, writes = _built(ScaledInPlace())
    assert len(writes) == 2 and all(is_light(n) for n in writes)
    for node in writes:
        written = node.args[0]
        assert len(strategies[node.name]) > 1, f"{node.name} is sharded like its out-of-place form"
        assert b.group_of[node.name] == b.group_of[written.name], f"{node.name} follows {written.name}"
        assert b.groups[b.group_of[node.name]].leader != node.name
    followed = _plan(graph, strategies, env)
    assert any(p.is_shard() for spec, out in followed[0].values() for p in out), "the plan shards something"

    monkeypatch.setattr("autopar.passes.intra_op_groups.out_of_place_form", lambda target: None)
    alone = GroupBuilder(graph, strategies, env)
    alone.build_groups()
    assert all(alone.groups[alone.group_of[n.name]].leader == n.name for n in writes), \
        "control: priced alone, each in-place op leads its own decision"
    assert len(alone.groups) == len(b.groups) + len(writes)
    priced_alone = _plan(graph, strategies, env)
    assert followed[0] == priced_alone[0]
    assert followed[1] == pytest.approx(priced_alone[1], rel=1e-12)


def test_in_place_write_through_a_view_stays_a_replicated_group_of_its_own():
    _, strategies, _, b, writes = _built(WriteThroughView(256, 256))
    (node,) = writes
    assert is_light(node), "light by its op; what keeps it alone is its single (replicated) strategy"
    assert len(strategies[node.name]) == 1 and all(p.is_replicate() for p in strategies[node.name][0].out_spec)
    group = b.groups[b.group_of[node.name]]
    assert group.leader == node.name and len(group.pick) == 1
    assert b.group_of[node.name] != b.group_of[node.args[0].name]


def test_a_boundary_value_costs_nothing_though_an_interior_twin_was_priced_first():
    """A stage's input computed by an earlier stage (a boundary value) has no op time here, even after an
    interior node of the same signature (the next layer's residual add) was priced: they never share an entry."""
    from tests.models import make_small_gpt

    model, batch = make_small_gpt(n_layer=3)
    graph = capture(model, batch)
    mesh = (1, 2)
    nodes = list(graph.gm.graph.nodes)
    adds = [n for n in nodes if n.op == "call_function" and str(n.target) == "aten.add.Tensor"]
    sigs = {}
    for n in adds:
        sigs.setdefault(strategy_signature(n), []).append(n)
    cut, twin = next(pair[:2] for pair in sigs.values() if len(pair) >= 2)
    subset = {n.name for n in nodes[nodes.index(cut) + 1:] if n.op == "call_function"}
    b = GroupBuilder(graph, generate_strategies(graph, mesh), CostEnv(autopar.Cluster.local(2), mesh), subset)
    assert cut.name in b.boundary and twin.name in subset
    assert b.node_time_k(twin.name, 0)[0] > 0, "control: the interior twin has an op time a shared entry would leak"
    assert all(b.node_time_k(cut.name, k) == (0.0, 0.0) for k in range(len(b.strategies[cut.name])))
