"""Hugging Face causal language models as autopar models: ``forward(input_ids, labels) -> loss``.

Shared by the planning benchmarks (``benchmarks/plan_time``, ``benchmarks/experts``) and the MoE planner
tests, which build published configs on the meta device (no weights are downloaded).
"""
from __future__ import annotations

import torch

# Mixtral-8x7B's published config (mistralai/Mixtral-8x7B-v0.1): hidden, intermediate, GQA 32/8 heads,
# vocabulary, 8 experts with top-2 routing; the router's auxiliary loss is off so the loss is the LM loss.
MIXTRAL_8X7B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                    vocab_size=32000, num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.0)


class CausalLMLoss(torch.nn.Module):
    """A transformers causal LM whose forward(input_ids, labels) returns the loss."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, labels):
        return self.lm(input_ids=input_ids, labels=labels).loss
