"""Saved activations and transients under the bf16 policy's autocast, on hand-computable cases.

Autocast changes what backward keeps in two ways that a probe without autocast misses
(``cost_models.saved_tensors``, ``cost_models.memory``):

* an fp32 activation read by a bf16 matmul is kept as autocast's bf16 copy, one per reader: layer_norm's
  fp32 output read by three linears keeps 3 · 2 bytes per element, not 4 once;
* cross_entropy runs in fp32 on bf16 logits: its kept log-softmax is 4 bytes per logit (not 2), and its
  backward holds two fp32 logit-sized gradients at once (transient 2 · 4 bytes per logit, not 2 · 2).

Each case has a negative control: the same relabelled graph probed without autocast gives the old figures,
and a plan priced that way under-predicts the step's measured peak.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.cost_models.memory import cast_inputs, saved_nodes
from autopar.hardware.cluster import Cluster
from autopar.ir.ops import requires_grad_nodes
from autopar.ir.precision import apply_to_graph, resolve
from autopar.passes import intra_op_groups
from autopar.passes.capture import capture
from autopar.profiling.fidelity import peak_allocated_bytes

N, C, V = 64, 16, 512  # tokens, width, vocabulary
BF16 = torch.bfloat16


class Head(nn.Module):
    """layer_norm -> three linears reading its output (summed) -> vocabulary head -> cross_entropy."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(C)
        self.q, self.k, self.v = nn.Linear(C, C), nn.Linear(C, C), nn.Linear(C, C)
        self.head = nn.Linear(C, V, bias=False)

    def forward(self, x, y):
        h = self.ln(x)
        return F.cross_entropy(self.head(self.q(h) + self.k(h) + self.v(h)), y)


@pytest.fixture(scope="module")
def bf16_graph():
    torch.manual_seed(0)
    graph = apply_to_graph(capture(Head(), (torch.randn(N, C), torch.randint(0, V, (N,)))), resolve("bf16"))
    trainable = {p.name for p in graph.placeholders if p.kind == "parameter"}
    return graph, requires_grad_nodes(graph.gm, trainable)


def _node(gm, op):
    return next(n for n in gm.graph.nodes if getattr(n.target, "overloadpacket", None) is op)


def test_graph_records_the_policy_dtype(bf16_graph):
    graph, _ = bf16_graph
    assert graph.compute_dtype is BF16
    assert _node(graph.gm, torch.ops.aten.layer_norm).meta["val"].dtype == torch.float32
    assert _node(graph.gm, torch.ops.aten.linear).meta["val"].dtype == BF16


def test_each_bf16_reader_keeps_its_own_copy_of_an_fp32_activation(bf16_graph):
    graph, grad = bf16_graph
    ln = _node(graph.gm, torch.ops.aten.layer_norm).name  # fp32 output, 4 bytes per element
    stats = 2 / C  # its fp32 mean and rstd per row, charged to it (its input is a graph input)
    assert saved_nodes(graph.gm, grad, autocast_dtype=BF16)[ln] == pytest.approx(3 * 2 / 4 + stats)
    assert saved_nodes(graph.gm, grad)[ln] == pytest.approx(1.0 + stats)  # control: the fp32 output once
    params = {n.name for n in graph.gm.graph.nodes if n.op == "placeholder"}
    assert not params & set(saved_nodes(graph.gm, grad, autocast_dtype=BF16))  # weight copies: param state


def test_cross_entropy_on_bf16_logits_keeps_an_fp32_log_softmax(bf16_graph):
    graph, grad = bf16_graph
    head = [n for n in graph.gm.graph.nodes if getattr(n.target, "overloadpacket", None) is torch.ops.aten.linear][-1]
    logits = N * V * 2  # bf16
    # log-softmax N·V·4 bytes (+ cross_entropy's 4-byte total weight), charged to the logits
    assert saved_nodes(graph.gm, grad, autocast_dtype=BF16)[head.name] == pytest.approx((N * V * 4 + 4) / logits)
    assert saved_nodes(graph.gm, grad)[head.name] == pytest.approx((N * V * 2 + 2) / logits)  # control: all bf16
    ce = _node(graph.gm, torch.ops.aten.cross_entropy_loss).name
    assert cast_inputs(graph.gm, grad, autocast_dtype=BF16)[ce] == ((0, 2.0),)  # an fp32 copy: 2x the bytes
    assert cast_inputs(graph.gm, grad) == {}


# ---- predicted peak of a bf16 step against torch.profiler ------------------------------------------
class Lm(nn.Module):
    """Embedding -> layer_norm -> vocabulary head -> cross_entropy: the logits dominate the step's memory."""

    def __init__(self, vocab=4096, width=64):
        super().__init__()
        self.emb, self.ln, self.head = nn.Embedding(vocab, width), nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, idx, y):
        return F.cross_entropy(self.head(self.ln(self.emb(idx))).flatten(0, 1), y.flatten())


def _measured_bf16_peak(model, batch) -> float:
    opt = torch.optim.AdamW(model.parameters())

    def step():
        with torch.autocast("cpu", dtype=BF16):
            loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    state = sum(p.numel() * 4 for p in model.parameters())
    state += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    return state + peak_allocated_bytes(step)


def test_bf16_step_peak_is_predicted_and_without_autocast_probe_it_is_not(monkeypatch):
    torch.manual_seed(0)
    model = Lm()
    batch = (torch.randint(0, 4096, (4, 128)), torch.randint(0, 4096, (4, 128)))
    measured = _measured_bf16_peak(model, batch)
    predicted = float(autopar.plan(model, Cluster.local(1), batch, precision="bf16").predicted["peak_memory"])
    assert measured <= predicted <= 1.1 * measured, (predicted, measured)
    # control: the saved tensors probed without autocast (bf16 log-softmax, transient of the bf16 logits)
    monkeypatch.setattr(intra_op_groups, "saved_nodes", lambda gm, g, d, a: saved_nodes(gm, g, d))
    monkeypatch.setattr(intra_op_groups, "cast_inputs", lambda gm, g, d, a: {})
    control = float(autopar.plan(model, Cluster.local(1), batch, precision="bf16").predicted["peak_memory"])
    assert control < 0.8 * measured, (control, measured)
