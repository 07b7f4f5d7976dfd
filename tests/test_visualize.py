"""The plan pictures: the HTML report (self-contained, complete, readable at 48 layers) and the schedule trace.

Tier 1 (no process group): one real plan of the example GPT for 2×DGX-A100, plus hand-made variants of it
(a 2-stage pipeline with collectives, a 48-layer model) so pipeline fields are covered before the planner
emits them. The Chromium check runs only where /usr/bin/chromium exists.
"""
from __future__ import annotations

import copy
import json
import os
import re
import struct
import subprocess
import zlib

import pytest

import autopar
from autopar.ir.schedule import simulate_schedule, stage_order
from autopar.ir.units import fmt_bytes
from autopar.plan import Collective, NodeSharding, Plan, Stage
from autopar.views.trace import bubble_fraction, schedule_to_chrome_trace, write_chrome_trace
from autopar.views.visualize import placement_cells, plan_to_html, write_html
from autopar.views.visualize_groups import compress_ranges, group_ops, group_placeholders
from examples.gpt import make_gpt

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def gpt_plan() -> Plan:
    model, batch = make_gpt()
    return autopar.plan(model, autopar.Cluster.preset("dgx-a100", nodes=2), batch)


def two_stage_variant(plan: Plan, microbatches: int = 3, schedule: str = "1f1b") -> Plan:
    """The plan cut after its first block into two 1×8 stages, with the fields pipelining adds."""
    src = plan.stages[0]
    cut = src.nodes.index(plan.repeated_blocks["blocks#0"][0][-1]) + 1
    stages = []
    for k, names in enumerate((src.nodes[:cut], src.nodes[cut:])):
        stages.append(Stage(index=k, ranks=list(range(8 * k, 8 * k + 8)), mesh_shape=(1, 8), submesh=(1, 8),
                            nodes=names, shardings={n: src.shardings[n] for n in names}, layers=(2 * k, 2 * k + 1),
                            predicted={"latency": 3e-3, "forward": 1e-3, "backward": 2e-3, "compute": 2.5e-3,
                                       "comm": 5e-4, "grad_sync": 4e-4, "memory": 2**30, "peak_memory": 1.5 * 2**30}))
    dst = [n for n in stages[1].nodes if n in plan.node_ops][1]
    stages[1].collectives = [Collective("layer_norm_2", dst, "all_gather", 1, 3 * 2**20, "forward"),
                             Collective(dst, "layer_norm_2", "reduce_scatter", 1, 5 * 2**20, "backward")]
    out = copy.deepcopy(plan)
    out.stages, out.microbatches, out.schedule = stages, microbatches, schedule
    return out


def deep_variant(n_layers: int = 48, ops_per_layer: int = 30) -> Plan:
    """A synthetic 48-layer plan (thousands of ops) built without planning, shaped like a transformer's."""
    nodes, shardings, ops, blocks = ["x"], {"x": NodeSharding("S(0)R")}, {}, []
    for layer in range(n_layers):
        names = [f"op_{layer}_{i}" for i in range(ops_per_layer)]
        nodes.append(f"p_blocks_{layer}_w")
        shardings[f"p_blocks_{layer}_w"] = NodeSharding("RS(1)")
        for i, name in enumerate(names):
            shardings[name] = NodeSharding(["S(0)S(1)", "S(0)P", "RR"][i % 3], ("S(0)R",))
            ops[name] = ["aten.mm.default", "aten.add.Tensor", "aten.gelu.default"][i % 3]
        nodes += names
        blocks.append(names)
    stage = Stage(index=0, ranks=list(range(16)), mesh_shape=(2, 8), submesh=(2, 8), nodes=nodes,
                  shardings=shardings, predicted={"latency": 1.0, "memory": 2**33, "peak_memory": 2**34})
    stage.collectives = [Collective(b[0], b[1], "all_reduce", 0, 2**24, "backward") for b in blocks]
    return Plan(model="Deep", graph_fingerprint="0", input_signature=[], cluster=_cluster_dict(), stages=[stage],
                repeated_blocks={"blocks#0": blocks}, node_ops=ops)


def _cluster_dict() -> dict:
    return autopar.Cluster.preset("dgx-a100", nodes=2).to_dict()


# ---- HTML -----------------------------------------------------------------------------------------

def test_html_is_self_contained(gpt_plan):
    for plan in (gpt_plan, two_stage_variant(gpt_plan)):
        page = plan_to_html(plan)
        assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
        assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", page, re.I)
        assert "http://" not in page and "https://" not in page and "<link" not in page and "@import" not in page


def test_html_names_every_stage_op_and_collective(gpt_plan):
    plan = two_stage_variant(gpt_plan)
    page = plan_to_html(plan)
    for stage in plan.stages:
        assert f"stage {stage.index}" in page and f'id="stage-{stage.index}"' in page
        for c in stage.collectives:
            assert f"{c.kind} axis {c.axis} {c.phase} {fmt_bytes(c.nbytes)} from {c.src}" in page
    for target in set(plan.node_ops.values()):
        assert target in page, target
    first_instance = plan.repeated_blocks["blocks#0"][0]
    assert all(f'data-name="{n} ' in page for n in first_instance)


def test_html_folds_identical_block_instances(gpt_plan):
    page = plan_to_html(gpt_plan)
    later = gpt_plan.repeated_blocks["blocks#0"][1]
    assert "same shardings in instances 1" in page
    assert not any(f'data-name="{n} ' in page for n in later)


def test_html_stays_readable_for_48_layers():
    plan = deep_variant()
    page = plan_to_html(plan)
    assert len(page) < 250_000, len(page)
    assert page.count("<tr data-name=") == 30  # block 0 only; 47 instances folded
    assert "same shardings in instances 1–47" in page
    assert "p_blocks_*_w" in page  # 48 parameters folded into one row


def test_html_reads_optional_pipeline_fields(gpt_plan):
    plan = two_stage_variant(gpt_plan, microbatches=4, schedule="gpipe")
    plan.transfers = [{"src_stage": 0, "dst_stage": 1, "tensor": "add_2", "nbytes": 2**20}]
    page = plan_to_html(plan)
    assert "Cross-stage transfers" in page and "1.00 MiB" in page
    assert "schedule <b>gpipe</b>, 4 microbatch(es)" in page
    bare = copy.deepcopy(gpt_plan)
    bare.predicted, bare.planner = {}, {}
    for s in bare.stages:
        s.predicted = {}
    assert "stage 0" in plan_to_html(bare)


def test_group_ops_folds_only_identical_instances():
    blocks = {"b#0": [["a0", "b0"], ["a1", "b1"], ["a2", "b2"]]}
    specs = {"a0": "RR", "b0": "S(0)R", "a1": "RR", "b1": "S(0)R", "a2": "RR", "b2": "RR", "x": "RR"}
    groups = group_ops(["x", "a0", "b0", "a1", "b1", "a2", "b2"], blocks, specs.get)
    assert [g.label for g in groups] == ["op x", "b#0[0]", "b#0[2]"]
    assert groups[1].folded == {1: ["a1", "b1"]}
    chunks = group_ops([f"n{i}" for i in range(130)], {}, specs.get, max_ops=60)
    assert [len(g.nodes) for g in chunks] == [60, 60, 10]


def test_small_helpers():
    assert compress_ranges([1, 2, 3, 5, 7, 8]) == "1–3, 5, 7–8"
    rows = group_placeholders(["p_h_0_w", "p_h_1_w", "p_h_2_w", "idx"], {"p_h_2_w": "RR"}.get)
    assert [(r.pattern, len(r.names)) for r in rows] == [("p_h_*_w", 2), ("p_h_2_w", 1), ("idx", 1)]
    assert placement_cells("S(0)P", 2) == [("pS0", "S(0)"), ("pP", "P")]
    assert placement_cells("R", 2) == [("pR", "R"), ("pX", "?")]


# ---- schedule simulation and Chrome trace ----------------------------------------------------------

def _starts(ops):
    return {(op.stage, f"{op.kind}{op.microbatch}"): op.start for op in ops}


def test_gpipe_and_1f1b_match_hand_computed_times():
    """2 stages × 3 microbatches, forward 1, backward 2 (computed by hand from the two rules)."""
    gpipe = _starts(simulate_schedule([1, 1], [2, 2], 3, "gpipe"))
    assert gpipe == {(0, "F0"): 0, (0, "F1"): 1, (0, "F2"): 2, (1, "F0"): 1, (1, "F1"): 2, (1, "F2"): 3,
                     (1, "B0"): 4, (1, "B1"): 6, (1, "B2"): 8, (0, "B0"): 6, (0, "B1"): 8, (0, "B2"): 10}
    one_f_one_b = _starts(simulate_schedule([1, 1], [2, 2], 3, "1f1b"))
    assert one_f_one_b == {(0, "F0"): 0, (0, "F1"): 1, (1, "F0"): 1, (1, "B0"): 2, (0, "B0"): 4, (1, "F1"): 4,
                           (1, "B1"): 5, (0, "F2"): 6, (0, "B1"): 7, (1, "F2"): 7, (1, "B2"): 8, (0, "B2"): 10}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,microbatches", [(2, 3), (4, 8), (8, 4)])
def test_bubble_fraction_for_equal_stages(schedule, stages, microbatches):
    ops = simulate_schedule([1.0] * stages, [2.0] * stages, microbatches, schedule)
    assert bubble_fraction(ops, stages) == pytest.approx((stages - 1) / (microbatches + stages - 1))


def test_1f1b_order_warms_up_then_alternates():
    assert stage_order("1f1b", 0, 4, 6)[:5] == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0)]
    assert stage_order("1f1b", 3, 4, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    for s in range(4):
        assert sorted(stage_order("1f1b", s, 4, 2)) == sorted(stage_order("gpipe", s, 4, 2))


def _assert_rows_do_not_overlap(events):
    rows = {}
    for e in events:
        if e["ph"] == "X":
            rows.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in rows.values():
        spans.sort()
        assert all(a_end <= b_start + 1e-6 for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_chrome_trace_of_a_pipeline(gpt_plan, tmp_path):
    plan = two_stage_variant(gpt_plan, microbatches=3)
    write_chrome_trace(plan, tmp_path / "trace.json")
    trace = json.loads((tmp_path / "trace.json").read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for s in (0, 1):
        names = [e["name"] for e in complete if e["pid"] == s and e["tid"] == 0]
        assert sorted(names) == sorted([f"F{i}" for i in range(3)] + [f"B{i}" for i in range(3)])
        syncs = [e for e in complete if e["pid"] == s and e["tid"] == 1]
        assert syncs and {e["name"] for e in syncs} <= {"grad sync", "param gather"}
        last_b = max((e for e in complete if e["pid"] == s and e["tid"] == 0), key=lambda e: e["ts"] + e["dur"])
        # buckets overlap the last backward (several buckets) or follow it (one), never start before it
        assert min(e["ts"] for e in syncs) >= last_b["ts"] - 1e-6
        assert max(e["ts"] + e["dur"] for e in syncs) >= last_b["ts"] + last_b["dur"] - 1e-6
        if len(syncs) > 1:
            assert min(e["ts"] for e in syncs) < last_b["ts"] + last_b["dur"], "no overlap shown"
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"} == \
        {"stage 0 (ranks 0–7)", "stage 1 (ranks 8–15)"}
    b0 = next(e for e in complete if e["pid"] == 0 and e["name"] == "B0")
    assert b0["ts"] == pytest.approx(4000.0) and b0["dur"] == pytest.approx(2000.0)  # µs
    _assert_rows_do_not_overlap(trace["traceEvents"])


def test_chrome_trace_of_a_single_stage_plan(gpt_plan):
    trace = schedule_to_chrome_trace(gpt_plan)
    json.dumps(trace)  # plain JSON types only
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 0]  # tid 1: gradient sync
    assert [e["name"] for e in complete] == ["F0", "B0"]
    latency = gpt_plan.stages[0].predicted["latency"] * 1e6
    assert complete[1]["ts"] + complete[1]["dur"] == pytest.approx(latency)
    _assert_rows_do_not_overlap(trace["traceEvents"])


# ---- rendering in a real browser --------------------------------------------------------------------

def png_color_count(path, limit: int = 2) -> int:
    """Distinct pixel colours in a PNG (up to ``limit``): Pillow if present, else zlib and the PNG filters."""
    try:
        from PIL import Image
    except ImportError:
        return _png_color_count_zlib(path, limit)
    with Image.open(path) as im:
        colors = im.convert("RGB").getcolors(maxcolors=limit)
    return limit if colors is None else len(colors)


def _png_color_count_zlib(path, limit: int) -> int:
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, (width, height, depth, ctype) = 8, b"", (0, 0, 0, 0)
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, ctype = struct.unpack(">IIBB", chunk[:10])
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    assert depth == 8 and ctype in (2, 6), "screenshot PNGs are 8-bit RGB(A)"
    bpp, raw = (3 if ctype == 2 else 4), zlib.decompress(idat)
    stride, prev, colors = width * (3 if ctype == 2 else 4), bytearray(width * bpp), set()
    for y in range(height):
        line = raw[y * (stride + 1):(y + 1) * (stride + 1)]
        cur = _unfilter(line[0], bytearray(line[1:]), prev, bpp)
        colors.update(bytes(cur[i:i + 3]) for i in range(0, stride, bpp))
        if len(colors) >= limit:
            return limit
        prev = cur
    return len(colors)


def _unfilter(kind: int, cur: bytearray, prev: bytearray, bpp: int) -> bytearray:
    for i in range(len(cur)):
        a = cur[i - bpp] if i >= bpp else 0
        b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
        pred = [0, a, b, (a + b) // 2, _paeth(a, b, c)][kind]
        cur[i] = (cur[i] + pred) & 0xFF
    return cur


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else (b if pb <= pc else c)


def screenshot(html_path, png_path, profile_dir) -> None:
    """Render a local HTML file headless, offline (no network features), into a 1400×1000 PNG."""
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={profile_dir}", f"--screenshot={png_path}", "--window-size=1400,1000",
                    f"file://{os.path.abspath(html_path)}"], check=True, timeout=90, capture_output=True)


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium at /usr/bin/chromium")
def test_chromium_renders_a_non_blank_page(gpt_plan, tmp_path):
    write_html(two_stage_variant(gpt_plan), tmp_path / "plan.html")
    screenshot(tmp_path / "plan.html", tmp_path / "plan.png", tmp_path / "profile")
    assert (tmp_path / "plan.png").stat().st_size > 0
    assert png_color_count(tmp_path / "plan.png") > 1


def test_png_parser_agrees_with_known_images(tmp_path):
    """The zlib fallback of png_color_count, on a one-colour and a two-colour PNG written by hand."""
    def write_png(path, rows):
        raw = b"".join(b"\x00" + bytes(r) for r in rows)
        ihdr = struct.pack(">IIBBBBB", len(rows[0]) // 3, len(rows), 8, 2, 0, 0, 0)
        chunk = lambda k, d: struct.pack(">I", len(d)) + k + d + struct.pack(">I", zlib.crc32(k + d))  # noqa: E731
        path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw))
                         + chunk(b"IEND", b""))
    write_png(tmp_path / "one.png", [[255, 255, 255] * 8] * 4)
    write_png(tmp_path / "two.png", [[255, 255, 255] * 8] * 3 + [[0, 0, 0] * 8])
    assert _png_color_count_zlib(tmp_path / "one.png", 2) == 1
    assert _png_color_count_zlib(tmp_path / "two.png", 2) == 2


def test_the_step_bar_adds_up_to_the_predicted_step_time():
    """Its parts are wall time (busiest stage's work + bubble + grad sync), not sums over stages."""
    from autopar.planner.plan_builder import predict
    from autopar.views.visualize import _step_parts

    model, batch = make_gpt()
    plan = two_stage_variant(autopar.plan(model, autopar.Cluster.preset("dgx-a100", nodes=2), batch), 8)
    plan.predicted = predict(plan.stages, plan.microbatches, plan.schedule, [])
    parts = dict((name, seconds) for name, seconds, _ in _step_parts(plan))
    assert sum(parts.values()) == pytest.approx(plan.predicted["step_time"], rel=1e-9)
    assert parts["compute"] / parts["communication"] == pytest.approx(2.5e-3 / 5e-4)


def test_the_report_replays_the_schedule_the_prediction_used():
    """``trace.simulate_plan`` (the report, the Chrome trace) and ``predict`` give the same makespan."""
    from autopar.views.trace import simulate_plan

    cluster = autopar.Cluster.preset("p3.16xlarge", nodes=2)
    model, batch = make_gpt()
    plan = autopar.plan(model, cluster, batch, stages=2, microbatches=4)
    assert plan.predicted["transfer"] > 0
    makespan = max(op.end for op in simulate_plan(plan))
    # the step charges the sync's exposed part (plan_builder.predict: makespan + exposed + optimizer)
    want = plan.predicted["step_time"] - plan.predicted["grad_sync_exposed"] - plan.predicted["optimizer"]
    assert makespan == pytest.approx(want, rel=1e-9)
