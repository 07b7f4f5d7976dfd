"""``pm.train()`` / ``pm.eval()``: the generated modules switch the ops that a module's mode switches.

The model is captured in training mode, so its graph holds the training form of every mode-dependent op.
Eval mode is the same graph with those ops' mode arguments rewritten, which is exactly what the model's
own ``eval()`` does to them (``nn.Dropout``/``F.dropout``, ``nn.BatchNorm*``, and attention that passes
``dropout_p`` only while training, as HF's and the GPT example's do):
  * ``aten.dropout`` / ``feature_dropout`` / ``alpha_dropout`` / ``feature_alpha_dropout`` / ``native_dropout``:
    ``train`` (argument 2) = the mode;
  * ``aten.batch_norm`` with running statistics: ``training`` (argument 5) = the mode (a norm without
    running statistics uses the batch's in both modes, as torch's does);
  * ``aten.scaled_dot_product_attention`` (and the flash variant): ``dropout_p`` = the captured value in
    training, 0 in eval;
  * the in-place ``num_batches_tracked += 1`` of a BatchNorm: adds 0 in eval (BatchNorm skips it).
Nothing else changes: sharding, collectives and shapes are those of the plan. Each rewritten GraphModule
(every stage, chunk and recomputed region of this rank) is recompiled; switching to the mode it is in
already does nothing.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.runtime import rng

aten = torch.ops.aten
_DROPOUTS = {aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default,
             aten.feature_alpha_dropout.default, aten.native_dropout.default}
_ATTENTION = {aten.scaled_dot_product_attention.default}
if hasattr(aten, "_scaled_dot_product_flash_attention"):  # (query, key, value, dropout_p, ...)
    _ATTENTION.add(aten._scaled_dot_product_flash_attention.default)


def graph_modules(runner) -> list[fx.GraphModule]:
    """Every GraphModule this rank runs: each stage's or chunk's module and the regions inside it."""
    roots = [c.gm for c in getattr(runner, "chunks", [runner])]
    return [m for root in roots for m in root.modules() if isinstance(m, fx.GraphModule)]


def set_training(runner, mode: bool) -> int:
    """Rewrite the mode-dependent ops of this rank's modules for ``mode``; returns how many changed."""
    changed = 0
    for gm in graph_modules(runner):
        here = sum(_set_node(node, mode) for node in gm.graph.nodes if node.op == "call_function")
        if here:
            gm.recompile()
            changed += here
    return changed


def _set_node(node: fx.Node, mode: bool) -> int:
    if (node.target in _DROPOUTS or node.target is rng.dropout_own_draw) and len(node.args) > 2:
        return _set_arg(node, 2, "train", mode, bool(mode))
    if node.target is aten.batch_norm.default and len(node.args) > 5 and node.args[3] is not None:
        return _set_arg(node, 5, "training", mode, bool(mode))
    if node.target in _ATTENTION:
        return _set_attention_dropout(node, mode)
    if node.target is aten.add_.Tensor and _is_batch_counter(node.args[0]):
        return _set_arg(node, 1, "other", mode, None)
    return 0


def _set_arg(node: fx.Node, index: int, name: str, mode: bool, value) -> int:
    """Argument ``index`` (or keyword ``name``) := ``value``; None: the captured value in training, 0 in eval."""
    where = "args" if len(node.args) > index else ("kwargs" if name in node.kwargs else None)
    if where is None:
        return 0
    current = node.args[index] if where == "args" else node.kwargs[name]
    captured = node.meta.setdefault("autopar_train_value", current)
    want = (captured if mode else type(captured)(0)) if value is None else value
    if current == want and type(current) is type(want):
        return 0
    if where == "args":
        node.args = (*node.args[:index], want, *node.args[index + 1:])
    else:
        node.kwargs = {**node.kwargs, name: want}
    return 1


def _set_attention_dropout(node: fx.Node, mode: bool) -> int:
    index = 4 if node.target is aten.scaled_dot_product_attention.default else 3
    return _set_arg(node, index, "dropout_p", mode, None) if (
        len(node.args) > index or "dropout_p" in node.kwargs) else 0


def _is_batch_counter(arg) -> bool:
    """A BatchNorm's ``num_batches_tracked`` buffer (its placeholder or the module attribute it became)."""
    return isinstance(arg, fx.Node) and str(arg.target).endswith("num_batches_tracked")
