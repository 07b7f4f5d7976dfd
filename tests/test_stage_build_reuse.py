"""What the exact stage solves share between stages (no process group): one cache of redistribution prices per
(cluster, logical mesh, node width), and the graph's requires-grad set per plan. Each shared result equals the
fresh one on a real problem (a captured GPT); a changed input misses."""
import numpy as np
import torch

import autopar
from autopar.ir.ops import requires_grad_nodes
from autopar.passes.capture import capture
from autopar.passes.cluster_layers import find_repeated_blocks
from autopar.passes.intra_op import CostEnv, build_problem
from autopar.passes.strategies import generate_strategies
from autopar.planner.options import PlanOptions, training_spec
from autopar.planner.plan_builder import _requires_grad
from examples.gpt import GPT, GPTConfig, make_batch

CFG = GPTConfig(vocab_size=256, seq_len=32, n_layer=3, n_head=4, n_embd=64)


def _graph():
    with torch.device("meta"):
        model = GPT(CFG)
    return capture(model, make_batch(CFG, 8, device="meta"))


def _arrays(problem) -> list[np.ndarray]:
    out = [*problem.cost, *problem.mem, *(problem.peak or [])]
    return out + [problem.edges[key] for key in sorted(problem.edges)]


def test_stages_sharing_redistribution_prices_build_the_fresh_problem():
    graph = _graph()
    blocks, cluster, mesh = find_repeated_blocks(graph), autopar.Cluster.local(4), (2, 2)
    training = training_spec(graph, PlanOptions())
    strategies = generate_strategies(graph, mesh)
    first = CostEnv(cluster, mesh, training, microbatches=4, inflight=1)
    build_problem(graph, strategies, blocks, first, None)
    priced = dict(first._reshard_cache)
    assert priced, "the first stage priced redistributions"
    later = CostEnv(cluster, mesh, training, microbatches=4, inflight=3)
    later.share_reshard_prices(first)
    assert later._reshard_cache is first._reshard_cache
    shared = build_problem(graph, strategies, blocks, later, 1e12).problem
    fresh = build_problem(graph, strategies, blocks, CostEnv(cluster, mesh, training, microbatches=4, inflight=3),
                          1e12).problem
    assert first._reshard_cache == priced, "the same stage's prices were all found in the shared cache"
    assert all(np.array_equal(a, b) for a, b in zip(_arrays(shared), _arrays(fresh), strict=True))
    other = CostEnv(cluster, (1, 4), training)
    other.share_reshard_prices(first)
    assert other._reshard_cache is not first._reshard_cache, "control: another logical mesh keeps its own prices"


def test_the_requires_grad_set_is_kept_per_graph_and_trainable_set():
    graph = _graph()
    trainable = {p.name for p in graph.placeholders if p.kind == "parameter"}
    kept = _requires_grad(graph, trainable)
    assert kept == requires_grad_nodes(graph.gm, trainable) and _requires_grad(graph, trainable) is kept
    frozen = _requires_grad(graph, set())
    assert frozen == requires_grad_nodes(graph.gm, set()) != kept, "control: another trainable set is walked afresh"
