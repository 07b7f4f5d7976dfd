"""The planner's process-wide cost caches give every graph its own answer, whatever was planned before.

``cost_models.saved_tensors`` probes each op once on fake tensors with its arguments' strides, and a view
op's answer depends on them (``reshape`` of a transposed tensor copies, of a contiguous one aliases). A
graph captured on the meta device has such a transposed layout after attention where the CPU graph's is
contiguous, so a cache keyed by the node signature alone (shapes and dtypes) answered a later CPU plan
with the meta graph's rule: ranks that had planned different graphs before could price the same model
differently. Negative control: the two reshapes have one node signature, so the signature cannot tell
them apart.
"""
import pytest
import torch

import autopar
from autopar.cost_models import compute, saved_tensors
from autopar.ir.ops import node_signature
from autopar.passes.capture import capture
from autopar.runtime.tensor_source import on_meta_for
from tests import weights_cases as W


class Reshape(torch.nn.Module):
    def __init__(self, transposed: bool):
        super().__init__()
        self.transposed = transposed

    def forward(self, x):
        y = x.transpose(1, 2) if self.transposed else x * 1.0
        return y.reshape(8, 16, -1).sum()


def _reshape_node(transposed: bool):
    shape = (8, 4, 16, 16) if transposed else (8, 16, 4, 16)
    graph = capture(Reshape(transposed), (torch.randn(shape),))
    return next(n for n in graph.gm.graph.nodes if "reshape" in str(n.target) or "view" in str(n.target))


@pytest.fixture
def fresh_caches(monkeypatch):
    monkeypatch.setattr(saved_tensors, "_CACHE", {})
    monkeypatch.setattr(compute, "_FLOPS", {})


def test_a_view_rule_depends_on_strides_not_only_on_the_signature(fresh_caches, monkeypatch):
    contiguous, transposed = _reshape_node(False), _reshape_node(True)
    assert node_signature(contiguous) == node_signature(transposed)  # the signature cannot tell them apart
    own = {}
    for name, node in (("contiguous", contiguous), ("transposed", transposed)):
        monkeypatch.setattr(saved_tensors, "_CACHE", {})
        own[name] = saved_tensors.saved_rule(node, set())
    assert own["contiguous"].alias_of == 0 and own["transposed"].alias_of is None
    monkeypatch.setattr(saved_tensors, "_CACHE", {})
    for first, second in (("contiguous", contiguous), ("transposed", transposed)), \
            (("transposed", transposed), ("contiguous", contiguous)):
        saved_tensors._CACHE.clear()
        saved_tensors.saved_rule(first[1], set())
        assert saved_tensors.saved_rule(second[1], set()) == own[second[0]]


def _plan_json(device: str) -> str:
    model, batch = W.build("gpt", device)
    return autopar.plan(model, autopar.Cluster.local(4, mesh_shape=(2, 2)), on_meta_for(model, batch),
                        precision="bf16").to_json()


def test_planning_a_meta_graph_first_leaves_a_cpu_plan_unchanged(fresh_caches):
    alone = _plan_json("cpu")
    saved_tensors._CACHE.clear()
    compute._FLOPS.clear()
    _plan_json("meta")
    assert _plan_json("cpu") == alone
