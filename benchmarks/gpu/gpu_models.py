"""Models of the GPU check (``gpu_check.py``): the GPT example and a Hugging Face Llama at parity sizes
(seconds per step on one GPU) and at plan sizes (a GPU's worth of work: hundreds of millions to a billion
parameters), each with a ``--tiny`` size for a dry run on CPU ranks. Weights and data are deterministic."""
from __future__ import annotations

import torch

from examples.gpt import GPTConfig, make_gpt
from examples.hf_causal_lm import CausalLMLoss

GPT_SIZES = {  # name -> (GPTConfig, global batch)
    "gpt-parity": (GPTConfig(vocab_size=512, seq_len=128, n_layer=4, n_head=8, n_embd=256), 8),
    "gpt-s": (GPTConfig(vocab_size=8192, seq_len=512, n_layer=8, n_head=8, n_embd=512), 16),
    "gpt-m": (GPTConfig(vocab_size=50304, seq_len=1024, n_layer=12, n_head=16, n_embd=1024), 8),
    "gpt-l": (GPTConfig(vocab_size=50304, seq_len=1024, n_layer=16, n_head=16, n_embd=2048), 8),
}
TINY_GPT = (GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, n_embd=64), 4)
LLAMA_SIZES = {  # name -> (LlamaConfig keywords, sequence, global batch)
    "llama-parity": (dict(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=2), 128, 8),
    "llama-1b": (dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=4), 1024, 8),
}
TINY_LLAMA = (dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2), 16, 4)

# The plans of sections 3-5: (model, precision, recompute); "plain" also times the model without autopar,
# "torch_compile" also the generated module under torch.compile (last: its first step compiles for a minute).
PLAN_CASES = [
    dict(model="gpt-s", precision="fp32", recompute="none", plain=True),
    dict(model="gpt-s", precision="bf16", recompute="none", plain=True),
    dict(model="gpt-m", precision="fp32", recompute="none"),
    dict(model="gpt-m", precision="bf16", recompute="none", plain=True),
    dict(model="gpt-m", precision="bf16", recompute="full"),
    dict(model="gpt-l", precision="bf16", recompute="none", plain=True),
    dict(model="gpt-l", precision="bf16", recompute="full"),
    dict(model="llama-1b", precision="bf16", recompute="none", plain=True),
    dict(model="llama-1b", precision="bf16", recompute="auto"),
    dict(model="gpt-s", precision="bf16", recompute="none", torch_compile=True),
]


def model_for(name: str, tiny: bool, parity: bool):
    """(model, batch) on the CPU for ``name`` ("gpt"/"llama" with parity=True, else a PLAN_CASES name)."""
    key = f"{name}-parity" if parity else name
    if key.startswith("gpt"):
        cfg, batch = TINY_GPT if tiny else GPT_SIZES[key]
        return make_gpt(cfg, batch_size=batch)
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs, seq, batch = TINY_LLAMA if tiny else LLAMA_SIZES[key]
    torch.manual_seed(0)
    cfg = LlamaConfig(**kwargs, max_position_embeddings=2 * seq, use_cache=False, attention_dropout=0.0)
    model = CausalLMLoss(LlamaForCausalLM(cfg))
    ids = torch.randint(0, kwargs["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, (ids, ids.clone())


def to_device(batch, device: str) -> tuple:
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in batch)
