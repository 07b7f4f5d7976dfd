"""What the plan's stages share (no process group): the graph's requires-grad set, walked once per plan; the kept
result equals the fresh walk on a real graph (a captured GPT), and a changed input misses."""
import torch

from autopar.ir.ops import requires_grad_nodes
from autopar.passes.capture import capture
from autopar.planner.sync_charges import requires_grad_kept
from examples.gpt import GPT, GPTConfig, make_batch

CFG = GPTConfig(vocab_size=256, seq_len=32, n_layer=3, n_head=4, n_embd=64)


def _graph():
    with torch.device("meta"):
        model = GPT(CFG)
    return capture(model, make_batch(CFG, 8, device="meta"))


def test_the_requires_grad_set_is_kept_per_graph_and_trainable_set():
    graph = _graph()
    trainable = {p.name for p in graph.placeholders if p.kind == "parameter"}
    kept = requires_grad_kept(graph, trainable)
    assert kept == requires_grad_nodes(graph.gm, trainable) and requires_grad_kept(graph, trainable) is kept
    frozen = requires_grad_kept(graph, set())
    assert frozen == requires_grad_nodes(graph.gm, set()) != kept, "control: another trainable set is walked afresh"
