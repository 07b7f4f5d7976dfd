"""Text views of a Plan: ``plan.summary()`` (a table per stage of op shardings and inserted collectives).

Instances of a repeated block after the first are folded into one line, since their shardings are the
first instance's (the ILP shares their variables).
"""
from __future__ import annotations

from collections import Counter

from autopar.ir.units import fmt_bytes, fmt_seconds


def _header(plan) -> list[str]:
    c, p = plan.cluster, plan.predicted
    meshes = ", ".join(f"{s.mesh_shape[0]}×{s.mesh_shape[1]}" for s in plan.stages)
    lines = [f"autopar plan: {plan.model} on {c['name']} ({plan.num_devices} devices in {c['nodes']} node(s) "
             f"of {c['devices_per_node']}), mesh {meshes}, {len(plan.stages)} stage(s), "
             f"{plan.microbatches} microbatch(es), schedule {plan.schedule}"]
    if p:
        summed = " summed over stages" if len(plan.stages) > 1 else ""
        lines.append(f"predicted step time {fmt_seconds(p.get('step_time', 0))} (compute "
                     f"{fmt_seconds(p.get('compute', 0))}, communication {fmt_seconds(p.get('comm', 0))}{summed}; "
                     f"pipeline bubble {fmt_seconds(p.get('bubble', 0))}; optimizer step "
                     f"{fmt_seconds(p.get('optimizer', 0))}); peak memory per device "
                     f"{fmt_bytes(p.get('peak_memory', 0))} of {fmt_bytes(c['memory_per_device'])}")
    if plan.planner:
        q = plan.planner
        lines.append(f"planner: {q.get('ilp_variables', '?')} ILP variables, {q.get('ilp_status', '?')} "
                     f"({q.get('solver', '?')})")
    return lines


def _folded_nodes(plan, stage) -> dict[str, str]:
    """Ops of repeated-block instances after the first one *in this stage* -> their class."""
    folded = {}
    for cid, instances in plan.repeated_blocks.items():
        local = [inst for inst in instances if inst and inst[0] in stage.shardings]
        for inst in local[1:]:
            for name in inst:
                folded[name] = cid
    return folded


def _is_state(name: str) -> bool:
    """Parameters, buffers and constants (torch.export names them p_, b_, c_): their layout is shown in
    the inputs column of the op that reads them."""
    return name.startswith(("p_", "b_", "c_"))


def _stage_table(plan, stage, max_rows: int) -> list[str]:
    p = stage.predicted
    layers = f", layers {stage.layers[0]}..{stage.layers[1]}" if stage.layers else ""
    lines = ["", f"stage {stage.index}: ranks {stage.ranks}, mesh {stage.mesh_shape[0]}×{stage.mesh_shape[1]} "
             f"on submesh {stage.submesh[0]}×{stage.submesh[1]}{layers}; latency "
             f"{fmt_seconds(p.get('latency', 0))}, memory {fmt_bytes(p.get('memory', 0))}"]
    folded = _folded_nodes(plan, stage)
    skipped: Counter = Counter()
    rows = []
    for name in stage.nodes:
        if name in folded:
            skipped[folded[name]] += 1
            continue
        s = stage.shardings[name]
        if _is_state(name) or (not s.ins and s.out.replace("R", "") == ""):
            continue  # parameter layouts show as the inputs of their readers
        op = plan.node_ops.get(name, "")
        kern = " ".join(f"{t}@{a}" for a, t in s.kernels)
        rows.append(f"  {name:<34} {op:<34} {s.out:<10} {','.join(s.ins):<24} {kern}")
    lines.append(f"  {'node':<34} {'op':<34} {'output':<10} {'inputs':<24} kernels")
    lines += rows[:max_rows]
    if len(rows) > max_rows:
        lines.append(f"  ... {len(rows) - max_rows} more rows")
    for cid, n in skipped.items():
        lines.append(f"  ({n} ops of later {cid} instances in this stage: same shardings as its first one)")
    lines += _collective_lines(stage)
    return lines


def _collective_lines(stage) -> list[str]:
    if not stage.collectives:
        return ["  collectives: none"]
    lines = []
    for title, wanted in (("per microbatch", lambda c: c.phase != "step"),
                          ("per step (parameters' gradient sync)", lambda c: c.phase == "step")):
        by_kind: Counter = Counter()
        volume: Counter = Counter()
        for c in filter(wanted, stage.collectives):
            by_kind[(c.kind, c.phase)] += 1
            volume[(c.kind, c.phase)] += c.nbytes
        parts = [f"{n}× {kind} ({phase}, {fmt_bytes(volume[(kind, phase)])})" if phase != "step" else
                 f"{n}× {kind} ({fmt_bytes(volume[(kind, phase)])})" for (kind, phase), n in sorted(by_kind.items())]
        if parts:
            lines.append(f"  collectives {title}: " + "; ".join(parts))
    return lines


def plan_summary(plan, max_rows: int = 60) -> str:
    lines = _header(plan)
    for stage in plan.stages:
        lines += _stage_table(plan, stage, max_rows)
    return "\n".join(lines)
