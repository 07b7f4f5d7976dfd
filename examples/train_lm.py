"""Train a Hugging Face causal LM with autopar: data per rank, checkpoints, resume on any number of ranks.

    python examples/train_lm.py --data DIR_OR_FILES --nprocs 2 --steps 20 --out run/   # autopar.launch
    torchrun --nproc-per-node 4 examples/train_lm.py --data corpus/ --out run/             # or torchrun

Model: ``--config model.json`` (a transformers config: its ``model_type`` picks the class; the default is a
tiny GPT-2) built on the meta device and initialized shard by shard (``init_seed``: the same weights for any
plan), or ``--pretrained DIR`` (a local ``save_pretrained`` directory: its safetensors, read per shard).
Data: the text files, byte-tokenized (``autopar.data.TextSamples``: no download), ordered per epoch by
``autopar.data.GlobalSampler``; each rank reads only its share of each global batch (``data="local"``,
``pm.data_shard``). Plan: autopar's, for ``--cluster`` (``local``: Cluster.local(world), a preset name, or a
cluster JSON file). Checkpoints: ``OUT/ckpt/step-NNNNNN`` every ``--save-every`` steps (model, optimizer,
step, data position, loss scaler); a run started with an OUT that holds checkpoints resumes from the latest,
whatever the number of ranks now (re-planned, resharded, the data position carried). Progress: loss,
tokens/s and MFU (``pm.step_stats()``: the plan's model FLOPs over the cluster's peak) and memory; a one-line
summary at the end.
``--trace`` writes, per rank, each step's sample ids and loss to OUT/trace/rank<R>.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout as well

import autopar  # noqa: E402
from autopar.data import GlobalSampler, TextSamples  # noqa: E402
from autopar.errors import UsageError  # noqa: E402
from examples.hf_causal_lm import CausalLMLoss  # noqa: E402

TINY_GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 64, "resid_pdrop": 0.0,
             "embd_pdrop": 0.0, "attn_pdrop": 0.0, "use_cache": False}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", nargs="+", required=True, help="text files or directories of .txt/.md files")
    p.add_argument("--out", required=True, help="run directory: checkpoints (resumed from), trace")
    p.add_argument("--config", help="transformers config JSON (default: a tiny GPT-2)")
    p.add_argument("--pretrained", help="a local save_pretrained directory to start from")
    p.add_argument("--nprocs", type=int, default=int(os.environ.get("WORLD_SIZE", 1)),
                   help="ranks to launch (ignored under torchrun)")
    p.add_argument("--cluster", default="local", help="'local', a preset name, or a cluster JSON file")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="global batch (samples per step)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--trace", action="store_true", help="write each step's sample ids and loss per rank")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any collective may wait")
    return p.parse_args(argv)


def build_model(args, vocab: int) -> tuple[torch.nn.Module, dict]:
    """The model on the meta device (no memory: each rank materializes only its shards), and the compile
    arguments that give its weights: the pretrained directory's safetensors, or its own init, seeded."""
    import transformers

    if args.pretrained:
        config = transformers.AutoConfig.from_pretrained(args.pretrained)
        weights = {"weights": args.pretrained, "prefix": "lm."}  # CausalLMLoss holds the model as .lm
    else:
        fields = json.loads(Path(args.config).read_text()) if args.config else dict(TINY_GPT2)
        fields.update(vocab_size=vocab, bos_token_id=vocab - 1, eos_token_id=vocab - 1)  # the byte tokenizer's eos
        config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        weights = {"init_seed": args.seed}
    with torch.device("meta"):
        return CausalLMLoss(transformers.AutoModelForCausalLM.from_config(config)), weights


def cluster_for(name: str, world: int) -> autopar.Cluster:
    if name == "local":
        return autopar.Cluster.local(world)
    if name.endswith(".json"):
        return autopar.Cluster.from_json(name)
    return autopar.Cluster.preset(name, gpus=world)  # as many of the preset's GPUs as there are ranks


def latest_checkpoint(out: Path) -> Path | None:
    """The checkpoint of the highest step under OUT/ckpt whose save finished (it has a manifest)."""
    done = [p for p in (out / "ckpt").glob("step-*")
            if re.fullmatch(r"step-\d+", p.name) and (p / "manifest.json").is_file()]
    return max(done, key=lambda p: int(p.name[5:]), default=None)


def rates(pm, warmup: int) -> str:
    """tokens/s and MFU of the steps so far (``pm.step_stats``: wall-clock between train_step calls, the plan's
    model FLOPs over the cluster's peak for its precision); empty until there are intervals to measure."""
    try:
        stats = pm.step_stats(warmup=warmup)
    except UsageError:  # fewer than warmup + 2 steps so far
        return "- tok/s, MFU -"
    mfu = "-" if stats["mfu"] is None else f"{100 * stats['mfu']:.2f}%"
    return f"{stats.get('tokens_per_s', stats.get('samples_per_s', 0)):,.0f} tok/s, MFU {mfu}"


def memory_text(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.max_memory_allocated() / 2 ** 20:.0f} MiB"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 10:.0f} MiB RSS"


def train(rank: int, args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    out = Path(args.out)
    world = dist.get_world_size()
    cluster = cluster_for(args.cluster, world)
    device = cluster.device_type
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    samples = TextSamples(args.data, args.seq_len)
    model, weights = build_model(args, samples.tokenizer.vocab_size)
    example = tuple(t.to(device) for t in samples.batch(torch.arange(args.batch), shifted_labels=False))
    pm = autopar.compile(model, cluster, example, data="local", timeout=args.timeout, precision=args.precision,
                         **weights)
    optimizer = pm.optimizer(torch.optim.AdamW, lr=args.lr)
    sampler = GlobalSampler(len(samples), args.batch, seed=args.seed, shard=pm.data_shard)
    step, resumed = 0, None
    found = latest_checkpoint(out)
    if found is not None:
        manifest = pm.load(found, optimizer)
        step, resumed = int(manifest["step"]), found.name
        sampler.load_state_dict(manifest["position"]["sampler"])
    if rank == 0:
        print(f"autopar train_lm: {world} rank(s), {len(pm.plan.device_stages)} stage(s), "
              f"{pm.plan.microbatches} microbatch(es), {len(samples)} samples of {args.seq_len} tokens"
              + (f", resumed from {resumed} (epoch {sampler.epoch}, sample {sampler.cursor})" if resumed else ""),
              flush=True)
    trace = _trace_file(out, rank) if args.trace else None
    first, start, losses, saving = step, time.perf_counter(), [], 0.0
    while step < args.steps:
        epoch, ids = sampler.epoch, sampler.next_ids()
        loss = pm.train_step(*(t.to(device) for t in samples.batch(ids, shifted_labels=False))).item()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        losses.append(loss)
        if trace is not None:
            trace.write(json.dumps({"step": step, "epoch": epoch, "ids": ids.tolist(), "loss": loss,
                                    "share": list(pm.data_shard), "world": world, "pid": os.getpid()}) + "\n")
            trace.flush()
        if rank == 0:
            print(f"step {step:>5}/{args.steps} | loss {loss:.4f} | {rates(pm, 0).replace(', ', ' | ')} | "
                  f"mem {memory_text(device)}", flush=True)
        if step % args.save_every == 0 or step == args.steps:
            t0 = time.perf_counter()
            pm.save(out / "ckpt" / f"step-{step:06d}", optimizer, step=step,
                    position={"sampler": sampler.state_dict()})
            saving += time.perf_counter() - t0
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(f"done: {step - first} steps in {elapsed:.1f} s ({saving:.1f} s of it checkpoints), loss "
              f"{losses[0] if losses else float('nan'):.4f} -> {losses[-1] if losses else float('nan'):.4f}, "
              f"{rates(pm, 1)} (after the first step), memory {memory_text(device)}, checkpoints in "
              f"{out / 'ckpt'}", flush=True)
    return {"losses": losses, "first_step": first, "resumed": resumed}


def _trace_file(out: Path, rank: int):
    (out / "trace").mkdir(parents=True, exist_ok=True)
    return open(out / "trace" / f"rank{rank}.jsonl", "a")


def main(argv=None) -> list:
    args = parse(argv)
    (Path(args.out) / "ckpt").mkdir(parents=True, exist_ok=True)
    backend = "nccl" if cluster_for(args.cluster, args.nprocs).device_type == "cuda" else "gloo"
    return autopar.launch(train, args.nprocs, args, backend=backend, timeout=args.timeout)


if __name__ == "__main__":
    main()
