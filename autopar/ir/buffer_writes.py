"""Buffers a model writes in forward (BatchNorm running statistics, step counters, EMAs), from its graph.

Such a buffer is updated once per forward call. One device calls forward once per step; a plan of B
microbatches calls it B times per step, on B smaller batches, so the buffer would end the step elsewhere
(BatchNorm's statistics of microbatches, a counter at B times the count). So the planner keeps one microbatch
for these models unless the user asks for B explicitly (``microbatch_candidates``), and says so.

A write is an op whose schema marks an argument as written (``Tensor(a!)``: ``add_``, ``copy_``, ``mul_``, ...)
with that argument a buffer or a view of one, or ``aten.batch_norm`` in training mode with running
statistics (its schema hides the in-place update of ``running_mean``/``running_var``).
"""
from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
_VIEWS = {aten.view, aten.reshape, aten._unsafe_view, aten.slice, aten.select, aten.unsqueeze, aten.squeeze,
          aten.expand, aten.permute, aten.transpose, aten.t, aten.alias, aten.narrow, aten.flatten}


def written_buffers(graph) -> list[str]:
    """Model names (fqns) of the buffers ``graph``'s forward writes, sorted."""
    buffers = {info.name: info.fqn for info in graph.placeholders if info.kind == "buffer"}
    out = set()
    for node in graph.gm.graph.nodes:
        for arg in _written_args(node):
            base = _base(arg)
            if base is not None and base.name in buffers:
                out.add(buffers[base.name])
    return sorted(out)


def _written_args(node: fx.Node) -> list:
    if node.op != "call_function":
        return []
    if node.target is aten.batch_norm.default and len(node.args) > 5 and node.args[5]:
        return [a for a in node.args[3:5] if a is not None]
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, fx.Node):
                out.append(value)
    return out


def _base(node: fx.Node) -> fx.Node | None:
    while node.op == "call_function" and getattr(node.target, "overloadpacket", None) in _VIEWS:
        node = node.args[0]
    return node if node.op == "placeholder" else None
