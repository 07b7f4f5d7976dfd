"""Peak host memory per rank while compiling a >= 1B-parameter model that no rank ever holds whole.

    python benchmarks/memory/meta_rss.py [--layers 18] [--ranks 4] [--real-layers 4] [--out DIR]

Each of ``--ranks`` gloo ranks builds a Hugging Face Llama (hidden 2048, intermediate 5632, vocabulary
32000, 18 layers: 1.06 B parameters, 4.2 GB in fp32) on the meta device and compiles it data parallel at
ZeRO-3: (1) ``init``: weights from the model's own init (``init_seed``); (2) ``pm.save_pretrained`` writes
them as sharded safetensors; (3) in a second launch (fresh processes), ``weights=``: a meta model loads
those files, each rank reading only its slices. Per phase and rank it prints the resident memory before the phase (freed
heap trimmed first: glibc's malloc_trim), the peak (VmHWM of /proc/self/status, reset before each phase
through /proc/self/clear_refs), the resident memory after it, the bytes of this rank's shards (parameters,
ZeRO-3 shards and buffers: distinct storages), and the bound ``before + shards + largest tensor + 1 GiB``.
A full copy of the model would add 4.2 GB to a rank's peak. (4) In a third launch, ``real model``: each rank
builds a ``--real-layers`` Llama on the CPU (seeded: the user's model, in ``rss before``) and compiles it the
same way; compile may hold at most that model plus the shards: bound ``before + shards + 1 GiB`` (no full
tensor beyond the user's own).
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import autopar  # noqa: E402

GIB = 2**30


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=64, use_cache=False)


class LossOf(torch.nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.model = lm

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


def meta_model(layers: int):
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LossOf(LlamaForCausalLM(config(layers)))


def held_bytes(pm) -> int:
    seen = {}
    tensors = list(pm.parameters()) + list(pm.buffers())
    for r in getattr(pm.runner, "chunks", [pm.runner]):
        for b in getattr(getattr(r, "gradsync", None), "buckets", ()):
            if b.shard is not None:
                tensors.append(b.shard)
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def trim() -> None:
    """Give freed heap back to the OS (glibc keeps it otherwise), so each phase starts from what is live."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def phase(name: str, fn) -> tuple:
    trim()
    before = status("VmRSS")
    reset = reset_peak()
    start = time.perf_counter()
    out = fn()
    return out, {"phase": name, "rss_before": before, "peak": status("VmHWM"), "peak_reset": reset,
                 "seconds": time.perf_counter() - start, "rss_after": status("VmRSS"),
                 "anon_after": status("RssAnon"), "file_after": status("RssFile")}


def run_init_and_save(rank: int, layers: int, ranks: int, directory: str) -> list:
    """Phases 1 and 2 in one launch."""
    model, cluster, batch = meta_model(layers), *setup(ranks)
    rows = []
    pm, row = phase("init (meta, init_seed)", lambda: autopar.compile(model, cluster, batch, **OPTIONS))
    rows.append({**row, "shards": held_bytes(pm)})
    _, row = phase("pm.save_pretrained", lambda: pm.save_pretrained(directory, prefix="model.", max_shard_size="500MB"))
    rows.append({**row, "shards": held_bytes(pm)})
    return annotate(rows, model, rank)


def run_real(rank: int, layers: int, ranks: int) -> list:
    """Phase 4: the user's model built whole on the CPU (the same weights on every rank)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model, (cluster, batch) = LossOf(LlamaForCausalLM(config(layers))), setup(ranks)
    pm, row = phase("real model (CPU, user's weights)", lambda: autopar.compile(model, cluster, batch, **OPTIONS))
    rows = annotate([{**row, "shards": held_bytes(pm)}], model, rank)
    rows[0]["largest"] = 0  # the bound: the user's model (in rss_before) + shards + 1 GiB
    return rows


def run_weights(rank: int, layers: int, ranks: int, directory: str) -> list:
    """Phase 3 in fresh processes (nothing retained from the first two)."""
    model, cluster, batch = meta_model(layers), *setup(ranks)
    pm, row = phase("weights= (meta, safetensors)", lambda: autopar.compile(
        model, cluster, batch, weights=directory, prefix="model.", **OPTIONS))
    return annotate([{**row, "shards": held_bytes(pm)}], model, rank)


OPTIONS = {"stages": 1, "zero": 3, "pin": {"p_*": "RR", "input_ids": "RS(0)", "labels": "RS(0)"}}


def setup(ranks: int) -> tuple:
    ids = torch.randint(0, 32000, (ranks, 32), generator=torch.Generator().manual_seed(0))
    return autopar.Cluster.local(ranks, mesh_shape=(1, ranks)), (ids, ids.clone())


def annotate(rows: list, model, rank: int) -> list:
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    for r in rows:
        r.update(rank=rank, largest=largest, params=n_params)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--real-layers", type=int, default=4, help="layers of the CPU-built model (0: skip)")
    parser.add_argument("--out", default=None, help="directory for the safetensors (default: a temporary one)")
    args = parser.parse_args()
    directory = args.out or tempfile.mkdtemp(prefix="autopar-meta-rss-")
    try:
        results = autopar.launch(run_init_and_save, args.ranks, args.layers, args.ranks, directory, timeout=1800)
        results = [a + b for a, b in zip(results, autopar.launch(run_weights, args.ranks, args.layers, args.ranks,
                                                                  directory, timeout=1800))]
    finally:
        if args.out is None:
            shutil.rmtree(directory, ignore_errors=True)
    if args.real_layers > 0:
        results = [a + b for a, b in zip(results, autopar.launch(run_real, args.ranks, args.real_layers, args.ranks,
                                                                  timeout=1800))]
    rows = [r for per_rank in results for r in per_rank]
    print(f"# {rows[0]['params'] / 1e9:.2f} B parameters ({rows[0]['params'] * 4 / GIB:.2f} GiB fp32), "
          f"{args.ranks} gloo ranks, ZeRO-3; largest tensor {rows[0]['largest'] / GIB:.3f} GiB; "
          f"load {open('/proc/loadavg').read().split()[:3]}")
    print(f"{'phase':32s} {'rank':>4s} {'rss before':>11s} {'peak':>8s} {'after':>8s} {'shards':>8s} {'bound':>8s} "
          f"{'ok':>3s} {'s':>6s}   (GiB)")
    for r in sorted(rows, key=lambda r: (r["phase"], r["rank"])):
        bound = r["rss_before"] + r["shards"] + r["largest"] + GIB
        print(f"{r['phase']:32s} {r['rank']:4d} {r['rss_before'] / GIB:11.2f} {r['peak'] / GIB:8.2f} "
              f"{r['rss_after'] / GIB:8.2f} "
              f"{r['shards'] / GIB:8.2f} {bound / GIB:8.2f} {'yes' if r['peak'] <= bound else 'NO':>3s} "
              f"{r['seconds']:6.1f}" + ("" if r["peak_reset"] else "  (peak not resettable: since start)"))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
