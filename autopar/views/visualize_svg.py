"""Inline SVG pictures for the HTML plan report: the device mesh, bar charts, the pipeline schedule, sharding strips.

Why hand-written SVG and not matplotlib: the report must be one self-contained file that opens offline and
stays small and sharp at any zoom; matplotlib would need base64 PNGs (blurry, large) or its SVG backend
(hundreds of KiB of paths per figure, no per-element tooltips). Every element here carries a <title>
tooltip, and colors come from CSS classes defined in ``visualize_template`` (one legend for all pictures).
Every function returns a complete ``<svg>`` element as text; all user strings are HTML-escaped.
"""
from __future__ import annotations

from html import escape

from autopar.ir.units import fmt_bytes, fmt_seconds

# Tableau 10: distinguishable, colour-blind-aware; stage i gets STAGE_COLORS[i % 10].
STAGE_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
                "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"]


def stage_color(index: int) -> str:
    return STAGE_COLORS[index % len(STAGE_COLORS)]


def _svg(width: float, height: float, body: list[str], label: str) -> str:
    return (f'<svg class="chart" width="{width:.0f}" height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" '
            f'role="img" aria-label="{escape(label)}">' + "".join(body) + "</svg>")


def _rect(x, y, w, h, tip: str, fill: str | None = None, cls: str | None = None) -> str:
    style = f' fill="{fill}"' if fill else ""
    klass = f' class="{cls}"' if cls else ""
    return (f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.5):.1f}" height="{h:.1f}"{style}{klass}>'
            f'<title>{escape(tip)}</title></rect>')


def _text(x, y, s: str, cls: str = "", anchor: str = "start") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" class="{cls}" text-anchor="{anchor}">{escape(s)}</text>'


def mesh_svg(nodes: int, devices_per_node: int, rank_info: dict[int, tuple[int, str]]) -> str:
    """The cluster as a grid (one row per node, one cell per device), each device filled with its stage's color.

    rank_info[rank] = (stage index, tooltip); ranks absent from it are drawn grey. Rank r sits on node
    r // devices_per_node, device r % devices_per_node (the launcher's global rank order).
    """
    cell = max(6, min(44, 640 // max(devices_per_node, 1), 560 // max(nodes, 1)))
    left, top = 64, 18
    body = [_text(left + i * cell + cell / 2, 12, str(i), "axis", "middle")
            for i in range(devices_per_node) if cell >= 16]
    for n in range(nodes):
        if cell >= 12 or n % 8 == 0:
            body.append(_text(left - 6, top + n * cell + cell * 0.65, f"node {n}", "axis", "end"))
        for d in range(devices_per_node):
            rank = n * devices_per_node + d
            stage, tip = rank_info.get(rank, (None, f"rank {rank}: in no stage"))
            fill = stage_color(stage) if stage is not None else "#dddddd"
            body.append(_rect(left + d * cell + 1, top + n * cell + 1, cell - 2, cell - 2, tip, fill=fill))
            if cell >= 22:
                body.append(_text(left + d * cell + cell / 2, top + n * cell + cell * 0.62, str(rank), "cell",
                                  "middle"))
    return _svg(left + devices_per_node * cell + 8, top + nodes * cell + 6, body, "device mesh by stage")


def bar_rows_svg(rows: list[tuple[str, list[tuple[str, float, str]]]], fmt, limit: float | None = None,
                 limit_label: str = "", width: int = 560) -> str:
    """Horizontal stacked bars: rows of (label, [(segment name, value, colour)]); optional dashed limit line.

    The scale is the largest of the row totals and the limit, so a bar past the limit is visibly past it.
    """
    label_w, bar_w, row_h = 120, width - 220, 22
    scale = max([sum(v for _, v, _ in segs) for _, segs in rows] + [limit or 0.0, 1e-30])
    body = []
    for r, (label, segs) in enumerate(rows):
        y, x = 4 + r * row_h, float(label_w)
        body.append(_text(label_w - 6, y + 14, label, "axis", "end"))
        for name, value, color in segs:
            w = bar_w * value / scale
            body.append(_rect(x, y + 2, w, row_h - 6, f"{label}: {name} {fmt(value)}", fill=color))
            x += w
        body.append(_text(x + 5, y + 14, fmt(sum(v for _, v, _ in segs)), "value"))
    if limit:
        lx = label_w + bar_w * limit / scale
        body.append(f'<line x1="{lx:.1f}" x2="{lx:.1f}" y1="0" y2="{4 + len(rows) * row_h}" class="limit"/>')
        body.append(_text(lx, 12 + len(rows) * row_h, f"{limit_label} {fmt(limit)}", "axis", "middle"))
    return _svg(width, 18 + len(rows) * row_h, body, "bar chart")


def seconds_bars(rows, **kw) -> str:
    return bar_rows_svg(rows, fmt_seconds, **kw)


def bytes_bars(rows, **kw) -> str:
    return bar_rows_svg(rows, fmt_bytes, **kw)


def _time_ticks(total: float, x0: float, width: float, y: float) -> list[str]:
    out = []
    for k in range(6):
        t = total * k / 5
        x = x0 + width * k / 5
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="0" y2="{y:.1f}" class="grid"/>')
        out.append(_text(x, y + 12, fmt_seconds(t), "axis", "middle"))
    return out


def schedule_svg(ops, stage_labels: list[str], width: int = 1180) -> str:
    """Gantt chart of ScheduledOps: one row per stage, forwards light, backwards dark, per-step ops grey.

    ops: (stage, microbatch, kind, start, end) tuples as ``autopar.ir.schedule.simulate_schedule`` returns.
    """
    label_w, row_h = 130, 26
    plot_w = width - label_w - 20
    total = max([op.end for op in ops] + [1e-30])
    body = _time_ticks(total, label_w, plot_w, len(stage_labels) * row_h + 4)
    for s, label in enumerate(stage_labels):
        body.append(_text(label_w - 6, s * row_h + 17, label, "axis", "end"))
    for op in ops:
        x = label_w + plot_w * op.start / total
        w = plot_w * (op.end - op.start) / total
        name = f"{op.kind}{op.microbatch}" if op.microbatch >= 0 else op.kind
        cls = {"F": "fwd", "B": "bwd"}.get(op.kind, "step")
        tip = f"stage {op.stage} {name}: {fmt_seconds(op.start)} → {fmt_seconds(op.end)}"
        body.append(_rect(x, op.stage * row_h + 3, w, row_h - 6, tip, fill=stage_color(op.stage), cls=cls))
        if w >= 8 * len(name) + 4:
            body.append(_text(x + w / 2, op.stage * row_h + 18, name, "cell", "middle"))
    return _svg(width, len(stage_labels) * row_h + 22, body, "pipeline schedule")


def sharding_strip_svg(rows: list[tuple[str, list[tuple[str, list[tuple[str, str]]]]]], n_axes: int,
                       per_line: int = 120) -> str:
    """The ops of a stage against its mesh axes, one strip per layer group.

    rows: (group label, [(tooltip, [(css class, placement label) per mesh axis])] per op). Each op is a
    thin column with one cell per mesh axis (axis 0 on top); groups longer than ``per_line`` ops wrap.
    """
    widest = max((len(o) for _, o in rows), default=1)
    label_w, cell_w, cell_h = 200, (12 if widest <= 60 else 7), (12 if widest <= 60 else 9)
    body, y = [], 2
    for t in range(n_axes):
        body.append(_text(label_w - 6, y + cell_h * (t + 1) - 1, f"axis {t}", "tiny", "end"))
    y += n_axes * cell_h + 4
    for label, ops in rows:
        for lo in range(0, max(len(ops), 1), per_line):
            if lo == 0:
                short = label if len(label) <= 32 else label[:31] + "…"
                body.append(_text(label_w - 6, y + cell_h * n_axes / 2 + 4, short, "axis", "end"))
            for k, (tip, cells) in enumerate(ops[lo:lo + per_line]):
                for t, (cls, text) in enumerate(cells):
                    body.append(_rect(label_w + k * cell_w, y + t * cell_h, cell_w - 1, cell_h - 1,
                                      f"{tip} · axis {t}: {text}", cls=cls))
            y += n_axes * cell_h + 6
    width = label_w + min(per_line, widest) * cell_w + 10
    return _svg(max(width, 320), y + 2, body, "sharding by layer and mesh axis")
