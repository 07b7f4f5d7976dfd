"""Range checks of index inputs, made on the global batch before it is sharded (and ``wrong_device``: an input
not on the device this rank computes on).

A vocab-split embedding reads zero for a token id no rank owns, and the vocab-parallel cross-entropy
counts a target no rank owns as a zero logit: an out-of-range id or target that one device rejects
(``IndexError``) would train on silently. A batch-split layout is no better: the rank holding the bad
row raises and the others wait for it in their next collective. So ``ParallelModule`` checks, on every
rank, the inputs every rank passes whole (the contract): same inputs, same verdict, every rank raises
the same ``IndexRangeError`` (an ``IndexError``) before any collective. Under data="local" each rank
checks its own share (``check_local_index_ranges``) and the ranks agree on the verdict in one all-gather
(``local_data.LocalData.agree``).

Which inputs: for each ``aten.embedding`` (indices < the table's rows) and each cross-entropy / NLL loss
(0 <= target < classes, or == ignore_index), the index argument is followed back through every op that
computes it from user inputs and constants alone (views, slices, casts, and also ``F.pad`` of the labels
as Hugging Face's loss does, ``torch.where``/``masked_fill`` with a mask from another input, shifts,
arithmetic): that subgraph is replayed on each microbatch of the real inputs, so the check sees exactly
the indices the kernel reads. An index that depends on a parameter, a buffer or a random op is not
covered (``_replayable``). Cost: the replayed ops (on index-sized tensors) plus one min and one max per
index and microbatch.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from autopar.errors import IndexRangeError
from autopar.runtime.devices import rank_device

aten = torch.ops.aten
_RANDOM = {aten.rand, aten.rand_like, aten.randn, aten.randn_like, aten.randint, aten.randint_like,
           aten.randperm, aten.bernoulli, aten.bernoulli_, aten.multinomial, aten.dropout, aten.native_dropout,
           aten.normal, aten.uniform_, aten.exponential_}
_MAX_REPLAYED = 64  # ops in one index's subgraph (HF's label shift is 3-4)
_LOSSES = {aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd, aten.nll_loss_forward, aten.nll_loss2d_forward}


@dataclasses.dataclass(frozen=True)
class IndexCheck:
    """The index that ``chain`` (graph nodes in graph order, the index last) computes from the user inputs
    ``inputs`` ({placeholder name: input position}) must lie in [0, bound) or equal ``ignore_index``;
    ``what`` names the consumer for the error."""

    inputs: tuple
    chain: tuple
    bound: int
    ignore_index: int | None
    what: str

    @property
    def input_index(self) -> int:
        """The first input the index is computed from (the one the error names)."""
        return min(i for _, i in self.inputs)


def index_checks(graph) -> list[IndexCheck]:
    inputs = {info.name: int(info.fqn.split(".")[1]) for info in graph.placeholders if info.kind == "input"}
    checks = []
    for node in graph.gm.graph.nodes:
        found = _index_argument(node)
        if found is None:
            continue
        index_node, bound, ignore_index, what = found
        replayed = _replayable(index_node, inputs)
        if replayed is not None:
            chain, used = replayed
            checks.append(IndexCheck(tuple(sorted(used.items())), chain, bound, ignore_index, what))
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


def _replayable(node, inputs: dict[str, int]):
    """(the op nodes computing ``node`` in graph order, {input placeholder: position}) when ``node`` is
    computed from user inputs and constants alone, without random ops, else None."""
    if not isinstance(node, fx.Node):
        return None
    ops, used, seen, stack = [], {}, set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if n.name not in inputs:
                return None  # a parameter or buffer
            used[n.name] = inputs[n.name]
            continue
        if n.op != "call_function" or getattr(n.target, "overloadpacket", n.target) in _RANDOM:
            return None
        ops.append(n)
        if len(ops) > _MAX_REPLAYED:
            return None
        stack.extend(n.all_input_nodes)
    if not used:
        return None
    order = {n: k for k, n in enumerate(node.graph.nodes)}
    return tuple(sorted(ops, key=order.__getitem__)), used


def check_index_ranges(checks: list[IndexCheck], inputs: tuple, microbatches: int) -> None:
    """Raise ``IndexRangeError`` (identically on every rank) on the first index out of range."""
    for check in checks:
        values = {name: inputs[i] for name, i in check.inputs}
        if not all(isinstance(v, torch.Tensor) for v in values.values()):
            continue
        for mb in range(microbatches):
            part = {n: v.chunk(microbatches, dim=0)[mb] if microbatches > 1 and v.dim() > 0 else v
                    for n, v in values.items()}
            _check_one(check, _replay(check.chain, part))


def check_local_index_ranges(checks: list[IndexCheck], inputs: tuple) -> None:
    """``check_index_ranges`` on one rank's share of the batch (data="local"): the chain is replayed with
    the leading size of each view/reshape/expand left free (-1), as the share has fewer rows than the
    captured graph; a chain that still cannot replay on it checks the input as passed (every value of
    it, a superset of what the model reads)."""
    for check in checks:
        values = {name: inputs[i] if i < len(inputs) else None for name, i in check.inputs}
        if not all(isinstance(v, torch.Tensor) for v in values.values()):
            continue
        try:
            index = _replay(check.chain, values, free_leading=True)
        except (RuntimeError, IndexError):
            index = values[min(check.inputs, key=lambda item: item[1])[0]]
            if index.is_floating_point():
                continue
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


def _replay(chain: tuple, values: dict, free_leading: bool = False) -> torch.Tensor:
    """Run ``chain``'s ops on the real inputs ``values`` ({placeholder name: tensor}); the last op's value."""
    if not chain:  # the index is an input itself
        return next(iter(values.values()))
    env = dict(values)

    def real(a):
        return env[a.name] if isinstance(a, fx.Node) else a

    value = None
    for node in chain:
        args = list(fx.node.map_aggregate(node.args, real))
        if free_leading:
            args = _free_leading(node, args)
        kwargs = fx.node.map_aggregate(dict(node.kwargs), real)
        value = env[node.name] = node.target(*args, **kwargs)
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


def wrong_device(device_type: str, inputs) -> str | None:
    """Why an input is not where this rank computes (on a GPU plan: this rank's own GPU, not just any), or None."""
    mine = rank_device(device_type)
    want = str(mine) if mine.type == device_type else device_type
    for i, t in enumerate(inputs):
        if isinstance(t, torch.Tensor) and (t.device.type != device_type or (t.is_cuda and t.device != mine)):
            return (f"input {i} is on {t.device} but this rank runs on {want}; move the batch there first "
                    f"(e.g. tensor.to({want!r}))")
    return None
