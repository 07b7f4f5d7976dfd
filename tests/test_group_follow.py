"""A light op's strategy per leader strategy (``GroupBuilder._cheapest``) is the argmin of its local cost,
found without pricing every strategy: strategies are tried in order of op time and the search stops once
an op alone costs more than the best total. Checked against pricing all of them, on a real small GPT."""
import numpy as np

import autopar
from autopar.passes.capture import capture
from autopar.passes.intra_op import CostEnv
from autopar.passes.intra_op_groups import GroupBuilder
from autopar.passes.strategies import generate_strategies
from tests.models import make_small_gpt


def _every_strategy_priced(b: GroupBuilder, node, view, srcs) -> int:
    """The search before pruning: the fast path, else the argmin over all strategies (lowest k on ties)."""
    strategies = b.strategies[node.name]
    floor = min(b.node_time_k(node.name, k)[0] for k in range(len(strategies)))
    for k, strat in enumerate(strategies):
        if all(src is None or src == dst for src, dst in zip(srcs, strat.in_specs)):
            if b._local_cost(node, view, k, srcs) <= floor:
                return k
    return int(np.argmin([b._local_cost(node, view, k, srcs) for k in range(len(strategies))]))


def _op_time_only(b: GroupBuilder, node, view, srcs) -> int:
    """A wrong chooser for the negative control: the fastest op, resharding ignored."""
    return int(np.argmin([b.node_time_k(node.name, k)[0] for k in range(len(b.strategies[node.name]))]))


def _followers(b: GroupBuilder):
    """(node, its view, the input specs it joined with, its pick) for every light member of every group."""
    for group in b.groups:
        for name in group.members[1:]:
            node = b.nodes[name]
            if node.op != "call_function":
                continue
            view = b.views[name]
            for pick in group.pick:
                srcs = tuple(None if b.absorbed.get(a.name) == name else b._spec_in_pick(a.name, pick)
                             for a in view.tensor_args)
                yield node, view, srcs, pick[name]


def test_pruned_search_picks_what_pricing_every_strategy_picks():
    model, batch = make_small_gpt(n_layer=2)
    graph = capture(model, batch)
    mesh = (2, 2)
    b = GroupBuilder(graph, generate_strategies(graph, mesh), CostEnv(autopar.Cluster.local(4), mesh))
    priced, offered = [], []
    real_cost, real_search = b._local_cost, b._cheapest
    b._local_cost = lambda node, view, k, srcs: priced.append(k) or real_cost(node, view, k, srcs)
    b._cheapest = lambda node, view, srcs: offered.append(len(b.strategies[node.name])) or real_search(node, view,
                                                                                                       srcs)
    b.build_groups()
    b._local_cost, b._cheapest = real_cost, real_search
    followers = list(_followers(b))
    assert len(followers) > 20
    for node, view, srcs, chosen in followers:
        assert chosen == _every_strategy_priced(b, node, view, srcs), node.name
    wrong = sum(chosen != _op_time_only(b, node, view, srcs) for node, view, srcs, chosen in followers)
    assert wrong > 0, "negative control: ignoring resharding picks other strategies, so the check can fail"
    assert offered and len(priced) < sum(offered) / 2, "the searches price fewer than half the strategies"
