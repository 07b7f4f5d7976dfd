"""Planning caches keyed on cheap stand-ins answer what the uncached computation answers, on a real GPT graph.

``strategy_signature`` is kept in ``node.meta`` while the node's target, arguments and values are the same
objects; the intra-op builder's price caches hold specs by number (``GroupBuilder.spec_id``: equal specs,
equal numbers) instead of hashing DTensor Placements. Controls: a changed input value gives a new
signature, a different spec a different number, and a different source spec a different resharding price.
"""
import numpy as np
import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.ir.ops import node_signature
from autopar.passes.capture import capture
from autopar.passes.intra_op import CostEnv
from autopar.passes.intra_op_groups import GroupBuilder
from autopar.passes.intra_op_prices import edge_matrices, price_groups
from autopar.passes.strategies import expert_rows, generate_strategies, strategy_signature
from autopar.passes.strategies.registry import in_place_key
from tests.models import make_small_gpt


def _graph():
    model, batch = make_small_gpt(n_layer=2)
    return capture(model, batch)


def _uncached_signature(node) -> str:
    return f"{node_signature(node)}|{expert_rows.context_key(node)}{in_place_key(node)}"


def test_cached_strategy_signature_equals_the_uncached_one():
    graph = _graph()
    nodes = [n for n in graph.gm.graph.nodes if n.op != "output"]
    first = {n.name: strategy_signature(n) for n in nodes}
    for node in nodes:
        again = strategy_signature(node)
        assert again is first[node.name]  # served from node.meta
        assert again == _uncached_signature(node), node.name


def test_a_changed_input_value_changes_the_cached_signature():
    graph = _graph()
    reader = next(n for n in graph.gm.graph.nodes if n.op == "call_function" and n.all_input_nodes
                  and isinstance(n.all_input_nodes[0].meta.get("val"), torch.Tensor)
                  and n.all_input_nodes[0].meta["val"].dim() >= 2)
    before = strategy_signature(reader)
    source = reader.all_input_nodes[0]
    val = source.meta["val"]
    source.meta["val"] = val.new_empty((val.shape[0] * 2, *val.shape[1:]))  # control: another input shape
    after = strategy_signature(reader)
    assert after != before
    assert after == _uncached_signature(reader)


def _built(mesh=(2, 2)):
    graph = _graph()
    b = GroupBuilder(graph, generate_strategies(graph, mesh), CostEnv(autopar.Cluster.local(4), mesh))
    b.build_groups()
    price_groups(b)
    return b


def test_spec_numbers_are_equal_exactly_when_specs_are():
    b = _built()
    specs = list(dict.fromkeys(spec for strategies in b.strategies.values() for s in strategies
                               for spec in (*s.in_specs, s.out_spec)))
    assert len(specs) > 5
    numbers = [b.spec_id(spec) for spec in specs]
    assert len(set(numbers)) == len(specs)  # control: distinct specs, distinct numbers
    assert [b.spec_id(tuple(spec)) for spec in specs] == numbers  # an equal (rebuilt) spec, the same number
    assert b.spec_id((Shard(0), Replicate())) != b.spec_id((Shard(1), Replicate()))
    for name, strategies in b.strategies.items():
        ids = b.strategy_spec_ids(name)
        assert ids == [(tuple(b.spec_id(x) for x in s.in_specs), b.spec_id(s.out_spec)) for s in strategies]


def test_edge_matrices_keyed_by_spec_number_equal_direct_pricing():
    b = _built()
    edges = edge_matrices(b)
    assert edges
    expected: dict = {}
    for node in b.order:
        if node.op == "placeholder" or node.name in b.boundary:
            continue
        gv = b.group_of[node.name]
        for idx, arg in enumerate(b.views[node.name].tensor_args):
            gu = b.group_of[arg.name]
            if gu == gv or len(b.groups[gu].pick) == 1:
                continue
            m = np.array([[sum(b.edge_time(arg, node, idx, b.strategies[arg.name][pu[arg.name]].out_spec,
                                           b.strategies[node.name][pv[node.name]]))
                           for pv in b.groups[gv].pick] for pu in b.groups[gu].pick])
            expected[(gu, gv)] = expected.get((gu, gv), 0) + m
    assert edges.keys() == expected.keys()
    for key, m in edges.items():
        np.testing.assert_array_equal(m, expected[key])
    # control: some priced edge reads a source whose other spec costs something else
    moved = 0
    for node in b.order:
        if node.op != "call_function" or node.name in b.boundary:
            continue
        for idx, arg in enumerate(b.views[node.name].tensor_args):
            specs = {s.out_spec for s in b.strategies[arg.name]}
            prices = {sum(b.edge_time_k(arg, node, idx, spec, 0)) for spec in specs}
            moved += len(prices) > 1
    assert moved > 0
