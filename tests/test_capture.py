"""Front end: torch.export (non-strict) captures plain modules, the GPT example and HF GPT-2 as ATen graphs
with shapes and dtypes on every node; a model it cannot capture gets one clear error."""
import pytest
import torch

from autopar.errors import CaptureError
from autopar.passes.capture import capture
from autopar.passes.cluster_layers import find_repeated_blocks
from tests.models import make_hf_gpt2, make_mlp, make_small_gpt


@pytest.mark.parametrize("factory", [make_mlp, make_small_gpt, make_hf_gpt2], ids=["mlp", "gpt", "hf_gpt2"])
def test_every_node_has_shapes_and_dtypes(factory):
    model, batch = factory()
    graph = capture(model, batch)
    calls = [n for n in graph.gm.graph.nodes if n.op == "call_function"]
    assert calls, "no ops captured"
    for node in calls + [n for n in graph.gm.graph.nodes if n.op == "placeholder"]:
        val = node.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else [val]
        assert all(isinstance(v, torch.Tensor) for v in vals), f"{node.name} lacks a tensor value"
    assert not any("assert" in str(n.target) for n in calls), "runtime assertions must be stripped"
    assert [p.kind for p in graph.placeholders].count("input") == len(batch)


def test_repeated_blocks_are_found():
    graph = capture(*make_small_gpt(n_layer=3))
    blocks = find_repeated_blocks(graph)
    assert len(blocks.instances) == 1
    (instances,) = blocks.instances.values()
    assert len(instances) == 3 and len({len(i) for i in instances}) == 1


def test_tied_weights_alias_the_parameter_the_graph_uses():
    model, batch = make_hf_gpt2()
    graph = capture(model, batch)
    assert graph.param_aliases["lm.transformer.wte.weight"] == graph.param_aliases["lm.lm_head.weight"]


def test_the_fingerprint_tells_models_apart_but_not_batch_sizes():
    a = capture(*make_small_gpt()).fingerprint()
    assert a == capture(*make_small_gpt()).fingerprint()
    assert a == capture(*make_small_gpt(batch_size=4)).fingerprint(), "a microbatch is the same model"
    assert a != capture(*make_small_gpt(n_layer=3)).fingerprint()
    assert a != capture(*make_small_gpt(n_embd=32)).fingerprint()


class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # the construct the error must name
            return self.fc(x).sum()
        return x.sum()


def test_data_dependent_control_flow_is_one_clear_error():
    with pytest.raises(CaptureError) as err:
        capture(DataDependent(), (torch.randn(2, 4),))
    message = str(err.value)
    assert "test_capture.py" in message and "if x.sum() > 0" in message, message
    assert "torch.where" in message, "the error must say how to fix it"
    assert len(message.splitlines()) == 1


def test_non_tensor_inputs_and_non_modules_are_rejected():
    with pytest.raises(CaptureError, match="tuple of tensors"):
        capture(torch.nn.Linear(2, 2), {"x": torch.randn(1, 2)})
    with pytest.raises(CaptureError, match="example_inputs\\[1\\]"):
        capture(torch.nn.Linear(2, 2), (torch.randn(1, 2), 3))
    with pytest.raises(CaptureError, match="torch.nn.Module"):
        capture(lambda x: x, (torch.randn(1, 2),))
