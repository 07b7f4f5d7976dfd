"""PlanOptions(debug=True) checks every pass's invariants (autopar.planner.invariants), and each check can fail."""
import dataclasses

import pytest

import autopar
from autopar.passes.capture import capture
from autopar.passes.cluster_layers import Layers, cluster_layers, find_repeated_blocks
from autopar.passes.inter_op import ChosenStage, MeshOption, StageChoice
from autopar.passes.strategies import generate_strategies
from autopar.planner import invariants
from examples.gpt import make_gpt


@pytest.fixture(scope="module")
def gpt():
    model, batch = make_gpt()
    return model, batch, capture(model, batch)


def test_debug_planning_passes_every_check_and_gives_the_same_plan(gpt):
    model, batch, _ = gpt
    cluster = autopar.Cluster.local(4)
    checked = autopar.plan(model, cluster, batch, stages=2, debug=True)
    assert checked.to_json() == autopar.plan(model, cluster, batch, stages=2).to_json()


def test_each_check_catches_a_broken_pass_output(gpt):
    _, _, graph = gpt
    node = next(n for n in graph.gm.graph.nodes if n.op == "call_function")
    val = node.meta.pop("val")
    with pytest.raises(AssertionError, match="meta"):
        invariants.check_capture(graph)
    node.meta["val"] = val
    invariants.check_capture(graph)

    strategies = generate_strategies(graph, (2, 2))
    invariants.check_strategies(graph, strategies)
    with pytest.raises(AssertionError, match="no strategy"):
        invariants.check_strategies(graph, {**strategies, node.name: []})

    layers = cluster_layers(graph, find_repeated_blocks(graph), 2)
    invariants.check_layers(graph, layers)
    swapped = Layers(layers.nodes[::-1], layers.of_node)
    with pytest.raises(AssertionError, match="partition"):
        invariants.check_layers(graph, swapped)

    option = MeshOption((1, 2), (1, 2))
    good = StageChoice(2, [ChosenStage(0, 0, option, 2), ChosenStage(1, 1, option, 1)], 0.0)
    invariants.check_stage_choice(good, 2, 4)
    with pytest.raises(AssertionError, match="cover"):
        invariants.check_stage_choice(dataclasses.replace(good, stages=good.stages[:1]), 2, 4)
    with pytest.raises(AssertionError, match="devices"):
        invariants.check_stage_choice(good, 2, 8)
