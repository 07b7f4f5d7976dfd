"""Interleaved 1F1B: Megatron's order (``ir.schedule.device_order``), its bubble and in-flight counts, the
planner's choice of virtual stages (``passes.interleave``) and the option's checks. Runtime parity is in
test_pipeline_parity.py."""
import dataclasses

import pytest
import torch

import autopar
from autopar.errors import PlanError
from autopar.hardware.cluster import Link
from autopar.ir.schedule import BACKWARD, FORWARD, device_order, inflight, simulate_schedule
from autopar.planner.options import PlanOptions
from tests.test_pipeline_planner import FourBlocks


@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (2, 3, 6), (4, 2, 4)])
def test_every_chunk_runs_each_microbatch_once_forward_then_backward(pp, v, m):
    for d in range(pp):
        order = device_order(d, pp, v, m)
        chunks = {s for _, s, _ in order}
        assert chunks == set(range(d, pp * v, pp)), "device d holds virtual stages d, d+pp, ..."
        for s in chunks:
            fwd = [i for kind, c, i in order if c == s and kind == FORWARD]
            bwd = [i for kind, c, i in order if c == s and kind == BACKWARD]
            assert fwd == bwd == list(range(m)), "each chunk sees microbatches in order, forward and backward"
        warmup = next(k for k, op in enumerate(order) if op[0] == BACKWARD)
        expected = m * v if m == pp else (pp - d - 1) * 2 + (v - 1) * pp
        assert warmup == min(expected + 1, m * v) if m != pp else warmup == m * v


@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 16), (8, 2, 16)])
def test_bubble_shrinks_by_the_number_of_chunks(pp, v, m):
    """Forward 1, backward 2 per stage of the model: chunks take 1/v of that. The idle time of the
    pipeline is (pp − 1)·(f + b)/v, Megatron's (pp − 1)/(v·m) of the ideal m·(f + b)."""
    ideal = m * 3.0
    plain = max(op.end for op in simulate_schedule([1.0] * pp, [2.0] * pp, m, "1f1b"))
    chunked = simulate_schedule([1.0 / v] * (pp * v), [2.0 / v] * (pp * v), m, "interleaved", 0.0, v)
    assert plain - ideal == pytest.approx((pp - 1) * 3.0)
    assert max(op.end for op in chunked) - ideal == pytest.approx((pp - 1) * 3.0 / v)


def test_warm_up_keeps_more_microbatches_in_flight_on_the_first_device():
    assert inflight("1f1b", 4, 8) == [4, 3, 2, 1]
    live = inflight("interleaved", 8, 8, 2)
    assert live[0] > 4 and live[0] >= live[3], live  # device 0's first chunk holds more than 1F1B's stage 0


def test_microbatches_must_come_in_groups_of_pp():
    with pytest.raises(ValueError, match="multiple of the devices"):
        device_order(0, 4, 2, 6)


def four_node_plan(microbatches: int, host: float = 0.0, **options) -> autopar.Plan:
    """FourBlocks (4 layers of 8191², batch 8192) over 4 single-A100 nodes on a 25 Gbps link, 2 stages;
    ``host``: the cluster's microbatch_overhead."""
    with torch.device("meta"):
        model = FourBlocks()
    x = torch.empty(8192, 8191, device="meta")
    base = dataclasses.replace(autopar.Cluster.preset("dgx-a100", nodes=4), devices_per_node=1, mesh_shape=None,
                               memory_per_device=640 * 2**30)
    cluster = dataclasses.replace(base, inter_node=Link(latency=5e-6, bandwidth=25e9 / 8), microbatch_overhead=host)
    return autopar.plan(model, cluster, (x, x.clone()), microbatches=microbatches, stages=2, **options)


def test_planner_interleaves_when_the_smaller_bubble_pays_for_the_sends():
    """schedule="auto" prices v = 1 and v = 2 with the schedule simulator and keeps the faster. With 64
    microbatches each send is small (128 rows) and the bubble saved dominates: interleaved. With 2
    microbatches each send carries 4096 rows × 8191 over 25 Gbps, and interleaving's 3 sends per
    microbatch on the critical path (1F1B: 1) cost more than the bubble saves: 1F1B."""
    many, few = four_node_plan(64, schedule="auto"), four_node_plan(2, schedule="auto")
    for plan in (many, few):
        priced = {int(v): t for v, t in plan.planner["virtual_stages"].items() if isinstance(t, float)}
        assert plan.virtual_stages == min(priced, key=priced.get), priced  # the cost model's choice
    assert many.schedule == "interleaved" and many.virtual_stages == 2 and len(many.stages) == 4
    assert [s.ranks for s in many.stages[2:]] == [s.ranks for s in many.stages[:2]], "chunks round robin"
    assert few.schedule == "1f1b" and few.virtual_stages == 1 and len(few.stages) == 2
    # why: replaying the 1F1B plan's stages cut in two chunks, the sends alone decide
    f = [s.predicted["forward"] / 2 for s in few.stages for _ in range(2)]
    f = [f[0], f[2], f[1], f[3]]  # chunk j on device j mod 2: stage 0's halves are chunks 0 and 2
    b = [2 * t for t in f]
    hop = few.predicted["transfer"]
    span = lambda ops: max(op.end for op in ops)  # noqa: E731
    one = [s.predicted["forward"] for s in few.stages]
    assert span(simulate_schedule(f, b, 2, "interleaved", 0.0, 2)) < span(simulate_schedule(one, [2 * t for t in one],
                                                                                            2, "1f1b", 0.0))
    assert span(simulate_schedule(f, b, 2, "interleaved", hop, 2)) > span(simulate_schedule(one, [2 * t for t in one],
                                                                                            2, "1f1b", hop))


def test_host_time_per_chunk_and_microbatch_prices_chunks_and_microbatches():
    """c = microbatch_overhead on every chunk's forward and backward: the interleave pass's price of 1F1B
    grows by 2c·(B + pp − 1), that of v = 2 chunks by up to 2c·(B·v + pp − 1) (less the part that waits for
    the chunks' sends hide), so at c = 1 ms the 64 ms that v = 2 saved no longer pays for its extra charges;
    and the stage DP, whose every stage pays 2c per microbatch, picks fewer microbatches than the 512 it
    picks without it."""
    c, pp, B = 1e-3, 2, 64
    plain, charged = four_node_plan(B, schedule="auto"), four_node_plan(B, host=c, schedule="auto")
    before, after = (p.planner["virtual_stages"] for p in (plain, charged))
    assert after["1"] - before["1"] == pytest.approx(2 * c * (B + pp - 1), rel=1e-6)
    assert 2 * c * (B + pp - 1) + (before["1"] - before["2"]) < after["2"] - before["2"] <= 2 * c * (2 * B + pp - 1)
    assert plain.virtual_stages == 2 and charged.virtual_stages == 1 and charged.schedule == "1f1b"
    assert charged.stages[0].predicted["microbatch_overhead"] == c
    fewer, more = (four_node_plan(None, host=h, schedule="1f1b").microbatches for h in (c, 0.0))
    assert fewer < more


def test_auto_falls_back_to_the_dp_stages_when_an_interleaved_chunk_does_not_fit(monkeypatch):
    """The first exact solve (an interleaved chunk: "auto" chose v = 2 at 64 microbatches, as above) runs
    under a 1-byte budget, so the real ILP finds it infeasible. A chunk is no DP cell: the same DP stages
    are solved again un-interleaved and the plan says why, instead of the DP being re-run on a ruled-out
    cell it never priced (which gave the same chunks again until the retries ran out)."""
    from autopar.planner import driver

    real, rejected = driver.build_problem, []

    def solve(graph, strategies, blocks, env, budget, *args, subset=None, **kwargs):
        cell = frozenset(subset or ())
        if not rejected or cell == rejected[0]:
            rejected.append(cell)
            budget = 1.0
        return real(graph, strategies, blocks, env, budget, *args, subset=subset, **kwargs)

    monkeypatch.setattr(driver, "build_problem", solve)
    plan = four_node_plan(64, schedule="auto")
    assert len(rejected) == 1, "the chunk was solved once; the DP stages that replaced it fit"
    assert plan.virtual_stages == 1 and plan.schedule == "1f1b" and len(plan.stages) == 2
    assert "did not fit" in plan.planner["virtual_stages"]["why"]
    assert plan.planner["dp_rejected_stages"] == 1


def test_interleaved_chunks_share_their_device_memory():
    """GPT-6.7B on 16 V100s (fp16, batch 1024): "auto" interleaves two 1×8 stages into four chunks. Each
    chunk's exact solve gets its share of the device (``_LayerPrices.shares``), so a device's chunks stay
    within 16 GB together; solved with the whole device each, the same plan predicted 27.5 GiB."""
    from examples.gpt import GPT, make_batch, suite_config

    cfg = suite_config("6.7B")
    with torch.device("meta"):
        model = GPT(cfg).half()
    plan = autopar.plan(model, autopar.Cluster.preset("p3.16xlarge", gpus=16), make_batch(cfg, 1024, device="meta"))
    assert plan.schedule == "interleaved" and plan.virtual_stages > 1, plan.planner["virtual_stages"]
    pp = len(plan.stages) // plan.virtual_stages
    per_device = [sum(s.predicted["peak_memory"] for s in plan.stages[d::pp]) for d in range(pp)]
    assert max(per_device) <= plan.cluster["memory_per_device"], per_device
    assert plan.predicted["peak_memory"] == max(per_device)


def test_forced_interleaving_and_what_it_cannot_do():
    plan = four_node_plan(2, schedule="interleaved")
    assert plan.schedule == "interleaved" and plan.virtual_stages == 2  # slower here, but forced
    assert "2 model chunks per device" in plan.summary()
    assert autopar.Plan.from_json(plan.to_json()) == plan
    with pytest.raises(PlanError, match="needs 6 layers"):
        four_node_plan(2, schedule="interleaved", virtual_stages=3)


@pytest.mark.parametrize("options,match", [
    ({"virtual_stages": 0}, "positive int"),
    ({"virtual_stages": 2, "schedule": "1f1b"}, "needs schedule='interleaved'"),
    ({"virtual_stages": 2, "schedule": "interleaved", "stages": [{"layers": [0, 3], "submesh": [1, 1]}] * 3},
     "do not split into virtual_stages=2"),
])
def test_bad_interleaving_options(options, match):
    with pytest.raises(PlanError, match=match):
        PlanOptions(**options)


def test_bad_manual_chunks():
    mixed = [{"layers": [k, k], "submesh": [1, 2 if k != 1 else 1]} for k in range(4)]
    with pytest.raises(PlanError, match="stage 3 must use the submesh and mesh of stage 1"):
        _manual(mixed, 4, devices=3)
    same = [{"layers": [k, k], "submesh": [1, 1]} for k in range(4)]
    with pytest.raises(PlanError, match="multiple of 2"):
        _manual(same, 1, devices=2)


def _manual(stages, microbatches, devices):
    with torch.device("meta"):
        model = FourBlocks(d=512)
    x = torch.empty(64, 512, device="meta")
    cluster = autopar.Cluster.local(devices)
    return autopar.plan(model, cluster, (x, x.clone()), stages=stages, schedule="interleaved", virtual_stages=2,
                        microbatches=microbatches, layers=4)
