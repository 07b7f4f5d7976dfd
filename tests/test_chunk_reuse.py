"""Identical pipeline chunks read one build (``passes.chunk_reuse``): the reused problem equals a fresh build of
the chunk, array for array, and its solution read back and renamed equals the fresh solution, node for node; a
changed input (in-flight count, scope) misses; the plan is byte-identical to one built chunk by chunk."""
import dataclasses

import numpy as np
import pytest
import torch

import autopar
from autopar.passes import chunk_reuse
from autopar.passes.intra_op import build_problem, solve_built
from examples.gpt import GPT, GPTConfig, make_batch


def _plan():
    """An 8-layer GPT on 8 V100s as 2 stages × 4 interleaved chunks: chunks at one in-flight count repeat."""
    cfg = GPTConfig(vocab_size=4096, seq_len=256, n_layer=8, n_head=4, n_embd=256)
    with torch.device("meta"):
        model = GPT(cfg).half()
    return autopar.plan(model, autopar.Cluster.preset("p3.16xlarge", gpus=8), make_batch(cfg, 64, device="meta"),
                        stages=2, schedule="interleaved", virtual_stages=4)


@pytest.fixture(scope="module")
def recorded():
    """(the plan, every ``ChunkBuilds.build`` call as (args, its answer)), then the plan built chunk by chunk."""
    calls = []
    original = chunk_reuse.ChunkBuilds.build

    def build(self, *args):
        answer = original(self, *args)
        calls.append((args, answer))
        return answer

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chunk_reuse.ChunkBuilds, "build", build)
        plan = _plan()
    with pytest.MonkeyPatch.context() as patch:  # control: no key, every chunk built
        patch.setattr(chunk_reuse, "scope_key", lambda *args: None)
        fresh = _plan()
    return plan, calls, fresh


def _equal_problems(a, b) -> bool:
    arrays = lambda p: [*p.cost, *p.mem, *p.peak, *(p.units or [])]  # noqa: E731
    same = all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(arrays(a), arrays(b)))
    same = same and len(arrays(a)) == len(arrays(b)) and a.budget == b.budget and sorted(a.edges) == sorted(b.edges)
    same = same and all(np.array_equal(a.edges[k], b.edges[k]) for k in a.edges)
    rows = lambda p: [[None if x is None else x.tolist() for x in row] for row in p.replay or []]  # noqa: E731
    return same and (a.replay is None) == (b.replay is None) and rows(a) == rows(b)


def test_reused_build_equals_a_fresh_build_and_reads_back_the_same_layouts(recorded):
    plan, calls, _ = recorded
    reused = [(args, answer) for args, answer in calls if answer[1] is not None]
    assert len(reused) >= 2 and len(calls) == len(plan.stages)
    for (graph, strategies, blocks, env, budget, subset, truncate), (problem, names) in reused:
        own = build_problem(graph, strategies, blocks, env, budget, subset=subset, truncate=truncate)
        assert _equal_problems(problem.problem, own.problem)
        got = chunk_reuse.renamed(solve_built(problem, env, 60), names)
        want = solve_built(own, env, 60)
        assert got.strategies == want.strategies and got.inputs == want.inputs and got.sends == want.sends
        assert got.zero == want.zero and got.memory == want.memory and got.step_time == want.step_time
        assert [(g.leader, g.members, g.pick) for g in got.groups] == [(g.leader, g.members, g.pick)
                                                                      for g in want.groups]
    # control: the comparison fails against a chunk of another in-flight count (its memory rows differ)
    (graph, strategies, blocks, env, budget, subset, truncate), (problem, _) = reused[0]
    other = next(args for args, _ in calls if args[3].inflight != env.inflight and args[5] != subset)
    assert not _equal_problems(problem.problem, build_problem(*other[:5], subset=other[5], truncate=other[6]).problem)


def test_a_changed_input_misses(recorded):
    _, calls, _ = recorded
    (graph, strategies, blocks, env, budget, subset, truncate), (_, names) = next(c for c in calls if c[1][1])
    key = chunk_reuse.scope_key(graph, subset, strategies, blocks, env, truncate, False)
    assert key is not None
    builds = chunk_reuse.ChunkBuilds(pinned=False)
    assert builds.build(graph, strategies, blocks, env, budget, subset, truncate)[1] is None
    assert builds.build(graph, strategies, blocks, env, budget / 2, subset, truncate)[1] is not None  # budget only
    deeper = dataclasses.replace(env, inflight=env.inflight + 1)
    assert builds.build(graph, strategies, blocks, deeper, budget, subset, truncate)[1] is None
    last = max((n for n in graph.gm.graph.nodes if n.name in subset and n.op == "call_function"),
               key=lambda n: list(graph.gm.graph.nodes).index(n))
    assert chunk_reuse.scope_key(graph, subset - {last.name}, strategies, blocks, env, truncate, False).key != key.key
    assert chunk_reuse.scope_key(graph, subset, strategies, blocks, env, truncate, True) is None  # pins: no key
    assert builds.reused == 1


def test_the_plan_is_byte_identical_to_one_built_chunk_by_chunk(recorded):
    plan, calls, fresh = recorded
    assert any(answer[1] is not None for _, answer in calls)
    assert plan.to_json() == fresh.to_json()
    assert plan.virtual_stages == 4 and len(plan.stages) == 8
