"""Output of ``benchmarks/vs_megatron.py``: a markdown table, a PNG chart and the one-line summary.

Everything is written under ``benchmarks/results/``: ``vs_megatron_<mode>.md`` (the table with a header
line naming the date, the machine, torch and the load average, ready to paste into the README),
``vs_megatron_<mode>.png`` (matplotlib, Agg backend) and, for the simulation, ``vs_megatron_<mode>.json``
(every scored hand configuration, so a surprising row can be checked).
"""
from __future__ import annotations

import json
import math
import os
import platform
import time

import torch

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


def describe_plan(plan) -> str:
    """'8 × 1x8 (mesh 2x4), B=512': runs of equal stages (interleaved: chunks), their submesh and logical
    mesh, microbatches, ', interleaved v=2' when the device groups hold several chunks each, and what the plan
    offloads to host memory (``plan.planner["offload"]``)."""
    runs: list[list] = []
    for s in plan.stages:
        key = (tuple(s.submesh), tuple(s.mesh_shape))
        if runs and runs[-1][0] == key:
            runs[-1][1] += 1
        else:
            runs.append([key, 1])
    parts = [f"{n} × {a[0]}x{a[1]} (mesh {m[0]}x{m[1]})" for ((a, m), n) in runs]
    v = getattr(plan, "virtual_stages", 1)
    moved = plan.planner.get("offload", {}) if isinstance(getattr(plan, "planner", None), dict) else {}
    every = list(range(len(plan.stages)))
    where = lambda stages: "every stage" if stages == every else "stages " + ",".join(map(str, stages))  # noqa: E731
    offload = "".join(f", {kind} offloaded ({where(stages)})" for kind, stages in moved.items())
    return " + ".join(parts) + f", B={plan.microbatches}" + (f", interleaved v={v}" if v > 1 else "") + offload


def machine_line(title: str) -> str:
    """'# title — date, machine, cores, torch, load average' (the context every measured figure needs)."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"# {title} — {time.strftime('%Y-%m-%d %H:%M')}, {platform.node() or 'host'} ({platform.machine()}, "
            f"{os.cpu_count()} cores), torch {torch.__version__}, load average {load}")


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(mode: str, text: str, data=None) -> str:
    """Write the markdown (and the JSON data, if any) for ``mode``; returns the markdown path."""
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"vs_megatron_{mode}.md")
    with open(path, "w") as f:
        f.write(text + "\n")
    if data is not None:
        with open(os.path.join(RESULTS, f"vs_megatron_{mode}.json"), "w") as f:
            json.dump(data, f, indent=1, default=str)
    return path


def summary_line(ratios: list[tuple[str, float]], memory_bound: set[str] = frozenset()) -> str:
    """'min speedup vs hand: 1.03 (at <point>)' over (label, autopar/best-hand throughput ratio) pairs,
    then the geometric mean over the labels in ``memory_bound`` (points where memory shapes the layout)."""
    if not ratios:
        return "min speedup vs hand: n/a (no point had both a fitting hand layout and an autopar plan)"
    label, worst = min(ratios, key=lambda r: r[1])
    line = f"min speedup vs hand: {worst:.3f} (at {label})"
    bound = [r for lbl, r in ratios if lbl in memory_bound]
    if bound:
        geomean = math.exp(sum(math.log(r) for r in bound) / len(bound))
        line += f"; geometric mean where memory binds: {geomean:.3f} over {len(bound)} points"
    return line


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def throughput_chart(mode: str, labels: list[str], hand: list[float], auto: list[float], unit: str,
                     title: str) -> str:
    """Grouped bars (best hand vs autopar) per point, with autopar/hand above each pair; returns the path."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels) + 2), 4.5))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], hand, width=0.4, label="best hand layout", color="#8c8c8c")
    ax.bar([x + 0.2 for x in xs], auto, width=0.4, label="autopar", color="#1f77b4")
    for x, h, a in zip(xs, hand, auto):
        if h > 0 and a > 0:
            ax.annotate(f"{a / h:.2f}×", (x, max(h, a)), ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_xticks(list(xs), labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    return _save(fig, plt, mode)


def step_time_chart(mode: str, names: list[str], medians: list[float], spreads: list[tuple[float, float]],
                    title: str) -> str:
    """Horizontal bars of measured step times (autopar highlighted) with the quartile range; returns the path."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(names) + 1.5))
    colors = ["#1f77b4" if n.startswith("autopar") else "#8c8c8c" for n in names]
    err = [[m - lo for m, (lo, _) in zip(medians, spreads)], [hi - m for m, (_, hi) in zip(medians, spreads)]]
    ax.barh(names, [1e3 * m for m in medians], xerr=[[1e3 * e for e in err[0]], [1e3 * e for e in err[1]]],
            color=colors)
    ax.invert_yaxis()
    ax.set_xlabel("step time, ms (median, quartiles)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, plt, mode)


def _save(fig, plt, mode: str) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"vs_megatron_{mode}.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
