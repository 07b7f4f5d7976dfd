"""Megatron-LM configurations of the GPT example as autopar plans, scored by autopar's own cost model.

    from autopar.baselines.megatron_configs import MegatronConfig, megatron_options, megatron_grid, best_megatron
    plan = autopar.plan(model, cluster, batch, **megatron_options(MegatronConfig(dp=2, tp=4, pp=2, microbatches=8),
                                                                   n_blocks=24, devices_per_node=8))

A config (dp, tp, pp, microbatches) becomes manual pipeline stages plus pins, so the simulated comparison
with ``autopar.plan``'s own choice is apples to apples (same cost model, same runtime model):

* stages: the blocks split evenly over pp stages (``layers=n_blocks`` makes layer l = block l; the
  embeddings ride with the first block, ln_f + lm_head + loss with the last, as Megatron places them);
  1F1B over ``microbatches``. With ``virtual_stages`` v > 1 (Megatron's interleaved schedule,
  --num-layers-per-virtual-pipeline-stage n_blocks/(pp·v)): the blocks split evenly over pp·v chunks,
  chunk j on the devices of stage j mod pp, autopar's schedule="interleaved"; Megatron requires pp > 1,
  pp·v dividing the blocks and microbatches a multiple of pp. Each stage's submesh holds dp·tp devices:
  (1, dp·tp) inside a node when dp·tp ≤ devices_per_node, else (dp·tp / devices_per_node,
  devices_per_node) whole nodes. Its logical mesh is (dp, tp) with tp on the inner axis, so tensor
  parallelism stays inside a node (tp ≤ 8).
* pins (spec text per mesh axis (dp, tp); an axis of size 1 is always "R"): Megatron's tensor parallelism
  (Shoeybi et al. 2019): q, k, v and mlp.fc column-parallel (nn.Linear weight [out, in] Shard(0) on tp,
  bias Shard(0)), attn.o and mlp.proj row-parallel (weight Shard(1), bias replicated), LayerNorms
  replicated, wte vocab-parallel (weight Shard(0)), lm_head column-parallel (Shard(0)), wpe replicated;
  inputs idx / targets Shard(0) over dp. Every weight is replicated over dp (the optimizer state too,
  unless the distributed optimizer shards it).
* recompute (``RECOMPUTE_LEVERS``): Megatron's --recompute-granularity, none, selective (the attention
  core of every block) or full (every block keeps only its input), as autopar's recompute option.
* distributed optimizer (Megatron's --use-distributed-optimizer): optimizer state and fp32 master weights
  sharded over the dp replicas, gradients reduce-scattered, parameters all-gathered after the step: autopar's
  ``zero=1``. It only matters when dp > 1, so the grid offers it only there.
* precision: every config of one grid runs under the same ``precision`` policy as the autopar plan it is
  compared with (Megatron trains in bf16 or fp16 with fp32 master weights; the benchmark picks one for both).

This is Megatron's weight layout, activations placed by the same ILP that plans autopar: the ILP may
only lower the cost of a given weight layout, so it can only help Megatron in the comparison.

Throughput uses Megatron's FLOP count per iteration (Narayanan et al. 2021, eq. 3 without activation
recomputation): F = 72·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) for global batch B, sequence s, l blocks,
hidden h, vocabulary V; throughput = F / step time.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

from autopar.baselines.hand_bounds import StepFloor
from autopar.baselines.hand_search import (
    UNBOUNDED_MEMORY,
    HandSearch,
    Scored,
    capture_once,
    precapture,
    score_options,
    search_hand,
)

TP_DEGREES = (1, 2, 4, 8)
# Megatron's --recompute-granularity: none, selective (attention core of every block), full (every block);
# as autopar recompute options (the blocks are the layers of a Megatron config's plan).
RECOMPUTE_LEVERS = {"none": "none", "selective": {"*": "selective"}, "full": "full"}
MAX_MICROBATCHES = 512  # autopar.planner.options.MAX_MICROBATCHES: the same range autopar searches
# Model chunks per device the grid offers when pp > 1 (and pp·v divides the blocks). The bubble shrinks as
# 1/v while the sends between devices grow as v, so the gain flattens fast; v = 2 and 4 keep the grid's size
# at about twice the pipelined layouts' (pass ``virtual_stages`` to widen it, up to interleave.MAX_VIRTUAL).
VIRTUAL_STAGES = (1, 2, 4)

# Megatron's tensor-parallel weight specs on the tp axis, by node-name glob (the dp axis is always R).
COLUMN = "S(0)"
ROW = "S(1)"
REPLICATED = "R"
TP_WEIGHT_SPECS = {
    "p_blocks_*_attn_[qkv]_weight": COLUMN, "p_blocks_*_attn_[qkv]_bias": COLUMN,
    "p_blocks_*_mlp_fc_weight": COLUMN, "p_blocks_*_mlp_fc_bias": COLUMN,
    "p_blocks_*_attn_o_weight": ROW, "p_blocks_*_attn_o_bias": REPLICATED,
    "p_blocks_*_mlp_proj_weight": ROW, "p_blocks_*_mlp_proj_bias": REPLICATED,
    "p_blocks_*_ln[12]_*": REPLICATED, "p_ln_f_*": REPLICATED,
    "p_wte_weight": COLUMN, "p_wpe_weight": REPLICATED, "p_lm_head_weight": COLUMN,
}
BATCH_INPUTS = ("idx", "targets")
# The same layout on Hugging Face Llama (as torchtitan's tensor-parallel plan): column-parallel q, k, v, gate, up;
# row-parallel o, down; vocabulary-parallel embedding and output; norms replicated (Llama has no biases).
LLAMA_TP_SPECS = {
    "p_*_self_attn_[qkv]_proj_weight": COLUMN, "p_*_mlp_gate_proj_weight": COLUMN, "p_*_mlp_up_proj_weight": COLUMN,
    "p_*_self_attn_o_proj_weight": ROW, "p_*_mlp_down_proj_weight": ROW, "p_*_embed_tokens_weight": COLUMN,
    "p_*lm_head_weight": COLUMN, "p_*norm_weight": REPLICATED,
}


@dataclasses.dataclass(frozen=True)
class ModelNames:
    """A model family's node names: tensor-parallel weight specs by glob, and the inputs split over dp."""

    weight_specs: dict
    batch_inputs: tuple[str, ...]


GPT_NAMES = ModelNames(TP_WEIGHT_SPECS, BATCH_INPUTS)  # examples.gpt
LLAMA_NAMES = ModelNames(LLAMA_TP_SPECS, ("input_ids", "labels"))  # HF LlamaForCausalLM behind a loss wrapper


@dataclasses.dataclass(frozen=True, kw_only=True)
class MegatronConfig:
    """dp batch replicas × tp tensor shards × pp pipeline stages (devices = dp·tp·pp), 1F1B over microbatches,
    interleaved over ``virtual_stages`` model chunks per device when that is above 1."""

    dp: int
    tp: int
    pp: int
    microbatches: int
    virtual_stages: int = 1  # Megatron's interleaved schedule: model chunks per device (1: plain 1F1B)
    recompute: str = "none"  # Megatron's activation recompute: "none", "selective" or "full" (RECOMPUTE_LEVERS)
    distributed_optimizer: bool = False  # Megatron's --use-distributed-optimizer: autopar's zero=1 over dp
    precision: str = "fp32"  # the precision policy shared with the autopar plan it is compared with

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    @classmethod
    def parse(cls, text: str, precision: str = "fp32") -> MegatronConfig:
        """The config ``str`` wrote as ``text`` ("dp2·tp2·pp8·v2·B256·rc-full·distopt"); ValueError otherwise."""
        fields = {"virtual_stages": 1, "recompute": "none", "distributed_optimizer": False}
        keys = {"dp": "dp", "tp": "tp", "pp": "pp", "v": "virtual_stages", "B": "microbatches"}
        for part in text.split("·"):
            if part == "distopt":
                fields["distributed_optimizer"] = True
            elif part.startswith("rc-") and part[3:] in RECOMPUTE_LEVERS:
                fields["recompute"] = part[3:]
            else:
                key = next((k for k in sorted(keys, key=len, reverse=True) if part.startswith(k)
                            and part[len(k):].isdigit()), None)
                if key is None:
                    raise ValueError(f"{text!r} is not a Megatron config as str() writes one: {part!r}")
                fields[keys[key]] = int(part[len(key):])
        config = cls(precision=precision, **fields)
        if str(config) != text:
            raise ValueError(f"{text!r} is not a Megatron config as str() writes one (read as {config})")
        return config

    def __str__(self) -> str:
        rc = f"·rc-{self.recompute}" if self.recompute != "none" else ""
        dist = "·distopt" if self.distributed_optimizer else ""
        virtual = f"·v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        return f"dp{self.dp}·tp{self.tp}·pp{self.pp}{virtual}·B{self.microbatches}{rc}{dist}"


def spec_text(config: MegatronConfig, dp_axis: str, tp_axis: str) -> str:
    """Spec text on the (dp, tp) mesh; an axis of size 1 is Replicate whatever was asked."""
    return (dp_axis if config.dp > 1 else "R") + (tp_axis if config.tp > 1 else "R")


def megatron_pins(config: MegatronConfig, names: ModelNames = GPT_NAMES) -> dict[str, str]:
    """{node-name glob: spec}: Megatron's weight layout (module docstring) and the dp split of the inputs."""
    pins = {glob: spec_text(config, "R", tp) for glob, tp in names.weight_specs.items()}
    pins.update({name: spec_text(config, "S(0)", "R") for name in names.batch_inputs})
    return pins


def block_ranges(n_blocks: int, pp: int) -> list[tuple[int, int]]:
    """[first, last] blocks of each stage (or chunk): an even split (pp divides n_blocks)."""
    if pp < 1 or n_blocks % pp:
        raise ValueError(f"{pp} pipeline stages (pp·virtual_stages) must divide the {n_blocks} blocks evenly")
    per = n_blocks // pp
    return [(s * per, (s + 1) * per - 1) for s in range(pp)]


def stage_submesh(devices: int, devices_per_node: int) -> list[int]:
    """[nodes, width] of a stage of ``devices``: inside one node when they fit, else whole nodes."""
    if devices <= devices_per_node:
        return [1, devices]
    if devices % devices_per_node:
        raise ValueError(f"a stage of {devices} devices spans nodes of {devices_per_node}: it must use whole nodes")
    return [devices // devices_per_node, devices_per_node]


def megatron_stages(config: MegatronConfig, n_blocks: int, devices_per_node: int) -> list[dict]:
    """The manual stage list of ``PlanOptions.stages`` (layers are blocks: plan with ``layers=n_blocks``):
    pp·v chunks, all on submeshes of the same shape (chunk j runs on the devices of stage j mod pp)."""
    width = config.dp * config.tp
    chunks = block_ranges(n_blocks, config.pp * config.virtual_stages)
    return [{"layers": [first, last], "submesh": stage_submesh(width, devices_per_node),
             "mesh": [config.dp, config.tp]} for first, last in chunks]


def megatron_options(config: MegatronConfig, n_blocks: int, devices_per_node: int,
                     names: ModelNames = GPT_NAMES) -> dict:
    """Keyword options of ``autopar.plan`` that express ``config``."""
    if config.tp > devices_per_node:
        raise ValueError(f"tp={config.tp} exceeds the {devices_per_node} devices of a node; Megatron keeps "
                         f"tensor parallelism inside a node")
    v = config.virtual_stages
    if v > 1 and (config.pp < 2 or config.microbatches % config.pp):
        raise ValueError(f"virtual_stages={v} needs pp > 1 and microbatches a multiple of pp (Megatron's "
                         f"interleaved schedule); got pp={config.pp}, microbatches={config.microbatches}")
    interleaved = {"schedule": "interleaved", "virtual_stages": v} if v > 1 else {"schedule": "1f1b"}
    return {"layers": n_blocks, "stages": megatron_stages(config, n_blocks, devices_per_node),
            "microbatches": config.microbatches, **interleaved, "pin": megatron_pins(config, names),
            "recompute": RECOMPUTE_LEVERS[config.recompute], "precision": config.precision,
            "zero": 1 if config.distributed_optimizer and config.dp > 1 else 0}


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one training iteration (module docstring): 72·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))."""
    return 72 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def gpt_flops(cfg, batch: int) -> float:
    """``megatron_flops`` for an examples.gpt.GPTConfig."""
    return megatron_flops(batch, cfg.seq_len, cfg.n_layer, cfg.n_embd, cfg.vocab_size)


def megatron_grid(n_devices: int, n_blocks: int, devices_per_node: int, global_batch: int, n_heads: int | None = None,
                  max_microbatches: int = MAX_MICROBATCHES,
                  recompute: tuple[str, ...] = tuple(RECOMPUTE_LEVERS),
                  distributed_optimizer: tuple[bool, ...] = (False, True),
                  precision: str = "fp32",
                  virtual_stages: tuple[int, ...] = VIRTUAL_STAGES) -> Iterator[MegatronConfig]:
    """Every config with dp·tp·pp = n_devices, tp ∈ {1, 2, 4, 8} ≤ devices_per_node (dividing n_heads),
    pp dividing n_blocks, stages that tile nodes, and microbatches = pp·2^k ≤ max_microbatches splitting the
    global batch so that every dp replica gets whole sequences (global_batch % (microbatches·dp) == 0),
    each with every recompute lever of ``recompute``, when dp > 1 every distributed-optimizer setting of
    ``distributed_optimizer``, and when pp > 1 every v of ``virtual_stages`` with pp·v dividing n_blocks
    (v = 1 is plain 1F1B; microbatches are multiples of pp, as interleaving needs); all under
    ``precision``. Ordered by (pp, tp, virtual stages, recompute, distributed optimizer, microbatches)."""
    for pp in [p for p in range(1, n_blocks + 1) if n_blocks % p == 0 and n_devices % p == 0]:
        for tp in [t for t in TP_DEGREES if t <= devices_per_node and (n_devices // pp) % t == 0]:
            if n_heads is not None and n_heads % tp:
                continue
            dp = n_devices // (pp * tp)
            width = dp * tp
            if width > devices_per_node and width % devices_per_node:
                continue
            for v in [v for v in virtual_stages if v == 1 or (pp > 1 and n_blocks % (pp * v) == 0)]:
                for rc in recompute:
                    for dist in sorted(set(distributed_optimizer) if dp > 1 else {False}):
                        yield from _microbatch_configs(dp, tp, pp, global_batch, max_microbatches, recompute=rc,
                                                       distributed_optimizer=dist, precision=precision,
                                                       virtual_stages=v)


# Mist's Megatron-LM baseline (Zhu et al., EuroSys'25, §7): full recompute and the distributed optimizer always,
# dp/tp/pp powers of two, micro-batch sizes 1, 2 or 4 sequences, plain 1F1B.
MIST_MICROBATCH_SIZES = (1, 2, 4)


def mist_grid(n_devices: int, n_blocks: int, devices_per_node: int, global_batch: int, n_heads: int | None = None,
              precision: str = "fp32") -> Iterator[MegatronConfig]:
    """``megatron_grid`` as Mist's baseline ran it (above): powers of two, full recompute, distributed
    optimizer where dp > 1, and global_batch / (dp · microbatches) in ``MIST_MICROBATCH_SIZES``."""
    for c in megatron_grid(n_devices, n_blocks, devices_per_node, global_batch, n_heads, recompute=("full",),
                           distributed_optimizer=(True,), precision=precision, virtual_stages=(1,)):
        powers = all(x & (x - 1) == 0 for x in (c.dp, c.tp, c.pp))
        if powers and global_batch // (c.dp * c.microbatches) in MIST_MICROBATCH_SIZES:
            yield c


def _microbatch_configs(dp: int, tp: int, pp: int, global_batch: int, max_microbatches: int,
                        **levers) -> Iterator[MegatronConfig]:
    """microbatches = pp·2^k ≤ max_microbatches while every dp replica gets whole sequences."""
    microbatches = pp
    while microbatches <= max_microbatches and global_batch % (microbatches * dp) == 0:
        yield MegatronConfig(dp=dp, tp=tp, pp=pp, microbatches=microbatches, **levers)
        microbatches *= 2


def score_config(graph, cluster, config: MegatronConfig, n_blocks: int, recapture=None,
                 time_limit: float = 60.0, names: ModelNames = GPT_NAMES) -> Scored:
    """``score_options`` of a Megatron config (``megatron_options``)."""
    options = megatron_options(config, n_blocks, cluster.devices_per_node, names)
    return score_options(graph, cluster, config, options, recapture, time_limit)


def config_floor(floor: StepFloor, config: MegatronConfig, n_blocks: int) -> float:
    """``StepFloor.floor`` of ``config``'s stages (``megatron_stages``): no plan of it is faster."""
    v = config.virtual_stages
    return floor.floor(block_ranges(n_blocks, config.pp * v), config.dp * config.tp, config.microbatches,
                       "interleaved" if v > 1 else "1f1b", v)


def best_megatron(model, cluster, batch, n_blocks: int, n_heads: int, patience: int = 2,
                  log=None, precision: str = "fp32", time_limit: float = 60.0, grid: str = "full",
                  names: ModelNames = GPT_NAMES, prune: bool = True) -> HandSearch:
    """``search_hand`` of ``megatron_grid`` scored by ``score_config``; with memory ignored only the configs
    without recompute are searched again (recompute adds a forward and saves only memory). A config's
    planning cost grows with its pipeline chunks (pp·v stage ILPs), which orders the layouts on the cores.
    ``time_limit``: each ILP solve's, in seconds (a solve that hits it scores the config "OOM"). ``grid``:
    "full" (``megatron_grid``) or "mist" (``mist_grid``: Mist's Megatron baseline). ``names``: the model
    family's node names (GPT_NAMES, LLAMA_NAMES)."""
    make = {"full": megatron_grid, "mist": mist_grid}[grid]
    grid = list(make(cluster.num_devices, n_blocks, cluster.devices_per_node, batch[0].shape[0], n_heads,
                     precision=precision))
    graph, recapture = capture_once(model, batch, precision)
    precapture(graph, recapture, {c.microbatches for c in grid})
    roomy = cluster.with_memory(UNBOUNDED_MEMORY)

    def score(config: MegatronConfig, unbounded: bool = False) -> Scored:
        return score_config(graph, roomy if unbounded else cluster, config, n_blocks, recapture, time_limit, names)

    step_floor = StepFloor(graph, cluster, n_blocks) if prune else None
    return search_hand(grid, score,
                       lambda c: (c.dp, c.tp, c.pp, c.virtual_stages, c.recompute, c.distributed_optimizer),
                       patience, log, memory_free=lambda c: c.recompute == "none",
                       cost=lambda c: c.pp * c.virtual_stages,
                       floor=(lambda c: config_floor(step_floor, c, n_blocks)) if prune else None)
