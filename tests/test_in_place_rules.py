"""In-place elementwise ops take their out-of-place form's sharding rule (``passes/strategies/registry.py``)
where the write cannot be lost to a moved copy, and stay replicated where it could (a view of the written
value, a graph input); an op without any rule still warns. HF Mixtral's ``routing_weights /= sum`` is one."""
import warnings

import pytest
import torch
import torch.nn as nn

from autopar.passes.capture import capture
from autopar.passes.strategies import generate_strategies
from autopar.passes.strategies.registry import out_of_place_form, rule_for
from tests.models import FACTORIES

aten = torch.ops.aten


class InPlaceChain(nn.Module):
    """Fresh values written in place (each write's only later reader is its own result)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        h = self.lin(x) * 2.0
        total = h.sum(-1, keepdim=True)
        h.div_(total)
        h.mul_(x.mean(-1, keepdim=True)).add_(1.0)
        return self.head(h).pow(2).mean()


class WriteThroughView(nn.Module):
    """``u`` is written in place after a view of it was taken: the view's reader must see the write."""

    def __init__(self, d_in: int = 8, d_out: int = 16):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x):
        u = self.lin(x) * 2.0
        first = u[:, :8]
        u.mul_(3.0)
        return (first.sum() + u.sum()).pow(2)


def _in_place_nodes(graph) -> list:
    return [n for n in graph.gm.graph.nodes if n.op == "call_function" and out_of_place_form(n.target) is not None]


def _strategies(model, x, mesh=(1, 2)):
    graph = capture(model, (x,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategies = generate_strategies(graph, mesh)
    return graph, strategies, [str(w.message) for w in caught if "no sharding rule" in str(w.message)]


def test_out_of_place_form_of_in_place_ops():
    assert out_of_place_form(aten.div_.Tensor) is aten.div.Tensor
    assert out_of_place_form(aten.add_.Scalar) is aten.add.Scalar
    assert out_of_place_form(aten.masked_fill_.Scalar) is aten.masked_fill.Scalar
    assert out_of_place_form(aten.div.Tensor) is None and out_of_place_form(aten.index_put_.default) is not None
    assert rule_for(aten.index_put_.default)(None) == [], "an in-place op's own rule comes first"


def test_in_place_writes_of_fresh_values_are_sharded_like_their_out_of_place_form():
    torch.manual_seed(0)
    graph, strategies, missing = _strategies(InPlaceChain(), torch.randn(4, 8))
    nodes = _in_place_nodes(graph)
    assert {str(n.target) for n in nodes} == {"aten.div_.Tensor", "aten.mul_.Tensor", "aten.add_.Tensor"}
    assert not missing, missing
    for node in nodes:
        specs = {(s.in_specs, s.out_spec) for s in strategies[node.name]}
        assert len(specs) > 1, f"{node.name} runs replicated only"
    div = next(n for n in nodes if n.target is aten.div_.Tensor)
    denominators = {s.in_specs[1] for s in strategies[div.name]}
    assert not any(p.is_partial() for spec in denominators for p in spec), "div is linear in its numerator only"


def test_a_write_a_view_would_see_stays_replicated():
    torch.manual_seed(0)
    graph, strategies, missing = _strategies(WriteThroughView(), torch.randn(4, 8))
    (node,) = _in_place_nodes(graph)
    assert not missing, "a deliberate replicated op is not reported as rule-less"
    assert len(strategies[node.name]) == 1 and all(p.is_replicate() for p in strategies[node.name][0].out_spec)


def test_an_op_without_any_rule_still_warns(monkeypatch):
    class Rolled(nn.Module):  # roll has no rule: the warning must still name it
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x).roll(1, 0).sum()

    monkeypatch.setattr("autopar.passes.strategies._WARNED", set())  # warned once per process
    _, _, missing = _strategies(Rolled(), torch.randn(4, 8))
    assert missing and "aten.roll" in missing[0], missing


def test_mixtral_routing_division_is_sharded(monkeypatch):
    monkeypatch.setattr("autopar.passes.strategies._WARNED", set())
    model, batch = FACTORIES["zoo_mixtral"]()
    graph = capture(model, batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategies = generate_strategies(graph, (2, 2))
    divisions = [n for n in graph.gm.graph.nodes if n.target is aten.div_.Tensor]
    assert len(divisions) == 2, "one top-k renormalization per layer"
    assert not [w for w in caught if "no sharding rule" in str(w.message)], [str(w.message) for w in caught]
    assert all(len(strategies[n.name]) > 1 for n in divisions)


@pytest.mark.parametrize("mesh", [(1, 2), (2, 2)])
def test_in_place_rules_keep_planning_deterministic(mesh):
    torch.manual_seed(0)
    first = _strategies(InPlaceChain(), torch.randn(4, 8), mesh)[1]
    again = _strategies(InPlaceChain(), torch.randn(4, 8), mesh)[1]
    assert list(first) == list(again) and all(first[k] == again[k] for k in first)
