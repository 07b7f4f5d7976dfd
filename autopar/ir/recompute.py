"""Which ops of a plan run under activation recompute: shared by the planner and the runtime.

A stage's ``recompute`` maps a layer index to "full" (all of the layer's ops) or "selective" (its
attention core, ``ATTENTION_CORE``: Megatron's selective recompute). ``region_keys`` turns that and the
plan's node-to-layer map into the region key of every recomputed op; codegen outlines each run of ops
with one key into one checkpointed region.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten
ATTENTION_CORE = {aten.scaled_dot_product_attention, aten._scaled_dot_product_flash_attention,
                  aten._scaled_dot_product_efficient_attention, aten._softmax, aten.softmax}
_CORE_PACKETS = {getattr(op, "overloadpacket", op) for op in ATTENTION_CORE}


def region_keys(graph, node_layers: dict[str, int], recompute: dict[int, str]) -> dict[str, object]:
    """{op name: region key} for codegen: the layer index for a "full" layer's ops, (layer, "selective")
    for the attention-core ops of a "selective" layer. Outputs and placeholders are never in a region."""
    out = {}
    for node in graph.gm.graph.nodes:
        if node.op != "call_function" or node.name not in node_layers:
            continue
        layer = node_layers[node.name]
        mode = recompute.get(layer)
        if mode == "full":
            out[node.name] = layer
        elif mode == "selective" and getattr(node.target, "overloadpacket", None) in _CORE_PACKETS:
            out[node.name] = (layer, "selective")
    return out
