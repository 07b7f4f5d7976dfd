"""The Mist comparison and the long-context suite, each on a small simulated point (no process group, no timing).

* ``mist_grid`` is Mist's Megatron baseline: full recompute, the distributed optimizer where dp > 1, powers of two,
  micro-batches of 1, 2 or 4 sequences; ``vs_megatron.run_point`` scores a Mist-suite point on both hand grids
  (a tiny GPT at L4's shape of the suite), and ``mist_report`` turns the two sweeps' rows into the per-point
  ratios and the geometric means the issue's goals name;
* ``long_context``: every hand layout pins what its name says (the CP layout splits attention over the sequence,
  the TP and FSDP ones do not: the control), on HF Llama; a point writes its row, and the summary counts the
  points where autopar plans.
"""
import json
import math

import pytest
import torch

import autopar
from autopar.baselines.megatron_configs import mist_grid
from benchmarks.vs_hand import long_context, mist_report, vs_megatron, vs_megatron_report
from examples import gpt


def test_mist_grid_is_megatrons_baseline_as_mist_ran_it():
    configs = list(mist_grid(8, 24, 8, 128, n_heads=32, precision="bf16"))
    assert configs, "the grid has configs"
    for c in configs:
        assert c.recompute == "full" and c.distributed_optimizer == (c.dp > 1) and c.virtual_stages == 1
        assert all(x & (x - 1) == 0 for x in (c.dp, c.tp, c.pp)), c
        assert 128 // (c.dp * c.microbatches) in (1, 2, 4), c
    assert {(c.dp, c.tp, c.pp) for c in configs} >= {(8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 2, 2)}


@pytest.fixture(scope="module")
def tiny_mist_rows():
    """One Mist-suite point (a 2-block GPT at sequence 256 on 2 L4s, global batch 16 per GPU) on both grids."""
    patch = pytest.MonkeyPatch()
    patch.setitem(gpt.GPT_SUITE, "tiny", (128, 2, 4))
    patch.setitem(vs_megatron.MIST_SEQ, "l4", 256)
    options = {"offload": "auto"}
    rows = {grid: vs_megatron.run_point("mist:tiny:2:l4", lambda line: None, "bf16", options, 60.0, grid)
            for grid in ("mist", "full")}
    patch.undo()
    return rows


def test_a_mist_point_is_scored_on_both_grids(tiny_mist_rows):
    mist, full = tiny_mist_rows["mist"], tiny_mist_rows["full"]
    assert mist["hand_grid"] == "mist" and full["hand_grid"] == "full"
    assert all("rc-full" in config for config, _, _ in mist["scored"]), "Mist's baseline always recomputes"
    assert any("rc-full" not in config for config, _, _ in full["scored"]), "the full grid also runs without"
    assert full["memory_ignored"] and not mist["memory_ignored"], "only the full grid has memory-free configs"
    assert mist["auto_step"] == full["auto_step"], "the same autopar plan against both grids"
    assert mist["flops"] == vs_megatron.megatron_configs.megatron_flops(32, 256, 2, 128, 51200)
    for row in (mist, full):
        assert row["hand_step"] > 0 and row["auto_step"] > 0


def test_the_mist_report_scores_both_grids_against_the_goals(tiny_mist_rows, tmp_path, monkeypatch):
    monkeypatch.setattr(vs_megatron_report, "RESULTS", str(tmp_path))
    rows = {g: dict(r, point=p) for g, r in tiny_mist_rows.items() for p in ["mist:tiny:2:l4"]}
    second = dict(rows["full"], point="mist:tiny:4:l4", hand_step=rows["full"]["auto_step"] * 0.9,
                  memory_binds=True)
    (tmp_path / "vs_megatron_mist_mist.json").write_text(json.dumps([rows["mist"]]))
    (tmp_path / "vs_megatron_mist_full.json").write_text(json.dumps([rows["full"], second]))
    s = mist_report.scores(mist_report.load("mist_mist"), mist_report.load("mist_full"))
    assert s["mist"]["mist:tiny:2:l4"] == pytest.approx(rows["mist"]["hand_step"] / rows["mist"]["auto_step"])
    assert s["mist"]["mist:tiny:4:l4"] is None, "a point missing from one sweep is left out of its means"
    assert s["full_min"] == pytest.approx(min(0.9, rows["full"]["hand_step"] / rows["full"]["auto_step"]))
    assert s["binds"] == ["mist:tiny:4:l4"] and s["full_geomean_binds"] == pytest.approx(0.9)
    assert s["full_geomean_all"] == pytest.approx(math.sqrt(0.9 * s["full"]["mist:tiny:2:l4"]))
    with open(mist_report.render(("mist_mist",), ("mist_full",), ())) as f:
        text = f.read()
    assert "0.900 (goal ≥ 1.10: NOT met)" in text, "a missed goal is reported as missed"
    assert (tmp_path / "vs_megatron_mist.png").exists()


def test_a_replanned_autopar_side_replaces_only_the_current_sweeps(tiny_mist_rows, tmp_path, monkeypatch):
    """``mist_report``: autopar's re-planned side goes into the rows of the sweeps scored under the same cost
    model (``current``) and no other, so both sides of every row stay priced alike."""
    monkeypatch.setattr(vs_megatron_report, "RESULTS", str(tmp_path))
    row = dict(tiny_mist_rows["full"], point="mist:tiny:2:l4")
    (tmp_path / "vs_megatron_old.json").write_text(json.dumps([row]))
    (tmp_path / "vs_megatron_new.json").write_text(json.dumps([row]))
    replanned = {"mist:tiny:2:l4": {"point": "mist:tiny:2:l4", "auto_step": row["auto_step"] / 2,
                                    "auto_plan": "re-planned", "replanned": "# re-planned"}}
    current = mist_report.merged(("new",), ("new",), replanned)["mist:tiny:2:l4"]
    assert current["auto_step"] == row["auto_step"] / 2 and current["auto_plan"] == "re-planned"
    assert current["hand_step"] == row["hand_step"], "the hand side is the sweep's own"
    stale = mist_report.merged(("old",), ("new",), replanned)["mist:tiny:2:l4"]
    assert stale["auto_step"] == row["auto_step"], "negative control: a sweep of another cost model keeps its own"


# ---- long context ----------------------------------------------------------------------------------------

def _plan(kind: str, dp: int, m: int, family_model: str = "llama-small"):
    model, batch, family = long_context.workload(family_model, 128, dp)
    cluster = autopar.Cluster.preset("dgx-h100", gpus=dp * m, mesh_shape=(dp, m))
    return autopar.plan(model, cluster, batch, **long_context.hand_options(kind, dp, family))


@pytest.mark.parametrize("model", ["llama-small", "llama-small-causal"])
@pytest.mark.parametrize("kind,splits", [("cp", True), ("tp", False), ("fsdp", False)])
def test_each_long_context_hand_layout_is_what_its_name_says(kind, splits, model):
    """On HF Llama as exported (materialized mask) and on its mask-free path (is_causal, grouped heads): CP splits
    attention over the sequence (the mask-free one with the causal kernel), TP over heads, FSDP over the batch."""
    dp, m = (4, 1) if kind == "fsdp" else (2, 2)
    plan = _plan(kind, dp, m, model)
    assert long_context.uses_context_parallel(plan) == splits
    sharded = [s.out for name, s in plan.stages[0].shardings.items() if name.endswith("_q_proj_weight")]
    assert sharded and all(out == ("RS(0)" if kind == "tp" else "RR") for out in sharded), sharded
    attention = [s for name, s in plan.stages[0].shardings.items() if name.startswith("scaled_dot_product")]
    if model.endswith("causal"):
        assert {s.out for s in attention} == {{"cp": "S(0)S(2)", "tp": "S(0)S(1)", "fsdp": "S(0)R"}[kind]}
        assert all(((1, "causal_context") in s.kernels) == (kind == "cp") for s in attention)


def test_a_long_context_point_is_written_and_summarised(tmp_path, monkeypatch):
    monkeypatch.setattr(long_context, "RESULTS", str(tmp_path))
    monkeypatch.setattr(long_context, "WIDTHS", (2,))
    row = long_context.run_point("256:2", "llama-small", lambda line: None)
    assert set(row["hand"]) == {"fsdp2", "tp2·fsdp1", "cp2·fsdp1"}
    assert row["best"] in row["hand"] and row["auto_step"] > 0
    assert row["auto_options"] == {} and "zero=3" not in row["auto_plan"], "default options plan this point"
    assert row["global_batch"] == (2 if row["best"] == "fsdp2" else 1)
    long_context.write("lc", "# header", [row])
    assert json.loads((tmp_path / "lc.json").read_text()) == [row]
    text = (tmp_path / "lc.md").read_text()
    assert "autopar plans at 1 of the 1 points where a hand layout fits" in text
    no_cp = dict(row, hand={k: (v if k.startswith("cp") else None) for k, v in row["hand"].items()})
    assert "at 1 of the 1 points where only context-parallel hand layouts fit" in long_context.summary([no_cp])
    assert "at 0 of the 1 points where only context-parallel hand layouts fit" in long_context.summary(
        [dict(no_cp, auto_step=None)]), "a point without an autopar plan is counted as such"
    nothing = dict(row, hand={k: None for k in row["hand"]}, best=None, hand_step=None)
    assert "at 1 of the 1 points where no hand layout fits" in long_context.summary([nothing])


def test_megatrons_layout_on_the_llama_style_models_by_their_names(monkeypatch):
    """A Llama-style Mist model (HF Llama at a GPT-suite entry's shape) takes Megatron's tensor-parallel layout
    by Llama's names: column-parallel q and gate, row-parallel o and down on the tp axis, the batch over dp."""
    from autopar.baselines.hand_search import capture_once
    from autopar.baselines.megatron_configs import LLAMA_NAMES, MegatronConfig, score_config

    monkeypatch.setitem(gpt.GPT_SUITE, "tiny", (64, 2, 4))
    work = vs_megatron.llama_workload("tiny", 64, 8)
    assert work.model.lm.config.intermediate_size == 256 and work.flops > 0
    graph, recapture = capture_once(work.model, work.batch, "bf16")
    cluster = autopar.Cluster.preset("l4", gpus=4)
    scored = score_config(graph, cluster, MegatronConfig(dp=2, tp=2, pp=1, microbatches=1, precision="bf16"), 2,
                          recapture, names=LLAMA_NAMES)
    specs = {name: s.out for name, s in scored.plan.stages[0].shardings.items()}
    expect = {"q_proj": "RS(0)", "gate_proj": "RS(0)", "o_proj": "RS(1)", "down_proj": "RS(1)", "norm": "RR"}
    for part, spec in expect.items():
        names = [n for n in specs if n.startswith("p_") and n.endswith(f"{part}_weight")]
        assert names and {specs[n] for n in names} == {spec}, (part, {n: specs[n] for n in names})
    assert specs["input_ids"] == "S(0)R"


class _GroupedAttention(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def test_grouped_query_attention_splits_heads_exactly_with_a_negative_control():
    """SDPA with ``enable_gqa`` (HF Llama's mask-free path): q's 4 heads and k's, v's 2 split over a mesh axis
    alike (each device keeps whole groups) match the full result's slice on every device of a 2×2 mesh; q split
    with k and v replicated (groups torn apart) does not."""
    from torch.distributed.tensor import Shard

    from autopar.passes.strategies.base import Strategy
    from autopar.placement import R
    from tests.test_vs_megatron import ops_with_strategies, strategy_is_exact

    gen = torch.Generator().manual_seed(0)
    inputs = (torch.randn(2, 4, 4, 3, generator=gen), torch.randn(2, 2, 4, 3, generator=gen),
              torch.randn(2, 2, 4, 3, generator=gen))
    (node,), strategies, full = ops_with_strategies(_GroupedAttention(), inputs,
                                                    {torch.ops.aten.scaled_dot_product_attention})
    heads = [s for s in strategies[node.name] if Shard(1) in s.out_spec]
    assert heads, "a head split is offered"
    assert all(strategy_is_exact(node, s, full) for s in strategies[node.name])
    torn = Strategy(((R, Shard(1)), (R, R), (R, R)), (R, Shard(1)))
    assert not strategy_is_exact(node, torn, full), "the negative control must fail"
