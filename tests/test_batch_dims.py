"""Microbatch rescaling: the graph captured at the global batch, rescaled to a microbatch, is the graph a
capture at the microbatch gives (names, targets, arguments, shapes), for HF decoders whose causal mask and
position ids are built from the batch size; a model whose sizes the walk cannot follow says so, and
planning it re-captures at the microbatch, quietly."""
import re
import warnings

import pytest
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

import autopar
from autopar.passes.batch_dims import batch_dims, rescale, rescale_is_exact
from autopar.passes.capture import capture
from autopar.planner.options import first_microbatch
from tests.zoo_models import gpt2, llama


def _listing(graph) -> list[tuple]:
    """Every node as (name, target, arguments by name, output shapes)."""
    out = []
    for node in graph.gm.graph.nodes:
        shapes = [tuple(v.shape) for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
        args = fx.map_arg((node.args, node.kwargs), lambda a: a.name)
        out.append((node.name, str(node.target), repr(args), shapes))
    return out


@pytest.mark.parametrize("factory", [llama, gpt2], ids=["llama", "gpt2"])
def test_rescaled_graph_is_what_a_capture_at_the_microbatch_gives(factory):
    model, batch = factory()
    graph = capture(model, batch)
    assert rescale_is_exact(graph)
    expected = _listing(capture(model, first_microbatch(batch, 4)))
    got = _listing(rescale(graph, 4))
    assert len(got) == len(expected)
    differing = [(g, e) for g, e in zip(got, expected) if g != e]
    assert not differing, differing[:3]
    assert got != _listing(graph), "the control: the global graph differs from the microbatch's"
    mask = [n for n in graph.gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert mask and all(batch_dims(graph)[n.args[3].name] == 0 for n in mask), "the causal mask carries the batch"
    with pytest.raises(ValueError, match="does not split into 3 microbatches"):
        rescale(graph, 3)


class BatchPlusOne(torch.nn.Module):
    """Reads ``arange(batch + 1)``: a size derived from the batch that no batch dim has, so the walk
    cannot tell it scales with the batch."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        offsets = torch.arange(x.shape[0] + 1, dtype=x.dtype)[1:]
        return self.fc2(torch.relu(self.fc1(x + offsets[:, None]))).square().mean()


def test_a_size_the_walk_cannot_follow_plans_by_re_capturing_quietly(capfd, caplog):
    model, batch = BatchPlusOne(), (torch.randn(8, 8),)
    graph = capture(model, batch)
    assert not rescale_is_exact(graph)
    assert batch_dims(graph)[next(n.name for n in graph.gm.graph.nodes if n.op == "placeholder"
                                  and n.name.startswith("x"))] == 0
    capfd.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, autopar.Cluster.local(2), batch, stages=2, microbatches=2, layers=2)
    out, err = capfd.readouterr()
    assert plan.microbatches == 2 and len(plan.stages) == 2
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert not re.search(r"^E\d{4}|Traceback|ERROR", out + err, re.M), (out + err)[:2000]


def test_a_sequence_as_long_as_the_batch_is_read_as_a_constant_and_rescales_exactly():
    """Alpa's GPT suite: global batch 1024 = sequence length, so the position ids' ``arange(seq_len)`` looks
    like a batch source; read as one, the walk fails at the embedding sum, so it is a constant, and the
    rescaled graph is still the capture at the microbatch (no re-capture)."""
    from examples.gpt import GPT, GPTConfig, make_batch

    cfg = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=2, n_embd=32)
    with torch.device("meta"):
        model = GPT(cfg)
    batch = make_batch(cfg, cfg.seq_len, device="meta")
    graph = capture(model, batch)
    assert rescale_is_exact(graph)
    arange = next(n for n in graph.gm.graph.nodes if n.target is torch.ops.aten.arange.default)
    assert batch_dims(graph)[arange.name] is None, "the position ids do not carry the batch"
    expected = _listing(capture(model, first_microbatch(batch, 4)))
    got = _listing(rescale(graph, 4))
    assert got == expected
    assert got != _listing(graph), "the control: the global graph differs from the microbatch's"
