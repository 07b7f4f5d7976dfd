"""Mixture-of-experts layers of a plan: how each dispatches its tokens, on which mesh axis, what it moves.

Read from the plan's fields alone. A layer is one ``autopar::moe_experts`` node; its dispatch follows from
its kernels (``NodeSharding.kernels``):

    all-to-all   kernel ``expert_all_to_all`` on axis a: tokens and experts split on a, each token row
                 sent to its experts' devices and back (``runtime/expert_dispatch.py``)
    gather       kernel ``local_experts_op`` on axis a: tokens whole on a, each device computes its own
                 experts' share, the output reduced after
    none         no expert split (experts replicated, tokens split, or each expert's hidden dim split)

bytes per step (all-to-all) = microbatches × Σ bytes of the node's "expert_all_to_all" collectives (per
device, on the slowest device: ``cost_models.experts``), forward and backward. Layers of one stage with the
same dispatch, axes and bytes are folded into one row.
"""
from __future__ import annotations

import dataclasses
import html

from autopar.ir.moe_op import OP_NAME
from autopar.ir.units import fmt_bytes

MOE_OP = OP_NAME
DISPATCH = {"expert_all_to_all": "all-to-all", "local_experts_op": "gather"}


@dataclasses.dataclass
class MoeRow:
    """Layers of one stage that dispatch alike: their node names, how, on which axes, bytes per step each."""

    stage: int
    nodes: list[str]
    dispatch: str
    axes: tuple[int, ...]
    axis_sizes: tuple[int, ...]
    bytes_per_step: float


def moe_rows(plan) -> list[MoeRow]:
    """One row per (stage, dispatch, axes, bytes), in graph order (module docstring)."""
    rows: list[MoeRow] = []
    for stage in plan.stages:
        moved: dict[str, float] = {}
        for c in stage.collectives:
            if c.kind == "expert_all_to_all":
                moved[c.dst] = moved.get(c.dst, 0.0) + c.nbytes * plan.microbatches
        found: dict[tuple, MoeRow] = {}
        for name in stage.nodes:
            if plan.node_ops.get(name) != MOE_OP:
                continue
            kernels = [(a, t) for a, t in stage.shardings[name].kernels if t in DISPATCH]
            dispatch = DISPATCH[kernels[0][1]] if kernels else "none"
            axes = tuple(a for a, _ in kernels)
            key = (dispatch, axes, round(moved.get(name, 0.0)))
            if key not in found:
                found[key] = MoeRow(stage.index, [], dispatch, axes, tuple(stage.mesh_shape[a] for a in axes),
                                    moved.get(name, 0.0))
                rows.append(found[key])
            found[key].nodes.append(name)
    return rows


def _names(nodes: list[str]) -> str:
    return ", ".join(nodes) if len(nodes) <= 3 else f"{nodes[0]}, {nodes[1]} … {nodes[-1]}"


def _how(row: MoeRow) -> str:
    on = " and ".join(f"axis {a} (size {n})" for a, n in zip(row.axes, row.axis_sizes))
    if row.dispatch == "all-to-all":
        return f"all-to-all on {on}, {fmt_bytes(row.bytes_per_step)} per device per step each"
    if row.dispatch == "gather":
        return f"gather-based expert split on {on} (tokens replicated, output reduced)"
    return "no expert split (experts replicated, tokens or expert hidden dims split)"


def moe_lines(plan) -> list[str]:
    """The summary's lines on the MoE layers (none when the plan has no MoE experts op)."""
    rows = moe_rows(plan)
    if not rows:
        return []
    total = sum(len(r.nodes) for r in rows)
    by_a2a = sum(len(r.nodes) for r in rows if r.dispatch == "all-to-all")
    lines = [f"mixture-of-experts layers: {by_a2a} of {total} dispatch tokens by all-to-all"]
    for r in rows:
        lines.append(f"  stage {r.stage}: {_names(r.nodes)} ({len(r.nodes)}): {_how(r)}")
    return lines


def moe_html(plan) -> str:
    """The HTML report's section on the MoE layers ("" when the plan has none)."""
    rows = moe_rows(plan)
    if not rows:
        return ""
    head = "".join(f"<th>{h}</th>" for h in ("stage", "layers", "count", "dispatch", "mesh axis (size)",
                                               "bytes per device per step, each"))
    body = []
    for r in rows:
        axes = ", ".join(f"{a} ({n})" for a, n in zip(r.axes, r.axis_sizes)) or "–"
        moved = fmt_bytes(r.bytes_per_step) if r.dispatch == "all-to-all" else "–"
        body.append(f"<tr><td>{r.stage}</td><td class=mono>{html.escape(_names(r.nodes))}</td><td>{len(r.nodes)}"
                    f"</td><td>{html.escape(r.dispatch)}</td><td>{axes}</td><td>{moved}</td></tr>")
    return (f'<section class="moe"><h2 id="moe">Mixture-of-experts layers</h2><p>How each MoE layer sends its '
            f"tokens to its experts: all-to-all (tokens travel to their experts' devices and back), gather "
            f"(every device sees every token), or none.</p><table><tr>{head}</tr>{''.join(body)}</table></section>")
