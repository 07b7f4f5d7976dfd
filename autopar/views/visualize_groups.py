"""Grouping a stage's nodes for display: ops by layer (repeated-block instance), parameters by name pattern.

Plan-independent inputs (lists of names, dicts of shardings) so the helpers are testable alone.
Invariants of ``group_ops``' result:
  * every op of the stage is in exactly one group, either listed in ``nodes`` or inside one of
    ``folded`` (instances whose shardings equal the group's, op for op);
  * groups keep graph order, and no group lists more than ``max_ops`` nodes unless it is one
    repeated-block instance (an instance is never split: it is the unit the reader compares);
  * an instance is folded only into an earlier instance of the same class *in the same stage* whose
    shardings it matches exactly, so folding never hides a difference.
"""
from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict


@dataclasses.dataclass
class OpGroup:
    """A run of ops shown together. block/instance: the repeated-block class and instance it is, if any;
    folded: {instance index: node names} of later instances with exactly these shardings."""

    label: str
    nodes: list[str]
    block: str | None = None
    instance: int | None = None
    folded: dict[int, list[str]] = dataclasses.field(default_factory=dict)

    @property
    def folded_nodes(self) -> list[str]:
        return [n for names in self.folded.values() for n in names]


def block_membership(repeated_blocks: dict[str, list[list[str]]]) -> dict[str, tuple[str, int]]:
    """node name -> (block class id, instance index)."""
    return {name: (cid, i) for cid, instances in repeated_blocks.items()
            for i, names in enumerate(instances) for name in names}


def group_ops(ops: list[str], repeated_blocks: dict[str, list[list[str]]], signature, max_ops: int = 60
              ) -> list[OpGroup]:
    """Split ``ops`` (graph order) into layer groups, folding repeated instances (module docstring).

    signature(name) -> a hashable description of the node's sharding; instances fold when the
    sequences of their nodes' signatures are equal.
    """
    member = block_membership(repeated_blocks)
    groups: list[OpGroup] = []
    for key, names in _runs(ops, member):
        if key is None:
            for lo in range(0, len(names), max_ops):
                chunk = names[lo:lo + max_ops]
                label = f"{len(chunk)} ops: {chunk[0]} … {chunk[-1]}" if len(chunk) > 1 else f"op {chunk[0]}"
                groups.append(OpGroup(label, chunk))
        else:
            cid, inst = key
            groups.append(OpGroup(f"{cid}[{inst}]", names, block=cid, instance=inst))
    return _fold_instances(groups, signature)


def _runs(ops: list[str], member: dict[str, tuple[str, int]]) -> list[tuple[tuple[str, int] | None, list[str]]]:
    """Maximal runs of consecutive ops with the same block instance (None outside every block)."""
    runs: list[tuple[tuple[str, int] | None, list[str]]] = []
    for name in ops:
        key = member.get(name)
        if runs and runs[-1][0] == key:
            runs[-1][1].append(name)
        else:
            runs.append((key, [name]))
    return runs


def _fold_instances(groups: list[OpGroup], signature) -> list[OpGroup]:
    shown: list[OpGroup] = []
    reference: dict[str, list[tuple[tuple, OpGroup]]] = {}
    for g in groups:
        if g.block is None:
            shown.append(g)
            continue
        sig = tuple(signature(n) for n in g.nodes)
        match = next((ref for ref_sig, ref in reference.get(g.block, []) if ref_sig == sig), None)
        if match is not None and g.instance not in match.folded:
            match.folded[g.instance] = g.nodes
            continue
        reference.setdefault(g.block, []).append((sig, g))
        shown.append(g)
    return shown


def compress_ranges(values: list[int]) -> str:
    """[1, 2, 3, 5, 7, 8] -> "1–3, 5, 7–8"."""
    parts, values = [], sorted(values)
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}–{values[j]}")
        i = j + 1
    return ", ".join(parts)


@dataclasses.dataclass
class ParameterRow:
    """Placeholders sharing a name pattern (digits -> "*") and an output spec: one table row."""

    pattern: str
    spec: str
    names: list[str]


def group_placeholders(names: list[str], spec_of) -> list[ParameterRow]:
    """Fold ``p_blocks_0_attn_q_weight`` … ``p_blocks_47_attn_q_weight`` with one spec into one row.

    Order follows the first occurrence of each pattern; a name whose pattern has one member keeps its
    own name. Every input name is in exactly one row.
    """
    rows: OrderedDict[tuple[str, str], list[str]] = OrderedDict()
    for name in names:
        rows.setdefault((re.sub(r"\d+", "*", name), spec_of(name)), []).append(name)
    return [ParameterRow(pattern if len(members) > 1 else members[0], spec, members)
            for (pattern, spec), members in rows.items()]


def short_op(target: str) -> str:
    """"aten.scaled_dot_product_attention.default" -> "scaled_dot_product_attention"."""
    text = target[5:] if target.startswith("aten.") else target
    return text[:-8] if text.endswith(".default") else text
