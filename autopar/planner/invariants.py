"""The invariants each planning pass promises, checked after it runs when ``PlanOptions(debug=True)``.

One function per pass; each raises AssertionError naming the first violation (a bug in autopar, not a
user error). ``autopar.planner.driver.plan_graph`` calls them in pass order:

    capture         every call_function node carries meta["val"]; no runtime-assertion node is left
    strategies      every node has a strategy, and its first one is replicated (the fallback every rule keeps)
    layers          the layers partition the call_function nodes, contiguous in graph order
    stage choice    the stages cover layers 0..L-1 in order, each once, and their submeshes use every device
    plan            ``Plan.validate`` against the graph (ranks tile, meshes hold their ranks, specs parse,
                    every node of the graph is sharded by the stage that runs it)
"""
from __future__ import annotations

from autopar.ir.graph import ModelGraph


def check_capture(graph: ModelGraph) -> None:
    for node in graph.gm.graph.nodes:
        if node.op == "call_function":
            assert "val" in node.meta, f"{node.name} has no meta['val'] after capture"
            assert "assert" not in str(node.target), f"{node.name}: assertion node {node.target} left in the graph"


def check_strategies(graph: ModelGraph, strategies: dict) -> None:
    for node in graph.gm.graph.nodes:
        assert strategies[node.name], f"{node.name} has no strategy"
        first = strategies[node.name][0]
        assert all(p.is_replicate() for p in first.out_spec), f"{node.name}: first strategy is not replicated"


def check_layers(graph: ModelGraph, layers) -> None:
    ops = [n.name for n in graph.gm.graph.nodes if n.op == "call_function"]
    flat = [name for layer in layers.nodes for name in layer]
    assert flat == ops, "layers do not partition the call_function nodes in graph order"
    assert all(layers.nodes), "a layer is empty"


def check_stage_choice(choice, layer_count: int, devices: int) -> None:
    covered = [layer for s in choice.stages for layer in range(s.first, s.last + 1)]
    assert covered == list(range(layer_count)), f"stages cover layers {covered}, not 0..{layer_count - 1} in order"
    pp = len(choice.stages) // getattr(choice, "virtual", 1)  # interleaved: chunk j shares chunk j mod pp's devices
    used = sum(s.option.size for s in choice.stages[:pp])
    assert all(s.option == choice.stages[j % pp].option for j, s in enumerate(choice.stages)), "chunks not round robin"
    assert used == devices, f"stage submeshes use {used} devices of {devices}"
    assert all(1 <= s.inflight <= choice.microbatches for s in choice.stages), "in-flight microbatches out of range"
