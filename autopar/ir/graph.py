"""The captured model: ``ModelGraph`` (an fx graph of ATen ops plus what codegen and the runtime need).

Built by ``autopar.passes.capture``; read by every later layer. Invariants (established by capture):
  * one placeholder per parameter, buffer, lifted constant and user input, in the signature's order,
    each described by a ``PlaceholderInfo``;
  * every call_function node carries ``meta["val"]`` (a fake tensor, or a tuple of them);
  * ``fingerprint()`` depends on structure and state shapes only, not on the batch.
"""
from __future__ import annotations

import dataclasses
import hashlib

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.ir.ops import OpView


@dataclasses.dataclass(frozen=True)
class PlaceholderInfo:
    """One graph input: ``kind`` is "parameter", "buffer", "constant" or "input"; ``fqn`` the state-dict
    key (parameters/buffers), the constant's name, or ``"input.<i>"`` for the i-th user input."""

    name: str
    kind: str
    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass
class ModelGraph:
    """The captured model: the graph plus what codegen and the runtime need to run it.

    param_aliases maps every state-dict key of a parameter (tied weights included) to the key of the
    placeholder that carries it; ``constants`` holds lifted tensor constants by fqn; ``compute_dtype``
    is the autocast dtype the node values were relabelled under (``ir.precision.apply_to_graph``; None:
    fp32), which the memory model probes the ops under.
    """

    gm: fx.GraphModule
    placeholders: list[PlaceholderInfo]
    out_spec: pytree.TreeSpec
    param_aliases: dict[str, str]
    buffer_keys: list[str]
    constants: dict[str, torch.Tensor]
    input_signature: list[tuple[tuple[int, ...], str]]
    compute_dtype: torch.dtype | None = None

    @property
    def nodes(self) -> list[fx.Node]:
        return list(self.gm.graph.nodes)

    def placeholder(self, name: str) -> PlaceholderInfo:
        return self._by_name[name]

    def __post_init__(self):
        self._by_name = {p.name: p for p in self.placeholders}
        self._views: dict = {}

    def view(self, node: fx.Node):
        """The node's ``OpView`` (cached: the planner asks for it many times per ILP)."""
        hit = self._views.get(node.name)
        if hit is None or hit.node is not node:
            hit = self._views[node.name] = OpView(node)
        return hit

    def fingerprint(self) -> str:
        """A hash of the model's structure: its ops and their wiring, and the shapes and dtypes of its
        parameters and buffers. Activation shapes and the batch-dependent literals in op arguments are
        left out, so the same model captured at a microbatch has the same fingerprint (the plan's
        ``input_signature`` pins the batch). Plans record it to refuse being applied to another model."""
        h = hashlib.sha256()
        state = {p.name: (p.shape, str(p.dtype)) for p in self.placeholders if p.kind != "input"}
        for node in self.gm.graph.nodes:
            wiring = [a.name for a in node.all_input_nodes]
            h.update(f"{node.op}|{node.name}|{node.target}|{wiring}|{state.get(node.name)}\n".encode())
        return h.hexdigest()[:16]
