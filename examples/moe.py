"""A GShard-style mixture-of-experts transformer: every second block's MLP is a top-2 routed MoE layer.

    python examples/moe.py      # builds the tiny config and prints its loss on random tokens

The MoE layer follows GShard (Lepikhin et al. 2021, Algorithm 1) as Alpa's benchmark model does (Zheng et
al., OSDI'22 §8.1): the tokens are cut into G groups of S tokens; a gate [M, E] scores every expert; each
token goes to its two best experts (weights: the two gates, normalized), each expert taking at most
C = ⌈capacity_factor · 2S / E⌉ assignments per group of S tokens, first choices before second ones (later
ones overflow and skip the layer: the residual carries them). The experts are one call of
``autopar.moe.moe_experts`` (the op ``autopar::moe_experts``):

    y[t] = Σ_j weight[t, j] · relu(x[t] @ w_in[e_j]) @ w_out[e_j]          (e_j = index[t, j], kept ones)

which the planner splits by experts with all-to-all dispatch (expert parallelism: each token row travels to
its experts' devices and back), by gathered tokens, by tokens alone, or inside each expert.
The auxiliary load-balancing loss (GShard: E · Σ_e mean_s(gate_e) · mean_s(top1_e))
is added to the language-model loss with weight ``aux_weight``.

``MOE_SUITE`` is Alpa's MoE suite (OSDI'22 Table 4; benchmark/alpa/suite_manual_moe.py): seq 1024, vocab
32000, 16 heads, expert group size 2048, global batch 1024, fp16.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.moe import moe_experts
from examples.gpt import CausalSelfAttention, GPTConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """GPTConfig's fields plus: n_expert experts per MoE layer, group_size tokens per routing group (must
    divide batch·seq_len), capacity_factor (expert capacity C = ⌈factor · 2 · group_size / n_expert⌉),
    aux_weight of the load-balancing loss."""

    vocab_size: int = 256
    seq_len: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    n_expert: int = 4
    group_size: int = 32
    capacity_factor: float = 1.0
    ffn_mult: int = 4
    aux_weight: float = 0.01

    @property
    def gpt(self) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab_size, seq_len=self.seq_len, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd)

    @property
    def capacity(self) -> int:
        return math.ceil(self.capacity_factor * 2 * self.group_size / self.n_expert)

    @property
    def n_params(self) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in MoETransformer(self).parameters())


# Alpa's MoE suite: name -> (hidden, layers, experts); seq 1024, vocab 32000, 16 heads, group size 2048, FFN
# width 8·hidden. Alpa ties the embedding and the output layer; this model does not (V·H more parameters).
MOE_SUITE = {
    "380M": (768, 8, 8),
    "690M": (768, 8, 16),
    "1.3B": (768, 16, 16),
    "2.4B": (1024, 16, 16),
    "10B": (1536, 16, 32),
    "27B": (2048, 16, 48),
    "70B": (2048, 32, 64),
}


def suite_config(name: str) -> MoEConfig:
    hidden, layers, experts = MOE_SUITE[name]
    return MoEConfig(vocab_size=32000, seq_len=1024, n_layer=layers, n_head=16, n_embd=hidden, n_expert=experts,
                     group_size=2048, ffn_mult=8)


class MoELayer(nn.Module):
    """Top-2 gated experts (module docstring); forward(x [B, T, M]) -> (y [B, T, M], aux loss)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        M, E, H = cfg.n_embd, cfg.n_expert, cfg.ffn_mult * cfg.n_embd
        self.gate = nn.Parameter(torch.randn(M, E) * 0.02)
        self.w_in = nn.Parameter(torch.randn(E, M, H) * 0.02)
        self.w_out = nn.Parameter(torch.randn(E, H, M) * 0.02)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, M = x.shape
        tokens = x.reshape(B * T, M)
        gates = (tokens @ self.gate).softmax(dim=-1)                          # [B·T, E]
        top2, index = gates.topk(2, dim=-1)
        weights = top2 / (top2.sum(dim=-1, keepdim=True) + torch.finfo(gates.dtype).eps)
        y = moe_experts(tokens, index, weights, self.w_in, self.w_out, activation="relu",
                        capacity_factor=self.cfg.capacity_factor, group_size=self.cfg.group_size)
        return y.reshape(B, T, M), self.aux_loss(gates, index[:, 0])

    def aux_loss(self, gates: torch.Tensor, top1: torch.Tensor) -> torch.Tensor:
        """GShard's load-balancing loss: E · Σ_e mean over a group(gate_e) · mean over a group(top-1 is e),
        averaged over the groups."""
        E, S = self.cfg.n_expert, self.cfg.group_size
        grouped = gates.float().reshape(-1, S, E)
        chosen = F.one_hot(top1, E).float().reshape(-1, S, E)
        return E * (grouped.mean(dim=1) * chosen.mean(dim=1)).sum(dim=-1).mean()


class DenseFFN(nn.Module):
    """The dense blocks' MLP: n_embd -> ffn_mult·n_embd -> relu -> n_embd (the experts' shape)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.ffn_mult * cfg.n_embd)
        self.proj = nn.Linear(cfg.ffn_mult * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.relu(self.fc(x)))


class MoEBlock(nn.Module):
    """A transformer block whose MLP is an MoE layer when ``moe``; forward returns (x, aux loss or None)."""

    def __init__(self, cfg: MoEConfig, moe: bool):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg.gpt)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.ffn = MoELayer(cfg) if moe else DenseFFN(cfg)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self.attn(self.ln1(x))
        if isinstance(self.ffn, MoELayer):
            y, aux = self.ffn(self.ln2(x))
            return x + y, aux
        return x + self.ffn(self.ln2(x)), None


class MoETransformer(nn.Module):
    """Decoder-only LM with an MoE FFN in every second block; forward(idx, targets) -> loss (+ aux)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(MoEBlock(cfg, moe=i % 2 == 1) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        aux = []
        for block in self.blocks:
            x, block_aux = block(x)
            if block_aux is not None:
                aux.append(block_aux)
        loss = F.cross_entropy(self.lm_head(self.ln_f(x)).flatten(0, 1), targets.flatten())
        return loss + self.cfg.aux_weight * sum(aux) if aux else loss


def make_batch(cfg: MoEConfig, batch_size: int, *, seed: int = 0, device: str | torch.device = "cpu"):
    """Random (idx, targets) of shape (batch_size, seq_len); batch_size·seq_len must split into groups."""
    if (batch_size * cfg.seq_len) % cfg.group_size:
        raise ValueError(f"batch {batch_size} × seq {cfg.seq_len} tokens do not split into groups of "
                         f"{cfg.group_size}; pick a batch size that does")
    if str(device) == "meta":
        shape = (batch_size, cfg.seq_len)
        return torch.empty(shape, dtype=torch.long, device="meta"), torch.empty(shape, dtype=torch.long, device="meta")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len), generator=g)
    return idx.to(device), torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len), generator=g).to(device)


def make_moe(cfg: MoEConfig | None = None, *, batch_size: int = 8, seed: int = 0):
    """Factory for the CLI and the tests: (model, (idx, targets)) with deterministic weights."""
    cfg = cfg or MoEConfig()
    torch.manual_seed(seed)
    return MoETransformer(cfg), make_batch(cfg, batch_size, seed=seed)


if __name__ == "__main__":
    model, batch = make_moe()
    print(f"MoE {model.cfg}: {model.cfg.n_params} parameters, loss {model(*batch).item():.4f}")
