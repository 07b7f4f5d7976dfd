"""Capture helper: Hugging Face MoE experts exported as the one op ``autopar::moe_experts``.

``transformers`` 5.x routes every experts module decorated with ``use_experts_implementation`` (Mixtral,
Qwen2-MoE, OLMoE, ...) through ``ALL_EXPERTS_FUNCTIONS[config._experts_implementation]``. ``experts_as_op``
registers an "autopar" implementation there and sets it on the configs of the model's experts modules for
the export only, restoring each config's own setting afterwards, so the user changes nothing and the model
runs as before outside capture. The implementation calls the op with the module's weights:

    gate_up_proj [E, 2I, H], down_proj [E, H, I]   -> gated, not transposed (transformers' layout)
    up_proj [E, I, H] (has_gate False)              -> not gated

Routing (the router, top-k, weight normalization), shared experts and the router's auxiliary loss stay as
the model computes them, outside the op. Experts the op cannot express (biases, a post-expert norm, a custom
gate, interleaved gate/up, an activation outside ``ACTIVATIONS``) keep transformers' grouped_mm path, which
the planner splits by experts' rows (``passes/strategies/experts.py``). ``keep_hf_experts`` turns the
substitution off in its scope (to plan that path on purpose).
"""
from __future__ import annotations

import contextlib
import sys

import torch

from autopar.ir.moe_op import ACTIVATIONS

IMPLEMENTATION = "autopar"
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "relu": "relu", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_new": "gelu_tanh"}
_DISABLED: list[bool] = []


@contextlib.contextmanager
def keep_hf_experts():
    """Within this scope, capture leaves HF experts on transformers' own grouped_mm path."""
    _DISABLED.append(True)
    try:
        yield
    finally:
        _DISABLED.pop()


def _activation(module) -> str | None:
    name = HF_ACTIVATIONS.get(str(getattr(module.config, "hidden_act", "")))
    return name if name in ACTIVATIONS else None


def expressible(module) -> bool:
    """Whether an HF experts module computes exactly what the op computes (module docstring)."""
    from transformers.integrations.moe import _default_apply_gate

    return (not module.has_bias and not module.has_post_expert_norm and module.is_concatenated
            and not module._is_expert_parallel and _activation(module) is not None
            and getattr(type(module), "_apply_gate", _default_apply_gate) is _default_apply_gate)


def hf_experts_forward(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """The "autopar" entry of transformers' ExpertsInterface: the experts as one ``moe_experts`` op."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    if not expressible(module):
        return grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    w_in = module.gate_up_proj if module.has_gate else module.up_proj
    return torch.ops.autopar.moe_experts(hidden_states, top_k_index, top_k_weights, w_in, module.down_proj,
                                         _activation(module), module.has_gate, module.is_transposed, None, 0)


def _experts_modules(model: torch.nn.Module) -> list:
    return [m for m in model.modules()
            if hasattr(m, "_is_expert_parallel") and hasattr(m, "has_gate") and hasattr(m, "config")]


@contextlib.contextmanager
def experts_as_op(model: torch.nn.Module):
    """Export-time scope in which ``model``'s HF experts call ``autopar::moe_experts`` (module docstring)."""
    if _DISABLED or "transformers" not in sys.modules:
        yield
        return
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, hf_experts_forward)
    configs = {id(m.config): m.config for m in _experts_modules(model)}
    saved = {key: config._experts_implementation for key, config in configs.items()}
    try:
        for config in configs.values():
            config._experts_implementation_internal = IMPLEMENTATION
        yield
    finally:
        for key, config in configs.items():
            config._experts_implementation_internal = saved[key]
