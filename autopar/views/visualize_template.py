"""The page around the plan report: inline CSS, a few lines of JS, and the legend. Nothing is fetched.

The placement classes (``pR``, ``pP``, ``pS0``…``pS3``, ``pSn``) colour both HTML cells (background) and
SVG rectangles (fill), so the tables, the strips and the legend agree. The JS only expands/collapses
``<details>`` and filters op rows; the page is fully readable without it.
"""
from __future__ import annotations

from html import escape

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#22313f;color:#fff;padding:14px 24px}
header h1{margin:0 0 4px;font-size:20px} header p{margin:2px 0;color:#d5dde5}
main{padding:8px 24px 40px}
section{background:#fff;border:1px solid #e3e3e3;border-radius:6px;margin:14px 0;padding:10px 16px}
h2{font-size:17px;margin:6px 0 8px} h3{font-size:15px;margin:12px 0 6px}
.row{display:flex;flex-wrap:wrap;gap:28px;align-items:flex-start}
table{border-collapse:collapse;font-size:12.5px;margin:4px 0}
th,td{border-bottom:1px solid #eee;padding:2px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3;font-weight:600} td.num{text-align:right;font-variant-numeric:tabular-nums}
code,td.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
details{margin:3px 0} summary{cursor:pointer;padding:2px 0} summary .meta{color:#666;font-weight:normal}
.chip{display:inline-block;min-width:34px;padding:0 5px;border-radius:3px;text-align:center;
 font-family:ui-monospace,monospace;font-size:11.5px;color:#fff}
.pR{background:#d4d4d4;fill:#d4d4d4;color:#333} .pP{background:#f28e2b;fill:#f28e2b}
.pS0{background:#4e79a7;fill:#4e79a7} .pS1{background:#59a14f;fill:#59a14f}
.pS2{background:#b07aa1;fill:#b07aa1} .pS3{background:#76b7b2;fill:#76b7b2}
.pSn{background:#9c755f;fill:#9c755f} .pX{background:#e15759;fill:#e15759}
.stage-dot{display:inline-block;width:12px;height:12px;border-radius:2px;vertical-align:-1px;margin-right:4px}
svg.chart text{font-size:11px;fill:#333} svg.chart text.cell{fill:#fff;font-size:10.5px}
svg.chart text.tiny{font-size:9px;fill:#666} svg.chart text.value{fill:#444}
svg.chart .grid{stroke:#e6e6e6} svg.chart .limit{stroke:#c00;stroke-dasharray:4 3}
svg.chart .fwd{opacity:.55} svg.chart .step{fill:#777}
.muted{color:#777} .warn{color:#b00;font-weight:600} .toolbar{margin:6px 0}
.toolbar button,.toolbar input{font:inherit;margin-right:6px}
tr.hidden{display:none}
"""

JS = """
function setAll(open){document.querySelectorAll('details.group').forEach(d=>d.open=open);}
function filterOps(q){q=q.trim().toLowerCase();
 document.querySelectorAll('details.group').forEach(d=>{let hit=0;
  d.querySelectorAll('tr[data-name]').forEach(tr=>{const ok=!q||tr.dataset.name.includes(q);
   tr.classList.toggle('hidden',!ok);hit+=ok;});
  if(q)d.open=hit>0;});}
"""

LEGEND_ITEMS = [("pR", "R", "Replicate: full copy on every device of the axis"),
                ("pS0", "S(0)", "Shard(0): tensor dim 0 split over the axis"),
                ("pS1", "S(1)", "Shard(1)"), ("pS2", "S(2)", "Shard(2)"), ("pS3", "S(3)", "Shard(3)"),
                ("pSn", "S(4+)", "Shard of a later dim"),
                ("pP", "P", "Partial: one summand per device (a reduction is pending)")]


def legend_html() -> str:
    """The placement colour key, shown once near the top of the page."""
    items = "".join(f'<span class="chip {cls}" title="{escape(tip)}">{escape(label)}</span> '
                    for cls, label, tip in LEGEND_ITEMS)
    return f'<p>Placement per mesh axis: {items}<span class="muted">(hover a cell for details)</span></p>'


def toolbar_html() -> str:
    return ('<div class="toolbar"><button type="button" onclick="setAll(true)">expand all</button>'
            '<button type="button" onclick="setAll(false)">collapse all</button>'
            '<input type="search" placeholder="filter ops by name…" oninput="filterOps(this.value)"></div>')


def page(title: str, header_lines: list[str], sections: list[str]) -> str:
    """The whole document: header lines are already-escaped HTML fragments, sections complete elements."""
    head = "".join(f"<p>{line}</p>" for line in header_lines)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width\"><title>{escape(title)}</title>"
            f"<style>{CSS}</style></head><body><header><h1>{escape(title)}</h1>{head}</header><main>"
            + "\n".join(sections) + f"</main><script>{JS}</script></body></html>\n")
