"""The intra-op build's price caches answer what the uncached computation answers, on a real GPT graph.

Caches under test: ``spec_number`` (one number per distinct spec, process-wide), ``CostEnv.reshard`` keyed by
those numbers and shared by every env whose axes price alike, ``redistribute_cost``'s message plan per spec
pair, ``GroupBuilder.strategy_reads`` (each strategy list's read specs and Partial-gradient axes), the
builder's edge prices, and ``compute.moves_no_data`` kept in ``node.meta``. Controls: a changed input gives
a different key (or a recomputed answer).
"""
import dataclasses
import functools
import math

import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.cost_models.communication import (
    RING_FACTOR,
    UNREACHABLE_SECONDS,
    _after,
    _backward_kind,
    _message_plan,
    redistribute_cost,
    spec_number,
)
from autopar.cost_models.compute import moves_no_data
from autopar.cost_models.saved_tensors import saved_rule
from autopar.passes.capture import capture
from autopar.passes.intra_op import CostEnv
from autopar.passes.intra_op_groups import GroupBuilder
from autopar.passes.intra_op_prices import edge_matrices, price_groups
from autopar.passes.strategies import generate_strategies
from autopar.placement import local_shape
from autopar.redistribute import grad_partial_axes, redistribute_steps
from tests.models import make_small_gpt

MESH = (2, 2)


def _graph():
    model, batch = make_small_gpt(n_layer=2)
    return capture(model, batch)


@functools.cache
def _built():
    """The module's one builder (read only here) on a GPT graph, its groups, prices and edges built."""
    graph = _graph()
    b = GroupBuilder(graph, generate_strategies(graph, MESH), CostEnv(autopar.Cluster.local(4), MESH))
    b.build_groups()
    price_groups(b)
    edge_matrices(b)
    return b


def test_spec_numbers_are_shared_by_builders_and_differ_between_specs():
    b = _built()
    other = GroupBuilder(b.graph, b.strategies, CostEnv(autopar.Cluster.local(4), MESH))  # numbers only, no build
    specs = list(dict.fromkeys(spec for strategies in b.strategies.values() for s in strategies
                               for spec in (*s.in_specs, s.out_spec)))
    assert [b.spec_id(s) for s in specs] == [other.spec_id(tuple(s)) for s in specs] == [spec_number(s) for s in specs]
    assert len({spec_number(s) for s in specs}) == len(specs)  # control: distinct specs, distinct numbers
    assert spec_number((Shard(0), Replicate())) != spec_number((Replicate(), Shard(0)))


def test_strategy_reads_equal_direct_gradient_axes():
    b = _built()
    checked = 0
    for name, strategies in b.strategies.items():
        reads = b.strategy_reads(name)
        for s, per_input in zip(strategies, reads):
            assert per_input == tuple((spec_number(spec), grad_partial_axes(spec, s.out_spec)) for spec in s.in_specs)
            checked += any(axes for _, axes in per_input)
    assert checked > 0  # some read carries Partial-gradient axes, so the axes are really compared


def test_cached_edge_and_reshard_prices_equal_uncached_pricing():
    b = _built()
    env = b.env
    assert len(b._edge_time) > 20 and len(env._reshard_cache) > 5
    by_number = {spec_number(s): s for s in _all_specs(b)}
    for (shape, dtype, src_id, dst_id, axes, needs_grad, bucketed), hit in list(env._reshard_cache.items())[:300]:
        itemsize = torch.empty((), dtype=dtype).element_size()
        assert hit == redistribute_cost(shape, itemsize, by_number[src_id], by_number[dst_id], MESH, env.links,
                                        axes, needs_grad, bucketed_sync=bucketed)
    nonzero = 0
    readers = [n for n in b.order if n.op == "call_function" and n.name not in b.boundary]
    for node in readers[::3]:  # a third of the readers, every source spec and strategy: a few seconds
        for idx, arg in enumerate(b.views[node.name].tensor_args):
            for src in {s.out_spec for s in b.strategies[arg.name]}:
                for k, strat in enumerate(b.strategies[node.name]):
                    cached = b.edge_time_k(arg, node, idx, src, k)
                    assert cached == _uncached_edge(b, arg, node, idx, src, strat)
                    nonzero += cached != (0.0, 0.0)
    assert nonzero > 0


def _all_specs(b) -> set:
    return {spec for strategies in b.strategies.values() for s in strategies for spec in (*s.in_specs, s.out_spec)}


def _uncached_edge(b, arg, node, idx, src, strat) -> tuple[float, float]:
    """``GroupBuilder.edge_time`` written out on ``redistribute_cost``, no cache and no spec numbers."""
    dst = strat.in_specs[idx]
    axes = grad_partial_axes(dst, strat.out_spec) if arg.name in b.requires_grad else ()
    if src == dst and not axes:
        return 0.0, 0.0
    val = b.views[node.name].in_vals[idx]
    needs_grad = arg.name in b.requires_grad and node.name in b.requires_grad
    param = arg.name in b.params
    fwd, bwd = redistribute_cost(tuple(val.shape), val.element_size(), src, dst, MESH, b.env.links,
                                 axes if needs_grad else (), needs_grad, bucketed_sync=param)
    mb = b.env.microbatches
    return (mb * fwd, bwd) if param else (mb * (fwd + bwd), 0.0)


def test_reshard_cache_is_shared_only_by_envs_that_price_alike():
    cluster = autopar.Cluster.local(4)
    a, same = CostEnv(cluster, MESH, microbatches=1), CostEnv(cluster, MESH, microbatches=4)
    assert a._reshard_cache is same._reshard_cache  # microbatches scale the edge, not the redistribution
    # controls: another mesh, or links of another bandwidth, price in a cache of their own
    assert CostEnv(cluster, (1, 4))._reshard_cache is not a._reshard_cache
    slower = dataclasses.replace(cluster, intra_node=dataclasses.replace(cluster.intra_node,
                                                                         bandwidth=cluster.intra_node.bandwidth / 2))
    other = CostEnv(slower, MESH)
    assert other._reshard_cache is not a._reshard_cache
    val = torch.empty(64, 32)
    src, dst = (Shard(0), Replicate()), (Replicate(), Replicate())
    assert other.reshard(val, src, dst, (), True) != a.reshard(val, src, dst, (), True)
    assert a.reshard(torch.empty(128, 32), src, dst, (), True) != a.reshard(val, src, dst, (), True)  # shape in key


def test_moves_no_data_kept_in_meta_equals_the_saved_rule():
    graph = _graph()
    nodes = [n for n in graph.gm.graph.nodes if n.op == "call_function"]
    first = {n.name: moves_no_data(n) for n in nodes}
    assert any(first.values()) and not all(first.values())
    for node in nodes:
        assert moves_no_data(node) == first[node.name] == _uncached_moves_no_data(node), node.name
    # control: a node whose input value is replaced is answered afresh (the kept entry no longer applies)
    node = next(n for n in nodes if "autopar_moves_no_data" in n.meta and n.all_input_nodes)
    source = node.all_input_nodes[0]
    kept = node.meta["autopar_moves_no_data"]
    source.meta["val"] = source.meta["val"].clone()
    assert moves_no_data(node) == first[node.name]
    assert node.meta["autopar_moves_no_data"] is not kept


def _uncached_moves_no_data(node) -> bool:
    from autopar.ir.ops import is_free_view

    return is_free_view(node) or saved_rule(node, set()).alias_of is not None


def _direct_cost(shape, itemsize, src, dst, links, axes, needs_grad, bucketed) -> tuple[float, float]:
    """``redistribute_cost`` step by step from ``redistribute_steps``, nothing kept between calls."""
    if any(step.kind == "unreachable" for step in redistribute_steps(src, dst)):
        return UNREACHABLE_SECONDS, 0.0
    fwd = bwd = 0.0
    spec = list(src)
    for step in redistribute_steps(src, dst, axes if needs_grad else ()):
        local = math.prod(local_shape(shape, tuple(spec), MESH))
        nbytes = (local * MESH[step.axis] if step.kind == "all_gather" else local) * itemsize
        price = links[step.axis].bandwidth_time if bucketed and step.kind == "sync_grad" else links[step.axis].time
        if step.kind in RING_FACTOR:
            fwd += price(step.kind, nbytes)
        back = _backward_kind(step) if needs_grad else None
        if back:
            bwd += price(back, nbytes)
        spec[step.axis] = _after(step, spec[step.axis], dst)
    return fwd, bwd


def test_message_plans_kept_per_spec_pair_price_as_step_by_step():
    b = _built()
    # specs valid on both 3-D shapes below, in an order of their own (spec numbers are process-wide: their
    # order depends on what else this process priced first)
    specs = sorted((s for s in _all_specs(b) if all(not p.is_shard() or p.dim < 3 for p in s)), key=str)[:12]
    checked = 0
    for src in specs:
        for dst in specs:
            for axes, needs_grad, bucketed in (((), True, False), ((0,), True, True), ((1,), False, False)):
                if axes and not dst[axes[0]].is_replicate():
                    continue  # a Partial gradient arises only at a Replicate input
                for shape in ((64, 32, 16), (8, 48, 32)):
                    cached = redistribute_cost(shape, 4, src, dst, MESH, b.env.links, axes, needs_grad,
                                               bucketed_sync=bucketed)
                    assert cached == _direct_cost(shape, 4, src, dst, b.env.links, axes, needs_grad, bucketed)
                    checked += cached != (0.0, 0.0)
    assert checked > 20
    # control: the kept plan is per (specs, gradient axes, needs_grad): another of each is another entry
    src, dst = (Shard(0), Replicate()), (Replicate(), Replicate())
    plans = {id(_message_plan(src, dst, axes, ng, None)) for axes, ng in (((), True), ((1,), True), ((), False))}
    assert len(plans) == 3
    assert _message_plan(dst, src, (), True, None) is not _message_plan(src, dst, (), True, None)
