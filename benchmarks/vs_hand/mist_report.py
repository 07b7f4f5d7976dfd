"""The Mist comparison in one table: autopar against Mist's Megatron baseline and against the full hand grid.

    python benchmarks/vs_hand/vs_megatron.py --simulate --suite mist --grid mist   # -> vs_megatron_mist_mist.json
    python benchmarks/vs_hand/vs_megatron.py --simulate --suite mist --grid full   # -> vs_megatron_mist_full.json
    python benchmarks/vs_hand/mist_report.py       # -> benchmarks/results/vs_megatron_mist.{md,png}
    python benchmarks/vs_hand/mist_report.py --replan [--points P ...]   # autopar's side again, this tree

Reads the two sweeps' saved rows (the same points, the same autopar plan on both: ``autopar.plan`` with default
options and ``offload="auto"``) and scores each point as a throughput ratio autopar / best hand layout that fits
(= hand step time / autopar step time). The issue's goals, each reported met or not:
  * against Mist's baseline (``megatron_configs.mist_grid``: full recompute, distributed optimizer, powers of
    two, micro-batch 1/2/4): geometric mean over all points >= 1.28 (Mist's own average) and min >= 1.00;
  * against the full grid (``megatron_grid``; sequence parallelism through the ILP's placement of activations):
    min >= 1.00 and geometric mean >= 1.10 over the points where memory binds (``HandSearch.memory_binds``).
A point missing from either sweep, or where one side has no plan, is listed and left out of the means.

The hand grids are scored with manual stages, fixed microbatches and pins, which a change to the planner's
own search does not reach; ``--replan`` plans autopar's side of every point once on this tree (each point's
plan is the same against both grids) into ``vs_megatron_mist_autopar.json``, kept per point (``--points``
replans some) and, where present, used for both grids instead of the sweeps' own autopar columns.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.vs_hand import vs_megatron  # noqa: E402
from benchmarks.vs_hand import vs_megatron_report as report  # noqa: E402

FAMILIES = {"mist": "GPT-3", "mistllama": "Llama-style"}
GOALS = {"mist": {"geomean": 1.28, "min": 1.00}, "full": {"geomean": 1.10, "min": 1.00}}


def load(*names: str) -> dict[str, dict]:
    """{point: row} of ``benchmarks/results/vs_megatron_NAME.json`` for each name (sweeps run side by side; a
    later name's row replaces an earlier's); a file that is not there adds nothing."""
    rows = {}
    for name in names:
        path = os.path.join(report.RESULTS, f"vs_megatron_{name}.json")
        if os.path.exists(path):
            with open(path) as f:
                rows.update({r["point"]: r for r in json.load(f)})
    return rows


AUTOPAR = "mist_autopar"


def replan(points: list[str] | None, time_limit: float = 300.0) -> None:
    """Plan autopar's side of ``points`` (default: every point of the saved sweeps) on this tree, as the sweeps
    did (bf16, ``offload="auto"``, ILP time limit ``time_limit``), each written to ``AUTOPAR`` when done."""
    import autopar

    saved = load(AUTOPAR)
    todo = points or sorted(set(load(*MIST_SWEEPS, *FULL_SWEEPS)) | set(saved), key=point_order)
    options = {"time_limit": time_limit, "offload": "auto"}
    for point in todo:
        family, name, gpus, preset = point.split(":")
        work = vs_megatron.build_workload(family, name, "bf16", preset, int(gpus))
        step, plan, seconds = vs_megatron.plan_autopar(work, autopar.Cluster.preset(preset, gpus=int(gpus)), "bf16",
                                                       options)
        saved[point] = {"point": point, "auto_step": step, "auto_plan": plan, "plan_s": seconds,
                        "autopar_options": options, "replanned": report.machine_line("re-planned")}
        print(f"{point}: {step} s, {plan} ({seconds:.0f} s)", flush=True)
        report.write_results(AUTOPAR, "\n".join(f"{p}: {r['auto_step']} s, {r['auto_plan']}" for p, r in
                                                 saved.items()), sorted(saved.values(), key=lambda r: point_order(
                                                     r["point"])))


def with_replanned(rows: dict[str, dict], replanned: dict[str, dict]) -> dict[str, dict]:
    """The sweep's rows with autopar's side (step, plan, options) taken from ``replanned`` where it has the point."""
    keys = ("auto_step", "auto_plan", "autopar_options", "replanned")
    return {p: {**r, **{k: replanned[p][k] for k in keys if k in replanned[p]}} if p in replanned else r
            for p, r in rows.items()}


def compact(plan: str) -> str:
    """'..., optimizer offloaded (stages 0,1,...,15)' as '(every stage)' where those are all the plan's stages
    (rows written before ``describe_plan`` said so itself)."""
    stages = sum(int(n) for n in re.findall(r"(?:^|\+ )(\d+) ×", plan))
    every = ",".join(str(i) for i in range(stages))
    return plan.replace(f"(stages {every})", "(every stage)") if stages else plan


def ratio(row: dict | None) -> float | None:
    if not row or row.get("hand_step") is None or row.get("auto_step") is None:
        return None
    return row["hand_step"] / row["auto_step"]


def geomean(values: list[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def point_order(point: str) -> tuple:
    """GPT-3 before Llama-style, L4 before A100, then by GPUs."""
    family, _, gpus, cluster = point.split(":")
    return family, cluster != "l4", int(gpus)


def scores(mist: dict[str, dict], full: dict[str, dict]) -> dict:
    """Per-grid ratios, the means the goals name, and whether each goal is met."""
    points = sorted(set(mist) | set(full), key=point_order)
    mist_r = {p: ratio(mist.get(p)) for p in points}
    full_r = {p: ratio(full.get(p)) for p in points}
    binds = [p for p in points if full.get(p, {}).get("memory_binds")]
    out = {"points": points, "mist": mist_r, "full": full_r, "binds": binds}
    mist_vals = [r for r in mist_r.values() if r is not None]
    full_vals = [r for r in full_r.values() if r is not None]
    out["mist_geomean"], out["mist_min"] = geomean(mist_vals), min(mist_vals, default=None)
    out["full_geomean_binds"] = geomean([full_r[p] for p in binds if full_r[p] is not None])
    out["full_geomean_all"], out["full_min"] = geomean(full_vals), min(full_vals, default=None)
    return out


def verdict(value: float | None, goal: float) -> str:
    if value is None:
        return "n/a (no point scored)"
    met = value >= goal - 1e-12
    shown = f"{value:.3f}" if met or f"{value:.3f}" != f"{goal:.3f}" else f"{value:.5f}"  # a miss never shows the goal
    return f"{shown} (goal ≥ {goal:.2f}: {'met' if met else 'NOT met'})"


HEADERS = ["model", "GPUs", "cluster", "autopar plan", "Mist's Megatron: best", "autopar / it", "full grid: best",
           "autopar / it", "memory binds (full grid)", "ceiling (full grid)",
           "full grid: configs (OOM, skipped by floor) + memory ignored (skipped)", "full grid s (CPU s, load)"]


def rows(mist: dict, full: dict, s: dict) -> list[list]:
    out = []
    for p in s["points"]:
        m, f = mist.get(p, {}), full.get(p, {})
        family, name, gpus, cluster = p.split(":")
        fmt = lambda r: f"{r:.3f}" if r is not None else "n/a"  # noqa: E731
        ceiling = f"{f['ceiling']:.3f}" if f.get("ceiling") is not None else "n/a"
        out.append([f"{FAMILIES.get(family, family)} {name}", gpus, cluster, compact((f or m).get("auto_plan", "n/a")),
                    m.get("hand", "not run") + _older(m),
                    fmt(s["mist"][p]), f.get("hand", "not run") + _older(f), fmt(s["full"][p]),
                    "yes" if f.get("memory_binds") else ("no" if f else "n/a"), ceiling,
                    vs_megatron.configs_cell(f) if f else "n/a", vs_megatron.grid_cell(f) if f else "n/a"])
    return out


def _older(row: dict) -> str:
    """' *' on a row of a sweep outside ``current`` (scored by an older tree, both sides alike)."""
    return " *" if row and not row.get("current", True) else ""


def summary(s: dict) -> str:
    return "\n".join([
        f"- vs Mist's Megatron baseline, {sum(r is not None for r in s['mist'].values())} points: geometric mean "
        f"{verdict(s['mist_geomean'], GOALS['mist']['geomean'])}; min {verdict(s['mist_min'], GOALS['mist']['min'])}",
        f"- vs the full grid, {sum(r is not None for r in s['full'].values())} points: min "
        f"{verdict(s['full_min'], GOALS['full']['min'])}; geometric mean where memory binds ({len(s['binds'])} points) "
        f"{verdict(s['full_geomean_binds'], GOALS['full']['geomean'])}; over all points "
        f"{s['full_geomean_all']:.3f}" if s["full_geomean_all"] else "- vs the full grid: no point scored"])


def chart(s: dict) -> str:
    plt = report._pyplot()
    labels = [p.split(":", 1)[1] for p in s["points"]]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels) + 2), 4.5))
    xs = range(len(labels))
    for shift, key, label, color in ((-0.2, "mist", "vs Mist's Megatron baseline", "#1f77b4"),
                                     (0.2, "full", "vs the full hand grid (+ SP)", "#ff7f0e")):
        ax.bar([x + shift for x in xs], [s[key][p] or 0 for p in s["points"]], width=0.4, label=label, color=color)
    ax.axhline(1.28, color="#1f77b4", linestyle="--", linewidth=1)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks(list(xs), labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("autopar / best hand layout (throughput)")
    ax.set_title("Mist's points, simulated (autopar's cost model, bf16)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return report._save(fig, plt, "mist")


# Both grids scored on one tree (vs_megatron.py --simulate --suite mist --hand-only, the full grid in two parts
# side by side), the tree autopar's side is re-planned on; mist_*_onetree* are an earlier tree's, and the sweeps
# before them (mist_mist, mist_full, mist_full_b ... _g) mixed trees.
MIST_SWEEPS = ("mist_mist_final",)
FULL_SWEEPS = ("mist_full_final_a", "mist_full_final_b")


CURRENT = MIST_SWEEPS + FULL_SWEEPS  # hand grids scored on the tree autopar's side is re-planned on


def merged(names: tuple, current: tuple, replanned: dict[str, dict]) -> dict[str, dict]:
    """The sweeps' rows (a later name's point replacing an earlier's), autopar's side re-planned (``replanned``)
    only in the ``current`` sweeps: those whose hand grids this tree's cost model scored the same, so the two
    sides of a row stay priced alike."""
    rows = {}
    for name in names:
        found = load(name)
        tagged = {p: {**r, "current": name in current} for p, r in found.items()}
        rows.update(with_replanned(tagged, replanned) if name in current else tagged)
    return rows


def render(mist_names: tuple = MIST_SWEEPS, full_names: tuple = FULL_SWEEPS, current: tuple = CURRENT) -> str:
    replanned = load(AUTOPAR)
    mist, full = merged(mist_names, current, replanned), merged(full_names, current, replanned)
    s = scores(mist, full)
    present = _present(mist_names + full_names)
    files = ", ".join(f"vs_megatron_{n}.json" for n in mist_names + full_names if n in present)
    if replanned:
        files += (f"; autopar's side of the rows of {', '.join(n for n in current if n in present)} re-planned: "
                  f"vs_megatron_{AUTOPAR}.json ({_replan_times(replanned)})")
    headers = [r.get("autopar_options") for r in list(mist.values()) + list(full.values())][:1]
    trees = sorted({r["tree"] for r in list(mist.values()) + list(full.values()) if r.get("tree")})
    if trees:
        files += f"; hand grids scored on tree {', '.join(trees)}"
    text = "\n\n".join([report.machine_line("autopar on Mist's points (Zhu et al., EuroSys'25), simulated: "
                                            "both hand grids; rendered from the two sweeps' JSON"),
                        report.markdown_table(HEADERS, rows(mist, full, s)), summary(s),
                        f"autopar options: {headers[0] if headers else 'n/a'}. Rows: {files} (every scored hand "
                        "config). Ceiling: best full-grid layout that fits / fastest full-grid layout with memory "
                        "ignored. * a row of a sweep outside --current: scored by an older tree (its two sides "
                        "priced alike by that tree's cost model, not by this one's)."])
    path = report.write_results("mist", text)
    if s["points"]:
        chart(s)
    print(text)
    return path


def _replan_times(replanned: dict[str, dict]) -> str:
    """'re-planned 2026-11-26 21:52 to 2026-11-27 01:00, ...': the span of the points' re-planning times (each on
    the tree of its time: the ``replanned`` field of each point says when)."""
    stamp = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d")
    times = sorted(m.group(0) for row in replanned.values() if (m := stamp.search(row["replanned"])))
    if not times:
        return next(iter(replanned.values()))["replanned"].lstrip("# ")
    return (f"{len(replanned)} points re-planned {times[0]} to {times[-1]}, each on the tree of its time (its "
            "'replanned' field)")


def _present(names: tuple) -> set[str]:
    return {n for n in names if os.path.exists(os.path.join(report.RESULTS, f"vs_megatron_{n}.json"))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mist", nargs="+", default=list(MIST_SWEEPS), help="NAMEs of vs_megatron_NAME.json: Mist's "
                        "baseline sweeps")
    parser.add_argument("--full", nargs="+", default=list(FULL_SWEEPS), help="NAMEs of vs_megatron_NAME.json: "
                        "the full-grid sweeps (a later one's point replaces an earlier's)")
    parser.add_argument("--current", nargs="*", default=list(CURRENT), help="NAMEs of the sweeps whose hand grids "
                        "were scored under this tree's cost model: only their rows take the re-planned autopar side")
    parser.add_argument("--replan", action="store_true", help="plan autopar's side again on this tree first "
                        f"(vs_megatron_{AUTOPAR}.json)")
    parser.add_argument("--points", nargs="+", help="--replan: only these FAMILY:NAME:GPUS:PRESET points")
    args = parser.parse_args(argv)
    if args.replan:
        replan(args.points)
    render(tuple(args.mist), tuple(args.full), tuple(args.current))
    return 0


if __name__ == "__main__":
    sys.exit(main())
