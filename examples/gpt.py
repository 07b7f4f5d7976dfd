"""A small GPT (nanoGPT-style) used by the demo, the tests and the benchmarks.

    python examples/gpt.py        # builds the tiny config and prints its loss on random tokens

The model returns the scalar training loss from ``forward(idx, targets)``, which is the contract
``autopar.compile`` trains. Attention uses separate q/k/v projections and infers the number of heads
from the tensor (``view(B, T, -1, head_dim)``), so a tensor-parallel layout that shards heads needs
no change to the model: the hand-written Megatron baselines in ``benchmarks/`` rely on that.

``GPT_SUITE`` is Alpa's GPT benchmark suite (Zheng et al., OSDI'22, Table 4): parameter count ->
(hidden, layers, heads), sequence 1024, vocabulary 51200.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a GPT model.

    vocab_size: tokens in the vocabulary.  seq_len: context length (positional table size).
    n_layer / n_head / n_embd: depth, attention heads, hidden width (n_embd % n_head == 0).
    dropout: probability for every dropout; 0 gives bit-reproducible training (parity tests use 0).
    attention: "sdpa" (one fused scaled_dot_product_attention call) or "materialized" (scores, causal mask,
      softmax and the value product as separate ops, as Megatron-LM and Alpa's GPT ran them).
    causal: each token attends to earlier ones only (a language model); False attends both ways (an encoder).
    """

    vocab_size: int = 256
    seq_len: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    attention: str = "sdpa"
    causal: bool = True

    def __post_init__(self):
        if self.attention not in ("sdpa", "materialized"):
            raise ValueError(f"attention must be 'sdpa' or 'materialized', got {self.attention!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")

    @property
    def n_params(self) -> int:
        """Parameter count: embeddings + 12·h² + 12·h per block (q,v,o,fc,proj biases, 2 LNs) + head."""
        h = self.n_embd
        per_block = 12 * h * h + 12 * h
        return (self.vocab_size + self.seq_len) * h + self.n_layer * per_block + 2 * h + self.vocab_size * h


# Alpa OSDI'22 Table 4: name -> (hidden, layers, heads); seq 1024, vocab 51200.
GPT_SUITE = {
    "350M": (1024, 24, 16),
    "1.3B": (2048, 24, 32),
    "2.6B": (2560, 32, 32),
    "6.7B": (4096, 32, 32),
    "15B": (5120, 48, 40),
    "39B": (8192, 48, 64),
}


# Megatron-LM SC'21 Table 1 (Narayanan et al. 2021; NVIDIA/Megatron-LM examples/sc21/run_table_1.sh), the rows
# that use plain 1F1B: name -> (hidden, layers, heads, global batch, GPUs); seq 2048, vocab 51200, DGX A100.
SC21_TABLE1 = {
    "1.7B": (2304, 24, 24, 512, 32),
    "3.6B": (3072, 30, 32, 512, 64),
    "7.5B": (4096, 36, 32, 512, 128),
    "18B": (6144, 40, 48, 1024, 256),
    "39B": (8192, 48, 64, 1536, 512),
}


def sc21_config(name: str) -> GPTConfig:
    """The GPTConfig of one row of ``SC21_TABLE1`` (sequence 2048, vocabulary 51200)."""
    hidden, layers, heads, _, _ = SC21_TABLE1[name]
    return GPTConfig(vocab_size=51200, seq_len=2048, n_layer=layers, n_head=heads, n_embd=hidden)


# GPT-3 175B (Brown et al. 2020, Table 2.1): 96 layers, hidden 12288, 96 heads, context 2048.
GPT3_175B = GPTConfig(vocab_size=51200, seq_len=2048, n_layer=96, n_head=96, n_embd=12288)


def suite_config(name: str, *, vocab_size: int = 51200, seq_len: int = 1024) -> GPTConfig:
    """The GPTConfig of one point of Alpa's GPT suite (see GPT_SUITE), or "175B" for GPT-3."""
    if name == "175B":
        return GPT3_175B
    hidden, layers, heads = GPT_SUITE[name]
    return GPTConfig(vocab_size=vocab_size, seq_len=seq_len, n_layer=layers, n_head=heads, n_embd=hidden)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd)
        # No key bias: softmax ignores a per-query constant, so a key bias has zero gradient (as in Whisper).
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.o = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout
        self.materialized = cfg.attention == "materialized"
        self.causal = cfg.causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        if self.materialized:
            scores = (q * self.head_dim**-0.5) @ k.transpose(-2, -1)
            future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1 if self.causal else T)
            y = F.dropout(scores.masked_fill(future, float("-inf")).softmax(-1), p) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.o(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets)`` returns the mean next-token cross-entropy."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.device.type != "meta":
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_batch(cfg: GPTConfig, batch_size: int, *, seed: int = 0, device: str | torch.device = "cpu"):
    """Random (idx, targets) token batch of shape (batch_size, seq_len); deterministic for a seed."""
    if str(device) == "meta":
        shape = (batch_size, cfg.seq_len)
        return torch.empty(shape, dtype=torch.long, device="meta"), torch.empty(shape, dtype=torch.long, device="meta")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len), generator=g)
    return idx.to(device), targets.to(device)


def make_gpt(cfg: GPTConfig | None = None, *, batch_size: int = 8, seed: int = 0):
    """Factory for the CLI and the demo: returns (model, (idx, targets)) with deterministic weights."""
    cfg = cfg or GPTConfig()
    torch.manual_seed(seed)
    return GPT(cfg), make_batch(cfg, batch_size, seed=seed)


def make_suite_gpt(name: str = "2.6B", *, batch_size: int = 1024):
    """Factory for planning only: Alpa's GPT suite model ``name`` in fp16 on the meta device (no memory),
    with a global batch of ``batch_size`` sequences. ``autopar plan examples/gpt.py:make_suite_gpt ...``"""
    cfg = suite_config(name)
    with torch.device("meta"):
        model = GPT(cfg).half()
    return model, make_batch(cfg, batch_size, device="meta")


if __name__ == "__main__":
    model, batch = make_gpt()
    loss = model(*batch)
    print(f"GPT {model.cfg}: {sum(p.numel() for p in model.parameters())} parameters, "
          f"loss {loss.item():.4f} (ln V = {math.log(model.cfg.vocab_size):.4f})")
