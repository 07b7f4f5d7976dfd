"""Hand-written Megatron-style layouts of the GPT example, built only from torch's own parallel libraries.

    python -m examples.megatron_baselines     # from the repo root: 3 training steps of every layout on 4 gloo ranks

These are the baselines autopar's plans must beat, written as a PyTorch user would write them today and
independently of autopar's codegen: data parallel through torch's ``replicate``, Megatron tensor
parallel (Shoeybi et al. 2019) through ``parallelize_module``, and 1F1B pipelines through
``torch.distributed.pipelining``. Ranks form a DeviceMesh of shape (pp, dp, tp), tp fastest, so the
chattiest axis (tp) holds neighbouring ranks, as Megatron places it inside a node.

Interface, used by the tests and the benchmarks (every call runs on every rank of an initialized group):

    hp = build(LAYOUTS["DP2xTP2"], model, example_batch, microbatches=4)
    loss = hp.train_step(idx, targets)   # every rank passes the global batch; the same float comes back
    torch.optim.AdamW(hp.parameters())    # the local shards (DTensor or plain tensors)
    hp.full_state_dict()                  # collective: model.state_dict()'s keys and shapes, on every rank

``train_step`` equals one step of single-device training on the global batch: the loss is the batch mean,
and the gradients left in the local parameters are shards of the batch-mean gradients.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from examples.gpt import GPTConfig, make_gpt

MESH_AXES = ("pp", "dp", "tp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """Degree of each mesh axis: pp pipeline stages, dp batch replicas, tp tensor shards (world = pp·dp·tp)."""

    pp: int = 1
    dp: int = 1
    tp: int = 1

    def __post_init__(self):
        for axis in MESH_AXES:
            degree = getattr(self, axis)
            if not isinstance(degree, int) or degree < 1:
                raise ValueError(f"Layout.{axis} must be a positive integer, got {degree!r}; use 1 for an unused axis")

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp


# On 4 ranks (ranks row-major over (pp, dp, tp)); every layout trains on the same global batch:
#   DP4      4 replicas of the whole model, each on a quarter of the batch; gradients all-reduced.
#   TP4      each block's heads and MLP width split 4 ways, wte and lm_head split by vocabulary.
#   DP2xTP2  2 replicas (half the batch each) of a 2-way tensor-parallel model.
#   PP2xDP2  2 stages (embeddings + blocks of the first half | the rest + ln_f + lm_head + loss), each
#            replicated twice over halves of the batch; 1F1B over the microbatches of each half.
#   PP2xTP2  2 stages, each 2-way tensor parallel; 1F1B over the microbatches of the whole batch.
#   PP4      4 stages (one block each with n_layer=4); 1F1B.
LAYOUTS = {
    "DP4": Layout(dp=4),
    "TP4": Layout(tp=4),
    "DP2xTP2": Layout(dp=2, tp=2),
    "PP2xDP2": Layout(pp=2, dp=2),
    "PP2xTP2": Layout(pp=2, tp=2),
    "PP4": Layout(pp=4),
}


def megatron_block_plan() -> dict[str, ParallelStyle]:
    """Megatron's transformer block: column-parallel q, k, v and fc, row-parallel o and proj.

    Heads are split across tp ranks (each rank's q/k/v shard holds n_head/tp whole heads, which the model's
    ``view(B, T, -1, head_dim)`` picks up) and so is the MLP's hidden width; each sublayer ends with one
    all-reduce in forward (the row-parallel output) and one in backward (the column-parallel input grad).
    LayerNorms stay replicated: their inputs are replicated, so their gradients agree on every tp rank.
    """
    return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}


def vocab_parallel_plan(module: nn.Module) -> dict[str, ParallelStyle]:
    """Megatron's vocabulary-parallel embedding and output layer, for whichever of them ``module`` holds.

    wte is split by vocabulary rows (each rank looks up its rows, an all-reduce sums the masked lookups);
    lm_head is split by vocabulary columns and its logits stay sharded (a DTensor) into the loss, which
    ``loss_parallel`` computes without gathering the (B, T, V) logits. wpe (positions) stays replicated.
    """
    plan = {}
    if hasattr(module, "wte"):
        plan["wte"] = RowwiseParallel(input_layouts=Replicate())
    if hasattr(module, "lm_head"):
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan


class GPTStage(nn.Module):
    """Blocks ``block_range`` of an ``examples.gpt.GPT``, with the embeddings if the range starts at block 0
    and ln_f + lm_head if it ends at the last block; ``forward`` returns activations, or logits on the last.

    It mirrors ``GPT.forward`` minus the loss (see ``next_token_loss``). Submodules are the model's own
    (shared, not copied) under the model's attribute names, and blocks keep their global index in a
    ModuleDict, so this stage's state_dict keys are a subset of the model's.
    """

    def __init__(self, model: nn.Module, block_range: range):
        super().__init__()
        self.is_first, self.is_last = block_range.start == 0, block_range.stop == len(model.blocks)
        if self.is_first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in block_range})
        if self.is_last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.drop(self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device)))
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.is_last else x


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """GPT.forward's loss: mean cross-entropy over every (batch, position)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def block_ranges(n_layer: int, stages: int) -> list[range]:
    """Contiguous, near-equal split of the blocks (earlier stages take the remainder, as they also embed)."""
    if n_layer < stages:
        raise ValueError(f"a {stages}-stage pipeline needs at least {stages} blocks, got n_layer={n_layer}; "
                         f"use fewer pipeline stages or a deeper model")
    base, extra = divmod(n_layer, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def make_mesh(layout: Layout) -> DeviceMesh:
    """The (pp, dp, tp) DeviceMesh over the current world; each axis' group inherits the world's timeout."""
    world = dist.get_world_size()
    if layout.world != world:
        raise ValueError(f"layout {layout} needs {layout.world} ranks, got a world of {world}; "
                         f"launch with nprocs={layout.world} or pick a layout whose degrees multiply to {world}")
    # init_device_mesh's subgroups otherwise get c10d's 30-minute default, not the world's timeout; it
    # takes a timeout only through backend options, whose gloo class is private (ProcessGroupGloo._Options).
    options = dist.ProcessGroupGloo._Options()
    options._timeout = world_timeout()
    return init_device_mesh("cpu", (layout.pp, layout.dp, layout.tp), mesh_dim_names=MESH_AXES,
                            backend_override={axis: ("gloo", options) for axis in MESH_AXES})


def world_timeout() -> datetime.timedelta:
    """The default group's collective timeout (set by ``autopar.launch`` or ``init_process_group``).

    c10d has no public getter for it, so this reads the default group's backend options."""
    return dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a local value: a DTensor is gathered over its mesh (collective)."""
    return tensor.full_tensor().detach() if isinstance(tensor, DTensor) else tensor.detach().clone()


class HandParallel:
    """This rank's part of a hand-parallelized GPT: its pipeline stage (the whole model when pp = 1) with
    tensor-parallel shards over tp, replicated over dp, and driven by a 1F1B schedule when pp > 1."""

    def __init__(self, layout: Layout, mesh: DeviceMesh, stage: nn.Module, state_names: list[str],
                 pipeline: tuple[PipelineStage, Schedule1F1B] | None):
        self.layout, self.mesh, self.stage, self.state_names = layout, mesh, stage, state_names
        self.pipeline_stage, self.schedule = pipeline or (None, None)

    def train_step(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward and backward of this rank's share of the global batch; returns the global batch-mean loss."""
        idx, targets = self._dp_share(idx), self._dp_share(targets)
        with loss_parallel() if self.layout.tp > 1 else contextlib.nullcontext():
            local_loss = self._pipeline_step(idx, targets) if self.schedule else self._whole_model_step(idx, targets)
        return self._global_mean(local_loss)

    def parameters(self) -> list[torch.Tensor]:
        """The parameters this rank updates (its stage's): DTensors, sharded over tp and replicated over dp."""
        return list(self.stage.parameters())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every rank gets the full model.state_dict() (same keys, order and shapes).

        Stages exchange their tensors with all_gather_object (pickled), fine for tests and checkpoints of
        small models; a large model would save per-stage shards with torch.distributed.checkpoint instead.
        """
        local = {name: full_value(t) for name, t in self.stage.state_dict().items()}
        if self.layout.pp > 1:
            parts = [None] * self.layout.pp
            dist.all_gather_object(parts, local, group=self.mesh["pp"].get_group())
            local = {name: t for part in parts for name, t in part.items()}
        return {name: local[name] for name in self.state_names}

    def _dp_share(self, batch: torch.Tensor) -> torch.Tensor:
        share = batch.shape[0] // self.layout.dp
        start = self.mesh.get_local_rank("dp") * share
        return batch[start:start + share]

    def _whole_model_step(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.stage(idx, targets)
        loss.backward()
        return full_value(loss)

    def _pipeline_step(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """One 1F1B step. Schedule1F1B divides the gradients by the microbatch count (scale_grads=True), so
        with equal microbatches they are the whole share's, and the mean microbatch loss is its loss."""
        first, last = self.pipeline_stage.is_first, self.pipeline_stage.is_last
        losses: list[torch.Tensor] = []
        self.schedule.step(*((idx,) if first else ()), target=targets if last else None,
                           losses=losses if last else None)
        return torch.stack([full_value(loss) for loss in losses]).mean() if last else None

    def _global_mean(self, local_loss: torch.Tensor | None) -> float:
        """Send the last stage's loss along pp (the other stages add 0), then average the dp replicas."""
        value = torch.zeros(()) if local_loss is None else local_loss.detach().clone()
        if self.layout.pp > 1:
            dist.all_reduce(value, group=self.mesh["pp"].get_group())
        if self.layout.dp > 1:
            dist.all_reduce(value, group=self.mesh["dp"].get_group())
            value /= self.layout.dp
        return value.item()


def check_fits(layout: Layout, model: nn.Module, example_batch: tuple[torch.Tensor, torch.Tensor],
               microbatches: int) -> None:
    """Every tp rank gets whole heads; every dp replica, and every pipeline microbatch, equal batch shares."""
    if model.cfg.n_head % layout.tp:
        raise ValueError(f"{layout.tp}-way tensor parallelism splits whole heads, got n_head={model.cfg.n_head}; "
                         f"use a tp degree that divides n_head")
    batch = example_batch[0].shape[0]
    pieces = layout.dp * (microbatches if layout.pp > 1 else 1)
    if batch % pieces:
        raise ValueError(f"layout {layout} with {microbatches} microbatches splits the batch into {pieces} equal "
                         f"pieces, got batch size {batch}; use a batch size divisible by {pieces}")
    if layout.pp > 1 and microbatches < layout.pp:
        raise ValueError(f"1F1B over {layout.pp} stages needs at least {layout.pp} microbatches, "
                         f"got {microbatches}; pass microbatches >= {layout.pp}")


def build(layout: Layout, model: nn.Module, example_batch: tuple[torch.Tensor, torch.Tensor],
          microbatches: int = 1, *, block_plan: dict[str, ParallelStyle] | None = None) -> HandParallel:
    """Parallelize ``model`` (an examples.gpt.GPT with the same weights on every rank) for ``layout``.

    Collective: call on every rank. Shards ``model`` in place (pass a copy to keep the original); a
    pipeline rank uses only its stage's modules. ``microbatches`` is used by pipelines only;
    ``block_plan`` replaces megatron_block_plan() (keys relative to a block), e.g. to test a variant.
    """
    check_fits(layout, model, example_batch, microbatches)
    mesh = make_mesh(layout)
    state_names = list(model.state_dict())
    stage = model
    if layout.pp > 1:
        stage = GPTStage(model, block_ranges(len(model.blocks), layout.pp)[mesh.get_local_rank("pp")])
    if layout.tp > 1:
        plan = {f"blocks.*.{name}": style for name, style in (block_plan or megatron_block_plan()).items()}
        parallelize_module(stage, mesh["tp"], {**plan, **vocab_parallel_plan(stage)})
    if layout.dp > 1:
        replicate_over_dp(stage, mesh["dp"])
    pipeline = None
    if layout.pp > 1:
        pipeline_stage = PipelineStage(stage, mesh.get_local_rank("pp"), layout.pp, torch.device("cpu"),
                                       group=mesh["pp"].get_group())
        pipeline = pipeline_stage, Schedule1F1B(pipeline_stage, microbatches, loss_fn=next_token_loss)
    return HandParallel(layout, mesh, stage, state_names, pipeline)


def replicate_over_dp(stage: nn.Module, dp_mesh: DeviceMesh) -> None:
    """Data parallel: replicas of ``stage`` whose gradients are all-reduced (averaged) over ``dp_mesh``.

    Each block's gradients get their own all-reduce, issued when that block's backward ends (like DDP's
    buckets), and the root's all-reduce takes the remaining parameters; under a pipeline, pipelining
    defers them to the last microbatch. ``replicate`` is torch's DDP rebuilt on FSDP2 (still under the
    private torch.distributed._composable in 2.13). Not DistributedDataParallel: in torch 2.13,
    DDP(device_mesh=...) over tp-sharded (DTensor) parameters turns them into plain attributes at the
    first forward, so they vanish from parameters() and state_dict().
    """
    blocks = stage.blocks.values() if isinstance(stage.blocks, nn.ModuleDict) else stage.blocks
    for block in blocks:
        replicate(block, mesh=dp_mesh)
    replicate(stage, mesh=dp_mesh)


def demo_model():
    """The demo's GPT (4 blocks, 4 heads) and its batch of 8 sequences, the same on every rank."""
    return make_gpt(GPTConfig(n_layer=4), batch_size=8)


def train_losses(step, params, batch, steps: int) -> list[float]:
    """Losses of ``steps`` AdamW steps, each ``step(*batch)`` leaving gradients in ``params``."""
    opt = torch.optim.AdamW(params, lr=1e-3)
    losses = []
    for _ in range(steps):
        losses.append(float(step(*batch)))
        opt.step()
        opt.zero_grad()
    return losses


def layout_losses(rank: int, names: list[str], steps: int = 3) -> dict[str, list[float]]:
    """Per layout name, the demo's losses trained on the current world (run on every rank)."""
    losses = {}
    for name in names:
        model, batch = demo_model()
        hp = build(LAYOUTS[name], model, batch, microbatches=4)
        losses[name] = train_losses(hp.train_step, hp.parameters(), batch, steps)
    return losses


def single_device_losses(steps: int = 3) -> list[float]:
    model, batch = demo_model()

    def step(idx, targets):
        loss = model(idx, targets)
        loss.backward()
        return loss.item()

    return train_losses(step, model.parameters(), batch, steps)


if __name__ == "__main__":
    from autopar.launch import launch

    rows = {"single": single_device_losses(), **launch(layout_losses, 4, list(LAYOUTS))[0]}
    for name, losses in rows.items():
        print(f"{name:8s}", "  ".join(f"{loss:.6f}" for loss in losses))
