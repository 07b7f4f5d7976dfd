"""Small models for the tests: an MLP, the GPT example, and Hugging Face GPT-2 built from a config.

Each factory returns (model, example_inputs) with deterministic weights and data; every model's forward
returns the scalar loss. Dropout is 0 everywhere, so a sharded run can match a single device exactly.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.gpt import GPTConfig, make_gpt
from tests.zoo_models import ZOO


class MLP(nn.Module):
    def __init__(self, d_in=32, hidden=128, d_out=16):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d_out)

    def forward(self, x, y):
        h = F.gelu(self.fc2(F.gelu(self.fc1(x))))
        return F.mse_loss(self.fc3(h), y)


def make_mlp(batch_size: int = 16, seed: int = 0):
    torch.manual_seed(seed)
    model = MLP()
    g = torch.Generator().manual_seed(seed)
    return model, (torch.randn(batch_size, 32, generator=g), torch.randn(batch_size, 16, generator=g))


def make_small_gpt(batch_size: int = 8, seed: int = 0, **overrides):
    return make_gpt(GPTConfig(**{"n_layer": 2, **overrides}), batch_size=batch_size, seed=seed)


class HFLoss(nn.Module):
    """A transformers causal LM whose forward returns ``.loss`` (the contract autopar trains)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, labels):
        return self.lm(input_ids=input_ids, labels=labels).loss


def make_hf_gpt2(batch_size: int = 8, seed: int = 0, n_layer: int = 2, n_embd: int = 64, seq: int = 32,
                 vocab: int = 256):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=vocab, n_positions=seq, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = HFLoss(GPT2LMHeadModel(cfg))
    ids = torch.randint(0, vocab, (batch_size, seq), generator=torch.Generator().manual_seed(seed))
    return model, (ids, ids.clone())


def make_long_gpt(causal: bool = True, seed: int = 0):
    """The GPT example at sequence 256 (context-parallel parity), narrow so that a step stays cheap."""
    return make_small_gpt(batch_size=2, seed=seed, seq_len=256, n_embd=32, vocab_size=64, causal=causal)


def make_long_llama(seed: int = 0):
    """A tiny HF Llama (GQA, rotary positions) at sequence 256: its SDPA gets the materialized causal mask."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, attention_dropout=0.0, use_cache=False)
    torch.manual_seed(seed)
    model = HFLoss(LlamaForCausalLM(cfg))
    ids = torch.randint(0, 64, (2, 256), generator=torch.Generator().manual_seed(seed))
    return model, (ids, ids.clone())


def make_olmoe(seed: int = 0, **extra):
    """A tiny HF OLMoE (4 experts top-2, q/k norms), the zoo's sizes."""
    from transformers import OlmoeConfig

    from tests.zoo_models import _DECODER, _lm

    cfg = OlmoeConfig(**{**_DECODER, "intermediate_size": 64}, **{**dict(num_key_value_heads=4, num_experts=4,
                      num_experts_per_tok=2, router_aux_loss_coef=0.0), **extra})
    return _lm("OlmoeForCausalLM", cfg, seed)


ROUTER_AUX = dict(output_router_logits=True, router_aux_loss_coef=0.1)  # loss + 0.1 × load-balancing loss


def router_aux_variants() -> dict:
    """The HF MoE models trained on their loss plus the router's auxiliary load-balancing loss ("_aux")."""
    from tests.zoo_models import mixtral, qwen2_moe

    return {f"{name}_aux": (lambda seed=0, make=make: make(seed, **ROUTER_AUX))
            for name, make in (("zoo_mixtral", mixtral), ("zoo_qwen2_moe", qwen2_moe), ("olmoe", make_olmoe))}


def make_small_moe(seed: int = 0, capacity_factor: float | None = 1.0):
    """The GShard-style MoE example (examples/moe.py): 2 blocks, 4 experts, capacity 1.0 by default."""
    from examples.moe import MoEConfig, make_moe

    return make_moe(MoEConfig(capacity_factor=capacity_factor), batch_size=4, seed=seed)


FACTORIES = {"mlp": make_mlp, "gpt": make_small_gpt, "gpt4": lambda: make_small_gpt(n_layer=4), "hf_gpt2": make_hf_gpt2,
             "gpt_long": make_long_gpt, "gpt_long_bidir": lambda: make_long_gpt(causal=False),
             "llama_long": make_long_llama,
             "olmoe": make_olmoe, "moe_example": make_small_moe, **{f"zoo_{k}": v for k, v in ZOO.items()},
             **router_aux_variants()}
