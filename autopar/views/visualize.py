"""``plan_to_html(plan)``: a self-contained HTML picture of a Plan (inline CSS, JS and SVG; nothing fetched).

The page, top to bottom: the device mesh coloured by pipeline stage with each stage's submesh; the cost
breakdown (step time, per-stage latency, memory per device against the budget); the pipeline schedule as
simulated by ``autopar.views.trace`` (after the stages when there is only one); the mixture-of-experts
layers' token dispatch (``autopar.views.moe``, after the overview, when the model has any); one section per stage
("stage 0", "stage 1", ...) with its ops against its mesh axes (colour = Replicate / Shard(d) / Partial),
grouped by layer (repeated-block instance), later instances with identical shardings folded into the first;
its parameters folded by name pattern; and every inserted collective with its bytes, at the op receiving it.

Optional Plan fields (microbatches, schedule, stage.layers, stage.predicted["forward"/"backward"/
"grad_sync"], cross-stage transfers) are read with defaults, so single-stage and pipelined plans both render.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from html import escape

from autopar.ir.units import fmt_bytes, fmt_seconds
from autopar.placement import parse_spec
from autopar.views import trace
from autopar.views.moe import moe_html
from autopar.views.report import recompute_text
from autopar.views.visualize_groups import OpGroup, compress_ranges, group_ops, group_placeholders, short_op
from autopar.views.visualize_svg import (
    bytes_bars,
    mesh_svg,
    schedule_svg,
    seconds_bars,
    sharding_strip_svg,
    stage_color,
)
from autopar.views.visualize_template import legend_html, page, toolbar_html

COMPUTE, COMM, BUBBLE, GRAD_SYNC, OPTIMIZER = "#4e79a7", "#f28e2b", "#bab0ac", "#9c755f", "#b07aa1"
MEMORY, TRANSIENT = "#59a14f", "#a0cf97"
_TIME_KEYS = ("latency", "forward", "backward", "compute", "comm", "grad_sync")
_BYTE_WORDS = ("memory", "bytes")


def plan_to_html(plan) -> str:
    """The whole report as one HTML document (see the module docstring)."""
    stages = [_stage_section(plan, stage) for stage in plan.stages]
    schedule = [_schedule_section(plan)]
    # A pipeline's schedule is its headline; one stage's (F then B) matters less than its shardings.
    sections = [_overview_section(plan)] + (schedule + stages if len(plan.stages) > 1 else stages + schedule)
    moe = moe_html(plan)  # which MoE layers dispatch by all-to-all, when the model has any
    sections[1:1] = [moe] if moe else []
    return page(f"autopar plan: {plan.model} on {plan.cluster.get('name', '?')}", _header_lines(plan), sections)


def write_html(plan, path) -> None:
    """Write ``plan_to_html(plan)`` to ``path`` (UTF-8)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(plan_to_html(plan))


# ---- small formatting helpers (no Plan needed) ----------------------------------------------------

def placement_cells(spec: str, n_axes: int) -> list[tuple[str, str]]:
    """One (css class, label) per mesh axis for a spec text like "S(0)R"; unparsable text is flagged pX."""
    try:
        placements = parse_spec(spec)
    except ValueError:
        return [("pX", spec)] * n_axes
    cells = []
    for p in placements:
        if p.is_partial():
            cells.append(("pP", "P"))
        elif p.is_replicate():
            cells.append(("pR", "R"))
        else:
            cells.append((f"pS{p.dim}" if p.dim < 4 else "pSn", f"S({p.dim})"))
    return cells + [("pX", "?")] * (n_axes - len(cells))


def chips(spec: str, n_axes: int) -> str:
    return "".join(f'<span class="chip {cls}" title="axis {t}: {escape(label)}">{escape(label)}</span> '
                   for t, (cls, label) in enumerate(placement_cells(spec, n_axes)))


def fmt_value(key: str, value) -> str:
    """Seconds or bytes by the key's name (keys mentioning memory/bytes are bytes); other values as text."""
    if not isinstance(value, (int, float)):
        return escape(str(value))
    return fmt_bytes(value) if any(w in key for w in _BYTE_WORDS) else fmt_seconds(value)


def ordered_items(values: dict) -> list[tuple[str, object]]:
    """Known cost keys first in a fixed order, then the rest sorted: the page must not depend on dict order
    (a plan reloaded from its sorted-key JSON renders byte-identically)."""
    known = [k for k in _TIME_KEYS + ("memory", "peak_memory") if k in values]
    return [(k, values[k]) for k in known + sorted(set(values) - set(known))]


def table(headers: list[str], rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    """An HTML table of already-escaped cells; columns in ``numeric`` are right-aligned."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f'<td{" class=num" if i in numeric else ""}>{c}</td>'
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


# ---- header and overview ----------------------------------------------------------------------------

def _header_lines(plan) -> list[str]:
    c = plan.cluster
    lines = [escape(f"{plan.num_devices} devices ({c.get('nodes', '?')} node(s) × {c.get('devices_per_node', '?')}), "
                    f"{len(plan.stages)} stage(s), {getattr(plan, 'microbatches', 1)} microbatch(es), schedule "
                    f"{getattr(plan, 'schedule', 'none')}, optimizer {getattr(plan, 'optimizer', '?')}")]
    q = plan.planner or {}
    if q:
        lines.append(escape(f"planner: {q.get('ilp_variables', '?')} ILP variables, {q.get('ilp_status', '?')} "
                            f"({q.get('solver', '?')})"))
    if c.get("source"):
        lines.append(escape(f"cluster figures: {c['source']}"))
    return lines


def _overview_section(plan) -> str:
    c = plan.cluster
    info = {}
    for stage in plan.stages:
        m1 = stage.mesh_shape[1] if len(stage.mesh_shape) > 1 else 1
        for k, r in enumerate(stage.ranks):
            info[r] = (stage.index, f"rank {r} · stage {stage.index} · mesh coordinate ({k // m1}, {k % m1}) "
                                    f"of {stage.mesh_shape[0]}×{m1}")
    mesh = mesh_svg(int(c.get("nodes", 1)), int(c.get("devices_per_node", plan.num_devices)), info)
    left = f"<div><h3>Devices by stage</h3>{mesh}{_stage_legend(plan)}</div>"
    right = f"<div><h3>Predicted cost</h3>{_cost_charts(plan)}</div>"
    return f'<section id="overview"><h2>Overview</h2>{legend_html()}<div class="row">{left}{right}</div></section>'


def _stage_legend(plan) -> str:
    rows = []
    for s in plan.stages:
        p = s.predicted or {}
        layers = f"{s.layers[0]}–{s.layers[1]}" if s.layers else "all"
        rows.append([f'<span class="stage-dot" style="background:{stage_color(s.index)}"></span>'
                     f'<a href="#stage-{s.index}">stage {s.index}</a>', escape(compress_ranges(s.ranks)),
                     f"{s.mesh_shape[0]}×{s.mesh_shape[1]}", f"{s.submesh[0]}×{s.submesh[1]}", layers,
                     escape(recompute_text(s)), fmt_seconds(p.get("latency", 0)), fmt_bytes(p.get("peak_memory", 0))])
    return table(["stage", "ranks", "mesh", "submesh", "layers", "recompute", "latency", "peak memory"], rows, {6, 7})


def _swatches(items: list[tuple[str, str]]) -> str:
    return "<p>" + " ".join(f'<span class="stage-dot" style="background:{color}"></span>{escape(name)}'
                            for name, color in items) + "</p>"


def _cost_charts(plan) -> str:
    p, parts = plan.predicted or {}, [_swatches([("compute", COMPUTE), ("communication", COMM),
                                                 ("pipeline bubble", BUBBLE), ("grad sync", GRAD_SYNC),
                                                 ("optimizer step", OPTIMIZER)])]
    if p:
        parts.append(f"<p>step time <b>{fmt_seconds(p.get('step_time', 0))}</b>; peak memory per device "
                     f"<b>{fmt_bytes(p.get('peak_memory', 0))}</b></p>")
        parts.append(seconds_bars([("step", _step_parts(plan))]))
    rows = [(f"stage {s.index}", [("compute", (s.predicted or {}).get("compute", 0), COMPUTE),
                                  ("communication", (s.predicted or {}).get("comm", 0), COMM),
                                  ("grad sync", (s.predicted or {}).get("grad_sync", 0), GRAD_SYNC)])
            for s in plan.stages]
    parts.append("<h3>Stage latency</h3>" + seconds_bars(rows))
    budget = float(plan.cluster.get("memory_per_device", 0)) or None
    mem_rows = []
    for s in plan.stages:
        q = s.predicted or {}
        steady = float(q.get("memory", 0))
        mem_rows.append((f"stage {s.index}", [("training state + activations", steady, MEMORY),
                                              ("transient peak", max(0.0, float(q.get("peak_memory", steady)) - steady),
                                               TRANSIENT)]))
    parts.append("<h3>Memory per device</h3>" + _swatches([("training state + activations", MEMORY),
                                                            ("transient peak", TRANSIENT)])
                 + bytes_bars(mem_rows, limit=budget, limit_label="budget"))
    over = [s.index for s in plan.stages if budget and (s.predicted or {}).get("peak_memory", 0) > budget]
    if over:
        parts.append(f'<p class="warn">stage(s) {over} exceed the per-device memory budget</p>')
    return "".join(parts)


def _step_parts(plan) -> list[tuple[str, float, str]]:
    """The step time split so that the parts add up to it: step = busiest stage's work + bubble + grad
    sync + optimizer step, the busiest stage's work split between compute and communication in that
    stage's proportion.
    (``plan.predicted``'s compute and comm are sums over stages, device-time rather than wall time.)"""
    p = plan.predicted
    sync, bubble, optimizer = (float(p.get(k, 0)) for k in ("grad_sync", "bubble", "optimizer"))
    work = max(0.0, float(p.get("step_time", 0)) - sync - bubble - optimizer)
    busiest = max(plan.stages, key=lambda s: sum((s.predicted or {}).get(k, 0) for k in ("forward", "backward")),
                  default=None)
    q = (busiest.predicted or {}) if busiest is not None else {}
    total = float(q.get("compute", 0)) + float(q.get("comm", 0))
    share = float(q.get("compute", 0)) / total if total > 0 else 1.0
    return [("compute", work * share, COMPUTE), ("communication", work * (1 - share), COMM),
            ("pipeline bubble", bubble, BUBBLE), ("grad sync", sync, GRAD_SYNC),
            ("optimizer step", optimizer, OPTIMIZER)]


# ---- schedule -------------------------------------------------------------------------------------

def _schedule_section(plan) -> str:
    ops = trace.simulate_plan(plan)
    steps = trace.grad_sync_events(plan, ops)
    labels = [f"stage {s.index}" for s in plan.stages]
    fb = "; ".join(f"stage {s.index}: F {fmt_seconds(f)}, B {fmt_seconds(b)}"
                   for s, (f, b) in zip(plan.stages, map(trace.stage_times, plan.stages)))
    estimated = "" if all("forward" in (s.predicted or {}) for s in plan.stages) else \
        " (forward/backward split 1:2 from each stage's latency: the plan does not record them)"
    text = (f"<p>schedule <b>{escape(str(plan.schedule))}</b>, {plan.microbatches} microbatch(es); simulated step "
            f"{fmt_seconds(max(op.end for op in ops + steps))}, idle fraction (bubble and imbalance, mean over "
            f"stages) "
            f"{trace.bubble_fraction(ops, len(plan.stages)):.1%}. Per microbatch: {escape(fb)}{escape(estimated)}. "
            f"Export it for Perfetto with <code>autopar show plan.json --trace trace.json</code>.</p>")
    return (f'<section id="schedule"><h2>Pipeline schedule</h2>{text}{schedule_svg(ops + steps, labels)}'
            f"{_transfers_html(plan)}</section>")


def _transfers_html(plan) -> str:
    """Cross-stage transfers, if the plan records them (attribute names vary while pipelining lands)."""
    for name in ("transfers", "cross_stage", "cross_stage_transfers"):
        items = getattr(plan, name, None)
        if items:
            break
    else:
        return ""
    rows = [item if isinstance(item, dict) else vars(item) for item in items]
    keys = sorted({k for r in rows for k in r})
    cells = [[fmt_value(k, r[k]) if k in ("nbytes", "bytes", "seconds") and k in r else escape(str(r.get(k, "")))
              for k in keys] for r in rows]
    return "<h3>Cross-stage transfers</h3>" + table(keys, cells)


# ---- one stage ------------------------------------------------------------------------------------

def _split_nodes(plan, stage) -> tuple[list[str], list[str]]:
    """(ops, placeholders) of a stage in graph order; the output node is neither."""
    ops, holders = [], []
    for name in stage.nodes:
        s = stage.shardings[name]
        is_op = name in plan.node_ops if plan.node_ops else bool(s.ins) and name != "output"
        if is_op:
            ops.append(name)
        elif not s.ins:
            holders.append(name)
    return ops, holders


def _stage_section(plan, stage) -> str:
    n_axes = len(stage.mesh_shape)
    ops, holders = _split_nodes(plan, stage)
    sharding = stage.shardings
    groups = group_ops(ops, plan.repeated_blocks or {}, lambda n: (plan.node_ops.get(n), sharding[n]))
    incoming = defaultdict(list)
    for c in stage.collectives:
        incoming[c.dst].append(c)
    layers = f", layers {stage.layers[0]}–{stage.layers[1]}" if stage.layers else ""
    head = (f'<h2 id="stage-{stage.index}"><span class="stage-dot" style="background:{stage_color(stage.index)}">'
            f"</span>stage {stage.index}</h2><p>ranks {escape(compress_ranges(stage.ranks))}, mesh "
            f"{stage.mesh_shape[0]}×{stage.mesh_shape[1]} (axis 0 of {stage.mesh_shape[0]}, axis 1 of "
            f"{stage.mesh_shape[1]}) on submesh {stage.submesh[0]}×{stage.submesh[1]}{layers}; {len(ops)} ops, "
            f"{len(holders)} parameters and inputs, {len(stage.collectives)} collectives per microbatch</p>")
    items = ordered_items(stage.predicted or {})
    predicted = (table([k for k, _ in items], [[fmt_value(k, v) for k, v in items]], set(range(len(items))))
                 if items else "")
    strip = sharding_strip_svg([_strip_row(plan, stage, g, n_axes) for g in groups], n_axes)
    body = [head, predicted, "<h3>Ops against the mesh, by layer</h3>", strip, toolbar_html(),
            _placeholder_details(stage, holders, n_axes)]
    body += [_group_details(plan, stage, g, incoming, n_axes) for g in groups]
    body.append(_collective_summary(stage))
    return f'<section class="stage">{"".join(body)}</section>'


def _strip_row(plan, stage, group: OpGroup, n_axes: int):
    label = group.label + (f" (+{len(group.folded)} same)" if group.folded else "")
    ops = [(f"{n} · {short_op(plan.node_ops.get(n, ''))} · out {stage.shardings[n].out}",
            placement_cells(stage.shardings[n].out, n_axes)) for n in group.nodes]
    return label, ops


def _fold_note(group: OpGroup, incoming) -> str:
    if not group.folded:
        return ""
    coll = [c for n in group.folded_nodes for c in incoming.get(n, [])]
    return (f" · same shardings in instances {compress_ranges(list(group.folded))} (folded: "
            f"{len(group.folded_nodes)} ops, {len(coll)} collectives, {fmt_bytes(sum(c.nbytes for c in coll))})")


def _group_details(plan, stage, group: OpGroup, incoming, n_axes: int) -> str:
    rows, n_coll, volume = [], 0, 0.0
    for name in group.nodes:
        s, target = stage.shardings[name], plan.node_ops.get(name, "")
        colls = incoming.get(name, [])
        n_coll, volume = n_coll + len(colls), volume + sum(c.nbytes for c in colls)
        coll_text = "<br>".join(escape(f"{c.kind} axis {c.axis} {c.phase} {fmt_bytes(c.nbytes)} from {c.src}")
                                for c in colls)
        kernels = " ".join(f"{t}@{a}" for a, t in s.kernels)
        rows.append(f'<tr data-name="{escape(name.lower())} {escape(target.lower())}"><td class=mono>{escape(name)}'
                    f'</td><td class=mono title="{escape(target)}">{escape(short_op(target))}</td>'
                    f"<td>{chips(s.out, n_axes)}</td><td class=mono>{escape(', '.join(s.ins))}</td>"
                    f"<td class=mono>{escape(kernels)}</td><td class=mono>{coll_text}</td></tr>")
    meta = f"{len(group.nodes)} ops · {n_coll} collectives ({fmt_bytes(volume)}){_fold_note(group, incoming)}"
    head = "".join(f"<th>{h}</th>" for h in ("node", "op", "output per axis", "inputs read as", "kernels",
                                               "collectives on its inputs (per microbatch)"))
    return (f'<details class="group"><summary><b>{escape(group.label)}</b> <span class="meta">{escape(meta)}'
            f"</span></summary><table><tr>{head}</tr>{''.join(rows)}</table></details>")


def _placeholder_details(stage, holders: list[str], n_axes: int) -> str:
    rows = group_placeholders(holders, lambda n: stage.shardings[n].out)
    cells = [[f"<code>{escape(r.pattern)}</code>", str(len(r.names)), chips(r.spec, n_axes),
              escape(r.names[0] if len(r.names) == 1 else f"{r.names[0]} … {r.names[-1]}")] for r in rows]
    return (f'<details class="group"><summary><b>parameters and inputs</b> <span class="meta">{len(holders)} '
            f"placeholders in {len(rows)} rows (same name pattern and sharding folded)</span></summary>"
            + table(["name pattern", "count", "stored as (per axis)", "members"], cells, {1}) + "</details>")


def _collective_summary(stage) -> str:
    if not stage.collectives:
        return "<h3>Collectives</h3><p>none: this stage needs no communication inside its mesh.</p>"
    count, volume = Counter(), Counter()
    for c in stage.collectives:
        count[(c.kind, c.phase, c.axis)] += 1
        volume[(c.kind, c.phase, c.axis)] += c.nbytes
    rows = [[escape(k), escape(ph), f"{ax} (size {stage.mesh_shape[ax] if ax < len(stage.mesh_shape) else '?'})",
             str(count[(k, ph, ax)]), fmt_bytes(volume[(k, ph, ax)])] for k, ph, ax in sorted(count)]
    largest = sorted(stage.collectives, key=lambda c: -c.nbytes)[:12]
    top = [[escape(f"{c.src} → {c.dst}"), escape(c.kind), str(c.axis), escape(c.phase), fmt_bytes(c.nbytes)]
           for c in largest]
    return ("<h3>Collectives per microbatch</h3>"
            + table(["kind", "phase", "mesh axis", "count", "bytes"], rows, {3, 4})
            + f"<details><summary>the {len(largest)} largest</summary>"
            + table(["edge", "kind", "axis", "phase", "bytes"], top, {4}) + "</details>")
