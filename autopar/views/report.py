"""Text views of a Plan: ``plan.summary()``, per stage: time and memory, the parameters' layouts grouped by
block part (norms, embeddings, head, attention, MLP), the collectives, then the main ops' shardings; glue
ops (mask and position arithmetic) only with ``glue=True``.

Instances of a repeated block after the first are folded into one line, since their shardings are the
first instance's (the ILP shares their variables).
"""
from __future__ import annotations

import re
from collections import Counter

from autopar.ir.units import fmt_bytes, fmt_seconds
from autopar.views.moe import moe_lines


def _header(plan) -> list[str]:
    c, p = plan.cluster, plan.predicted
    meshes = ", ".join(f"{s.mesh_shape[0]}×{s.mesh_shape[1]}" for s in plan.stages)
    lines = [f"autopar plan: {plan.model} on {c['name']} ({plan.num_devices} devices in {c['nodes']} node(s) "
             f"of {c['devices_per_node']}), mesh {meshes}, {len(plan.stages)} stage(s), "
             f"{plan.microbatches} microbatch(es), schedule {plan.schedule}{_chunks(plan)}"]
    if p:
        summed = " summed over stages" if len(plan.stages) > 1 else ""
        lines.append(f"predicted step time {fmt_seconds(p.get('step_time', 0))} (compute "
                     f"{fmt_seconds(p.get('compute', 0))}, communication {fmt_seconds(p.get('comm', 0))}{summed}; "
                     f"pipeline bubble {fmt_seconds(p.get('bubble', 0))}; optimizer step "
                     f"{fmt_seconds(p.get('optimizer', 0))}); peak memory per device "
                     f"{fmt_bytes(p.get('peak_memory', 0))} of {fmt_bytes(c['memory_per_device'])}")
    lines.append(_precision_line(plan))
    if plan.planner:
        q = plan.planner
        lines.append(f"planner: {q.get('ilp_variables', '?')} ILP variables, {q.get('ilp_status', '?')} "
                     f"({q.get('solver', '?')})")
    return lines


def _chunks(plan) -> str:
    """Interleaved 1F1B: how many model chunks each device holds."""
    v = getattr(plan, "virtual_stages", 1)
    return f" ({v} model chunks per device, interleaved round robin)" if v > 1 else ""


def _precision_line(plan) -> str:
    """Precision policy, ZeRO levels per stage and the gradient sync's exposed share."""
    from autopar.ir.precision import resolve

    zero = []
    for s in plan.stages:
        levels = sorted(set(s.zero.values()) | ({0} if len(s.zero) < _param_count(plan, s) else set()))
        zero.append("/".join(str(x) for x in levels) or "0")
    p = plan.predicted
    hidden = f"; gradient sync {fmt_seconds(p['grad_sync_exposed'])} exposed of {fmt_seconds(p['grad_sync'])}" \
        if "grad_sync_exposed" in p else ""
    return f"precision {resolve(plan.precision).describe()}; ZeRO level(s) by stage: {', '.join(zero)}{hidden}"


def _param_count(plan, stage) -> int:
    return sum(1 for n in stage.shardings if n.startswith("p_"))


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


def recompute_text(stage) -> str:
    """"layers 0, 2 full; 1 selective" for a stage's recompute choice, or "none"."""
    by_mode: dict[str, list[str]] = {}
    for layer, mode in sorted(getattr(stage, "recompute", {}).items()):
        by_mode.setdefault(mode, []).append(str(layer))
    return "; ".join(f"layers {', '.join(ls)} {mode}" for mode, ls in by_mode.items()) or "none"


# Parameter groups; a name is matched against each pattern in turn
# (norms first: "post_attention_layernorm" is a norm, not attention).
PARAM_GROUPS = (
    ("norms", re.compile(r"norm|(^|_)ln(_|\d|f)|layer_norm")),
    ("embeddings", re.compile(r"embed|(^|_)wte|(^|_)wpe|shared|patch|position|token_type")),
    ("head", re.compile(r"lm_head|(^|_)head|classifier|pooler|score|cls_")),
    ("attention", re.compile(r"attn|attention|(^|_)(q|k|v|o)_proj|query|key|value|c_proj_attn|(^|_)(q|k|v|o)(_|$)")),
    ("MLP", re.compile(r"mlp|ffn|feed_forward|experts|(^|_)fc|intermediate|up_proj|down_proj|gate|dense|(^|_)w[io]")),
)
GROUP_ORDER = ("attention", "MLP", "norms", "embeddings", "head", "other")  # how a summary lists them
# Ops a user recognizes as the model's work; every other op is glue (mask, position and shape arithmetic).
MAIN_OPS = re.compile(r"linear|\bmm\b|addmm|bmm|matmul|einsum|convolution|conv\d|embedding|attention|"
                      r"cross_entropy|nll_loss|layer_norm|rms_norm|grouped_mm|softmax|moe_experts")


def param_group(name: str) -> str:
    """The block part a parameter belongs to (see ``PARAM_GROUPS``), or "other"."""
    key = name.lower()
    return next((group for group, pattern in PARAM_GROUPS if pattern.search(key)), "other")


def _param_rows(plan, stage) -> list[str]:
    """One row per (group, name with its block index folded to *, layout): how many tensors share it."""
    counts: Counter = Counter()
    for name in stage.nodes:
        if name.startswith("p_"):
            folded = re.sub(r"_(\d+)_", "_*_", name[2:], count=1)
            counts[(param_group(name[2:]), folded, stage.shardings[name].out)] += 1
    order = list(GROUP_ORDER)
    rows = [f"  parameters ({sum(counts.values())} tensors; layout per mesh axis, R replicated, S(d) split on dim d):"]
    for group, folded, layout in sorted(counts, key=lambda k: (order.index(k[0]), k[1], k[2])):
        n = counts[(group, folded, layout)]
        rows.append(f"    {group:<11} {folded:<52} {layout:<12}" + (f" ×{n}" if n > 1 else ""))
    return rows


def _op_rows(plan, stage, glue: bool) -> tuple[list[str], int]:
    """Rows of the ops with their shardings (main ops, or only glue ops), folding later block instances."""
    folded = _folded_nodes(plan, stage)
    rows, hidden = [], 0
    for name in stage.nodes:
        s = stage.shardings[name]
        if name in folded or _is_state(name) or (not s.ins and s.out.replace("R", "") == ""):
            continue
        op = plan.node_ops.get(name, "")
        if bool(MAIN_OPS.search(op)) == glue:
            hidden += 1
            continue
        kern = " ".join(f"{t}@{a}" for a, t in s.kernels)
        rows.append(f"    {name:<34} {op:<34} {s.out:<10} {','.join(s.ins):<24} {kern}")
    return rows, hidden


def _stage_table(plan, stage, max_rows: int, glue: bool = False) -> list[str]:
    """Per stage, in the order users ask: time and memory, parameter layouts by block part, collectives,
    the main ops' shardings; glue ops last and only when ``glue`` is set."""
    p = stage.predicted
    layers = f", layers {stage.layers[0]}..{stage.layers[1]}" if stage.layers else ""
    lines = ["", f"stage {stage.index}: ranks {stage.ranks}, mesh {stage.mesh_shape[0]}×{stage.mesh_shape[1]} "
             f"on submesh {stage.submesh[0]}×{stage.submesh[1]}{layers}; latency "
             f"{fmt_seconds(p.get('latency', 0))}, memory {fmt_bytes(p.get('memory', 0))}"]
    if getattr(stage, "recompute", None):
        lines.append(f"  recompute in backward: {recompute_text(stage)} (+{fmt_seconds(p.get('recompute', 0))} "
                     f"per microbatch)")
    lines += _param_rows(plan, stage)
    lines += _collective_lines(stage)
    rows, glue_count = _op_rows(plan, stage, glue=False)
    header = f"    {'node':<34} {'op':<34} {'output':<10} {'inputs':<24} kernels"
    lines += ["  ops (later instances of a repeated block folded into the first):", header] + rows[:max_rows]
    if len(rows) > max_rows:
        lines.append(f"    ... {len(rows) - max_rows} more rows")
    if glue:
        glue_rows, _ = _op_rows(plan, stage, glue=True)
        lines += ["  glue ops (masks, positions, shapes, elementwise):", header] + glue_rows
    elif glue_count:
        lines.append(f"  ({glue_count} glue ops (masks, positions, shapes, elementwise) not shown: summary(glue=True))")
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


def plan_summary(plan, max_rows: int = 60, glue: bool = False) -> str:
    lines = _header(plan) + moe_lines(plan)
    for stage in plan.stages:
        lines += _stage_table(plan, stage, max_rows, glue)
    return "\n".join(lines)
