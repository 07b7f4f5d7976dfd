"""The speed level as a training step meets the machine: the reference mm beside a neighbour's training step.

    ρ = max(1, median over rounds i of t_ref(i | the others run a training step) / t_ref(i | they run the reference))
    every compute figure of the profile = its ratio to the reference · level · ρ          (CPU ranks, 2+ of them)

Every compute probe is timed as a ratio to the reference mm (``probes.SpeedReference``) and turned into seconds
at the level, the reference's median window; in those windows every other rank runs the reference too, a
cache-resident mm. In a training step every rank computes at once and its neighbours run a training step:
tensors larger than a core's cache stream through the shared last-level cache and memory, and a core's
compute slows beside them more than beside a mm (the 2-vCPU VM, idle, 2026-11-27: the reference beside the
fidelity GPT's data-parallel step ran 1.02-1.10× slower than beside the reference, beside an idle rank
0.98-1.01×). ρ carries that into every compute figure: a 2-rank step is then priced at the speed its ranks
meet while both compute, not at the speed of a core whose neighbour runs a small mm.

Method, on every rank, ``rounds`` rounds of three windows, each after a barrier: (1) every rank times the
reference; (2) the even ranks time it while the odd ranks run ``TrainingBlock`` forward + backward; (3) the
same with the roles swapped. The stepping ranks run for 1.5 windows, so the timed window lies inside their
step; rounds alternate the neighbours, so drift hits both sides alike. ρ of a rank is the median over rounds
of its window beside a step over its window beside the reference in that round; the profile takes the median
over ranks.
GPUs do not share compute between ranks: nothing is measured there (ρ = 1), and no preset carries it.
"""
from __future__ import annotations

import math
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from autopar.profiling.probes import SpeedReference, calls_per_window, slowest_rank, warm_up

# The neighbour's step: a GPT-style block, width 256, batch 8 × 128 tokens, fp32: its MLP's hidden
# activation (4 MiB) and its saved tensors (~20 MiB) are past a core's L2, like a training step's.
NEIGHBOUR_SHAPE = (8, 128, 256)  # batch, tokens, width
STEP_OVERLAP = 1.5  # the stepping ranks run this many timed windows' worth, so the window lies inside


class TrainingBlock(nn.Module):
    """A pre-norm transformer block (attention and a 4× MLP): the neighbour's training step."""

    def __init__(self, width: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return (x + self.down(F.gelu(self.up(self.ln2(x))))).sum()


def neighbour_step(device) -> object:
    """Forward + backward of ``TrainingBlock`` at ``NEIGHBOUR_SHAPE``, as a zero-argument call."""
    batch, tokens, width = NEIGHBOUR_SHAPE
    block, x = TrainingBlock(width).to(device), torch.randn(batch, tokens, width, device=device)
    return lambda: block(x).backward()


def measure_neighbour(settings, probe, reference: SpeedReference, rounds: int | None = None) -> dict:
    """This rank's reference windows (seconds per call) {"beside_reference": [...], "beside_step": [...]};
    empty on GPUs and on one rank (module docstring). Every rank must call it together."""
    world = dist.get_world_size()
    if probe.kind == "cuda" or world < 2:
        return {}
    step, me = neighbour_step(probe.torch), dist.get_rank()
    dist.barrier()
    step_s = slowest_rank(warm_up(step, settings.warmup, probe), probe)
    reference_s = slowest_rank(warm_up(reference.call, settings.warmup, probe), probe)
    reference_calls = calls_per_window(reference_s, settings, settings.probe_window_s)
    step_calls = max(1, math.ceil(STEP_OVERLAP * reference_calls * reference_s / step_s))
    out = {"beside_reference": [], "beside_step": []}
    for _ in range(rounds or 2 * settings.windows):
        dist.barrier()
        out["beside_reference"].append(probe.window_seconds(reference.call, reference_calls) / reference_calls)
        for timing_parity in (0, 1):
            dist.barrier()
            if me % 2 == timing_parity:
                out["beside_step"].append(probe.window_seconds(reference.call, reference_calls) / reference_calls)
            else:
                probe.window_seconds(step, step_calls)
    return out


def _rank_ratios(per_rank: list[dict]) -> list[float]:
    """Per rank, the median over rounds of its window beside a step over its window beside the reference in the
    same round (a rank times one of each per round: pairs a moment apart, so drift cancels)."""
    return [statistics.median(s / r for s, r in zip(rank["beside_step"], rank["beside_reference"]))
            for rank in per_rank if rank and rank.get("beside_step") and rank.get("beside_reference")]


def neighbour_factor(per_rank: list[dict]) -> float:
    """ρ: the median over ranks of ``_rank_ratios``, at least 1; 1 when not measured. A neighbour's step cannot
    make a core faster than a neighbour's mm does (beside an idle rank the reference runs at 0.98-1.01 of
    beside the reference): a lower reading is other jobs' load on the machine taking turns with the ranks,
    and is not carried into the figures."""
    ratios = _rank_ratios(per_rank)
    return max(1.0, statistics.median(ratios)) if ratios else 1.0


def neighbour_note(per_rank: list[dict]) -> str:
    """ρ and its windows, for the cluster's source line ("" when not measured)."""
    measured, ratios = [r for r in per_rank if r and r.get("beside_step")], _rank_ratios(per_rank)
    if not ratios:
        return ""
    return (f"; compute figures × {neighbour_factor(per_rank):.3f}, the reference's speed beside a neighbour's "
            f"training step over beside the reference (per rank {', '.join(f'{x:.3f}' for x in ratios)}; "
            f"{len(measured[0]['beside_step'])} windows each)")
