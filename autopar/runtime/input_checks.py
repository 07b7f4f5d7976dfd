"""Range checks of index inputs, made on the global batch before it is sharded.

A vocab-split embedding reads zero for a token id no rank owns, and the vocab-parallel cross-entropy
counts a target no rank owns as a zero logit: an out-of-range id or target that one device rejects
(``IndexError``) would train on silently. A batch-split layout is no better: the rank holding the bad
row raises and the others wait for it in their next collective. So ``ParallelModule`` checks, on every
rank, the inputs every rank passes whole (the contract): same inputs, same verdict, every rank raises
the same ``IndexRangeError`` (an ``IndexError``) before any collective. Under data="local" each rank
checks its own share (``check_local_index_ranges``) and the ranks agree on the verdict in one all-gather
(``local_data.LocalData.agree``).

Which inputs: for each ``aten.embedding`` (indices < the table's rows) and each cross-entropy / NLL loss
(0 <= target < classes, or == ignore_index), the index argument is followed back through value-preserving
ops (views, slices, copies, casts) to a user input; the chain is replayed on each microbatch of the real
input, so a model that drops a column first is checked on what it reads. Indices computed otherwise
(arithmetic, buffers) are not covered. Cost: the replayed views plus one min and one max per index input
and microbatch.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from autopar.errors import IndexRangeError

aten = torch.ops.aten
_FOLLOWED = {aten.view, aten.reshape, aten._unsafe_view, aten.slice, aten.select, aten.clone, aten.contiguous,
             aten._to_copy, aten.to, aten.unsqueeze, aten.squeeze, aten.flatten, aten.expand, aten.permute,
             aten.transpose, aten.t, aten.alias, aten.detach, aten.lift_fresh_copy, aten.narrow}
_LOSSES = {aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd, aten.nll_loss_forward, aten.nll_loss2d_forward}


@dataclasses.dataclass(frozen=True)
class IndexCheck:
    """Input ``input_index``, replayed through ``chain`` (graph nodes, input first), must lie in
    [0, bound) or equal ``ignore_index``; ``what`` names the consumer for the error."""

    input_index: int
    chain: tuple
    bound: int
    ignore_index: int | None
    what: str


def index_checks(graph) -> list[IndexCheck]:
    inputs = {info.name: int(info.fqn.split(".")[1]) for info in graph.placeholders if info.kind == "input"}
    checks = []
    for node in graph.gm.graph.nodes:
        found = _index_argument(node)
        if found is None:
            continue
        index_node, bound, ignore_index, what = found
        chain = _chain_to_input(index_node, inputs)
        if chain is not None:
            checks.append(IndexCheck(inputs[chain[0].name], tuple(chain[1:]), bound, ignore_index, what))
    return checks


def _index_argument(node: fx.Node):
    """(index node, bound, ignore_index, description) of an embedding or classification loss, else None."""
    packet = getattr(node.target, "overloadpacket", None)
    if node.op != "call_function" or packet not in {aten.embedding} | _LOSSES:
        return None
    args = _bound_args(node)
    if packet is aten.embedding:
        rows = args["weight"].meta["val"].shape[0]
        return args["indices"], rows, None, f"an embedding table of {rows} rows ({node.name})"
    logits, target = args["self"].meta["val"], args["target"]
    if not isinstance(target, fx.Node) or target.meta["val"].dtype.is_floating_point:
        return None  # class probabilities, not indices
    classes = logits.shape[1] if logits.dim() > 1 else logits.shape[0]
    return target, classes, args.get("ignore_index", -100), f"a loss over {classes} classes ({node.name})"


def _bound_args(node: fx.Node) -> dict:
    schema = node.target._schema.arguments
    values = {a.name: a.default_value for a in schema if a.has_default_value()}
    values.update({a.name: v for a, v in zip(schema, node.args)})
    values.update(node.kwargs)
    return values


def _chain_to_input(node, inputs: dict[str, int]) -> list | None:
    """[input placeholder, op nodes ... node], each op reading only the previous node, else None."""
    chain = [node]
    while isinstance(node, fx.Node) and node.op == "call_function":
        if getattr(node.target, "overloadpacket", None) not in _FOLLOWED:
            return None
        sources = [a for a in node.all_input_nodes]
        if len(sources) != 1:
            return None
        node = sources[0]
        chain.append(node)
    if not isinstance(node, fx.Node) or node.op != "placeholder" or node.name not in inputs:
        return None
    return chain[::-1]


def check_index_ranges(checks: list[IndexCheck], inputs: tuple, microbatches: int) -> None:
    """Raise ``IndexRangeError`` (identically on every rank) on the first index out of range."""
    for check in checks:
        value = inputs[check.input_index]
        if not isinstance(value, torch.Tensor) or value.is_floating_point():
            continue
        parts = value.chunk(microbatches, dim=0) if microbatches > 1 and value.dim() > 0 else (value,)
        for part in parts:
            _check_one(check, _replay(check.chain, part))


def check_local_index_ranges(checks: list[IndexCheck], inputs: tuple) -> None:
    """``check_index_ranges`` on one rank's share of the batch (data="local"): the chain is replayed with
    the leading size of each view/reshape/expand left free (-1), as the share has fewer rows than the
    captured graph; a chain that still cannot replay on it checks the input as passed (every value of
    it, a superset of what the model reads)."""
    for check in checks:
        value = inputs[check.input_index] if check.input_index < len(inputs) else None
        if not isinstance(value, torch.Tensor) or value.is_floating_point():
            continue
        try:
            index = _replay(check.chain, value, free_leading=True)
        except (RuntimeError, IndexError):
            index = value
        _check_one(check, index)


_SHAPED = {aten.view, aten.reshape, aten._unsafe_view, aten.expand}


def _free_leading(node, args: list) -> list:
    """A shape argument whose first size is left to the data (-1), unless it has a -1 already."""
    if getattr(node.target, "overloadpacket", None) not in _SHAPED or len(args) < 2:
        return args
    shape = list(args[1])
    if shape and -1 not in shape:
        shape[0] = -1
    return [args[0], shape, *args[2:]]


def _replay(chain: tuple, value: torch.Tensor, free_leading: bool = False) -> torch.Tensor:
    for node in chain:
        previous = node.all_input_nodes[0]
        args = [value if a is previous else a for a in node.args]
        if free_leading:
            args = _free_leading(node, args)
        kwargs = {k: value if v is previous else v for k, v in node.kwargs.items()}
        value = node.target(*args, **kwargs)
    return value


def _check_one(check: IndexCheck, index: torch.Tensor) -> None:
    if index.numel() == 0:
        return
    counted = index if check.ignore_index is None else index[index != check.ignore_index]
    if counted.numel() == 0:
        return
    low, high = int(counted.min()), int(counted.max())
    if low >= 0 and high < check.bound:
        return
    bad = low if low < 0 else high
    kind = "token id" if check.ignore_index is None else "target"
    allowed = "" if check.ignore_index is None else f", or ignore_index={check.ignore_index}"
    raise IndexRangeError(f"index out of range: input {check.input_index} holds {kind} {bad}, but {check.what} "
                          f"accepts 0..{check.bound - 1}{allowed} (one device raises IndexError here too); "
                          f"fix the data or the vocabulary size")
