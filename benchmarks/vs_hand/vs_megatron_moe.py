"""The mixture-of-experts points of ``vs_megatron.py --simulate --suite moe``: which, the Mixtral-sized model,
and the summary against the goal.

Points: the GShard-style example (``examples/moe.py``) at Alpa's 8- and 16-GPU points on "p3.16xlarge", and a
Mixtral-8x7B-sized Hugging Face model (``examples.hf_causal_lm.MIXTRAL_8X7B``: hidden 4096, intermediate
14336, 8 experts top-2, GQA 32/8 heads, vocabulary 32000; sequence 4096) on 16 and 32 GPUs of "dgx-h100".
Both sides are scored by autopar's cost model; the hand side is the DP × EP × PP grid with all-to-all
dispatch (``autopar.baselines.hand_grids.moe_pins`` / ``mixtral_pins``).

Goal line: geometric mean over the points of autopar / best hand (throughput) against ``GOAL``, and the
smallest ratio (autopar / best hand ≥ 1.0 wanted at every point).
"""
from __future__ import annotations

import math

import torch

FAMILIES = ("moe", "mixtral")
POINTS = ["moe:2.4B:8:p3.16xlarge", "moe:10B:16:p3.16xlarge", "mixtral:8x7B:16:dgx-h100", "mixtral:8x7B:32:dgx-h100"]
GOAL = 1.5
SEQ = 4096


def mixtral(name: str, batch_size: int, dtype: torch.dtype) -> tuple[torch.nn.Module, tuple]:
    """(model on meta, (input_ids, labels) on meta): name "8x7B" has Mixtral's 32 layers, "8x7B-L<n>" n."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from examples.hf_causal_lm import MIXTRAL_8X7B, CausalLMLoss

    layers = int(name.split("-L")[1]) if "-L" in name else 32
    cfg = MixtralConfig(**MIXTRAL_8X7B, num_hidden_layers=layers, max_position_embeddings=SEQ, use_cache=False)
    with torch.device("meta"):
        model = CausalLMLoss(MixtralForCausalLM(cfg).to(dtype))
    # two tensors: export reads one tensor passed twice through one placeholder for both uses
    ids, labels = (torch.zeros(batch_size, SEQ, dtype=torch.long, device="meta") for _ in range(2))
    return model, (ids, labels)


def goal_line(ratios: list[float | None]) -> str:
    """'MoE points: geometric mean autopar / best hand G over n points, min M; goal 1.5x met/not met'."""
    ratios = [r for r in ratios if r is not None]
    if not ratios:
        return f"MoE points: none with both sides planned (goal {GOAL}x)"
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    verdict = "met" if geomean >= GOAL else "not met"
    return (f"MoE points: geometric mean autopar / best hand {geomean:.3f} over {len(ratios)} points, min "
            f"{min(ratios):.3f}; goal {GOAL}x {verdict}")
