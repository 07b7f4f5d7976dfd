"""Cases for tests/test_weights.py: each runs in every rank of one ``autopar.launch`` per world size.

Models, built on the meta device: the GPT example and a tiny Hugging Face Llama (``LlamaForCausalLM`` in a
wrapper whose forward returns the loss, so its state-dict keys carry the prefix ``model.``). Layouts on a
(world/2, 2) mesh (2 ranks: (1, 2)): "dp" (parameters pinned replicated, the batch split), "tp" (Megatron's
attention and MLP split on axis 1), "zero3" (as dp, every bucket at ZeRO level 3), "pp2" (2 stages, 4
microbatches, 1F1B). Each case reports the full weights right after compile (rank 0 compares them with
``autopar.init_weights`` on one device, and across layouts) and the loss/parameter errors of 3 AdamW steps
against the single-device model initialized by ``autopar.init_weights``.
"""
import json
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

import autopar
from examples.gpt import GPT, GPTConfig, make_batch
from tests.parity import rel

LR, EPS, STEPS = 1e-3, 1e-6, 3
VOCAB, SEQ, BATCH = 128, 16, 8
LAYOUTS = ("dp", "tp", "zero3", "pp2")


def llama_config(layers: int = 2, tied: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ * 2,
                       attention_dropout=0.0, use_cache=False, tie_word_embeddings=tied)


class LossOf(torch.nn.Module):
    """A causal LM whose forward(input_ids, labels) returns ``.loss``: its keys are the LM's with ``model.``."""

    def __init__(self, lm):
        super().__init__()
        self.model = lm

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


def build(name: str, device="meta", tied: bool = False) -> tuple[torch.nn.Module, tuple]:
    """(model on ``device``, batch); ``tied``: the Llama's lm_head is its embedding."""
    with torch.device(device):
        if name == "gpt":
            cfg = GPTConfig(n_layer=2, vocab_size=VOCAB, seq_len=SEQ, n_embd=64, n_head=4)
            model = GPT(cfg)
        else:
            from transformers import LlamaForCausalLM

            model = LossOf(LlamaForCausalLM(llama_config(tied=tied)))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    if name == "gpt":
        return model, make_batch(cfg, BATCH, seed=1)
    return model, (ids, ids.clone())


def options(name: str, layout: str, world: int) -> dict:
    mesh = (world // 2, 2)
    split = "".join("S(0)" if s > 1 else "R" for s in mesh)
    inputs = ("idx", "targets") if name == "gpt" else ("input_ids", "labels")
    if layout in ("dp", "zero3"):
        pin = {"p_*": "RR", inputs[0]: split, inputs[1]: split}
        return {"stages": 1, "pin": pin, **({"zero": 3} if layout == "zero3" else {"zero": 0})}
    if layout == "tp":
        batch = "S(0)R" if mesh[0] > 1 else "RR"
        if name == "gpt":
            cols = ["q_weight", "q_bias", "k_weight", "v_weight", "v_bias", "fc_weight", "fc_bias"]
            pin = {**{f"p_*_{c}": "RS(0)" for c in cols}, "p_*_o_weight": "RS(1)", "p_*_proj_weight": "RS(1)"}
        else:
            pin = {**{f"p_*_{w}_proj_weight": "RS(0)" for w in ("q", "k", "v", "gate", "up")},
                   "p_*_o_proj_weight": "RS(1)", "p_*_down_proj_weight": "RS(1)"}
        return {"stages": 1, "zero": 0, "pin": {**pin, inputs[0]: batch, inputs[1]: batch}}
    half = [1, world // 2]
    return {"stages": [{"layers": [0, 0], "submesh": half}, {"layers": [1, 1], "submesh": half}],
            "layers": 2, "microbatches": 4, "schedule": "1f1b", "zero": 0}


def cluster(world: int, layout: str):
    return autopar.Cluster.local(world, mesh_shape=(1, world) if layout == "pp2" else (world // 2, 2))


def optimizer(pm, layout: str):
    if layout == "zero3":
        return pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    return torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)


def train(pm, opt, reference, batch) -> dict:
    """3 AdamW steps on both; the largest loss and parameter errors (parameters with a gradient)."""
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, eps=EPS)
    loss_err, moved = 0.0, set()
    for _ in range(STEPS):
        loss = pm.train_step(*batch)
        opt.step()
        opt.zero_grad()
        ref = reference(*batch)
        ref.backward()
        moved |= {n for n, p in reference.named_parameters() if p.grad is not None and p.grad.abs().max() > 1e-7}
        ref_opt.step()
        ref_opt.zero_grad()
        loss_err = max(loss_err, abs(loss.item() - ref.item()) / abs(ref.item()))
    full = pm.full_state_dict()
    errors = {k: rel(full[k], v) for k, v in reference.state_dict().items() if k in moved}
    return {"loss_err": loss_err, "param_err": max(errors.values()), "compared": len(errors)}


def init_case(name: str, layout: str, world: int) -> dict:
    """Meta model initialized by compile (init_seed=0) vs autopar.init_weights on one device."""
    model, batch = build(name)
    pm = autopar.compile(model, cluster(world, layout), batch, **options(name, layout, world))
    after_init = pm.full_state_dict()
    reference = autopar.init_weights(build(name)[0], init_seed=0)
    out = train(pm, optimizer(pm, layout), reference, batch)
    out["init"] = after_init if dist.get_rank() == 0 else None
    out["sharded"] = sum(1 for s in pm.plan.stages for n, sh in s.shardings.items()
                         if n.startswith("p_") and "S" in sh.out)
    out["zero"] = sorted({lvl for s in pm.plan.stages for lvl in s.zero.values()})
    out["stages"] = len(pm.plan.stages)
    return out


def shared_dir() -> str:
    box = [tempfile.mkdtemp(prefix="autopar-weights-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def pretrained_dir() -> str:
    """A tiny HF Llama saved by transformers' save_pretrained into >= 3 safetensors files (rank 0)."""
    from transformers import LlamaForCausalLM

    path = shared_dir()
    if dist.get_rank() == 0:
        torch.manual_seed(7)
        LlamaForCausalLM(llama_config()).save_pretrained(path, max_shard_size="40KB")
    dist.barrier()
    return path


def hf_model(path: str) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LossOf(LlamaForCausalLM.from_pretrained(path))


def weights_case(path: str, layout: str, world: int) -> dict:
    """The meta Llama loaded through weights=path: weights and loss vs the HF model from_pretrained."""
    model, batch = build("llama")
    pm = autopar.compile(model, cluster(world, layout), batch, weights=path, prefix="model.",
                         **options("llama", layout, world))
    hf = hf_model(path)
    full = pm.full_state_dict()
    with torch.no_grad():
        loss, ref = pm(*batch).item(), hf(*batch).item()
    return {"weights_equal": all(torch.equal(full[k], v) for k, v in hf.state_dict().items()),
            "keys_equal": list(full) == list(hf.state_dict()), "loss_err": abs(loss - ref) / abs(ref),
            "files": len([f for f in os.listdir(path) if f.endswith(".safetensors")]), "pm": pm, "hf": hf}


def save_pretrained_case(loaded: dict, layout: str, world: int) -> dict:
    """Train the loaded module 3 steps, pm.save_pretrained, from_pretrained: bit-exact with full_state_dict."""
    from transformers import LlamaForCausalLM

    pm, hf = loaded["pm"], loaded["hf"]
    train(pm, optimizer(pm, layout), hf, build("llama", "cpu")[1])
    out_dir = shared_dir()
    pm.save_pretrained(out_dir, prefix="model.", max_shard_size="30KB")
    full = pm.full_state_dict()
    back = LlamaForCausalLM.from_pretrained(out_dir).state_dict()
    result = {"round_trip_equal": all(torch.equal(full["model." + k], v) for k, v in back.items()),
              "round_trip_keys": sorted("model." + k for k in back) == sorted(full),
              "saved_files": len([f for f in os.listdir(out_dir) if f.endswith(".safetensors")]),
              "config_saved": os.path.exists(os.path.join(out_dir, "config.json")),
              "written": sorted(saved_keys(out_dir))}
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(out_dir, ignore_errors=True)
    return result


def saved_keys(directory: str) -> list[str]:
    with open(os.path.join(directory, "model.safetensors.index.json"), encoding="utf-8") as f:
        return list(json.load(f)["weight_map"])


def tied_case(world: int) -> dict:
    """A Llama whose lm_head is its embedding, trained 2 steps at ZeRO-3: pm.save_pretrained writes the shared
    tensor once (as transformers does); from_pretrained ties it back, and weights= loads it under tp."""
    from transformers import LlamaForCausalLM

    model, batch = build("llama", tied=True)
    pm = autopar.compile(model, cluster(world, "zero3"), batch, init_seed=5, **options("llama", "zero3", world))
    opt = optimizer(pm, "zero3")
    for _ in range(2):
        pm.train_step(*batch)
        opt.step()
        opt.zero_grad()
    out_dir = shared_dir()
    pm.save_pretrained(out_dir, prefix="model.", max_shard_size="30KB")
    full = pm.full_state_dict()
    back = LlamaForCausalLM.from_pretrained(out_dir)
    again = autopar.compile(build("llama", tied=True)[0], cluster(world, "tp"), batch, weights=out_dir,
                            prefix="model.", **options("llama", "tp", world))
    got = again.full_state_dict()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), encoding="utf-8") as f:
        total = json.load(f)["metadata"]["total_size"]
    result = {"written": sorted(saved_keys(out_dir)), "total_size": total,
              "unique_bytes": sum(v.numel() * v.element_size() for k, v in full.items() if "lm_head" not in k),
              "hf_equal": all(torch.equal(full["model." + k], v) for k, v in back.state_dict().items()),
              "hf_tied": back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr(),
              "weights_equal": list(got) == list(full) and all(torch.equal(got[k], v) for k, v in full.items()),
              "trained": not torch.equal(full["model.lm_head.weight"],
                                         autopar.init_weights(build("llama", tied=True)[0], init_seed=5)
                                         .state_dict()["model.lm_head.weight"])}
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(out_dir, ignore_errors=True)
    return result


def zero3_reads_case(world: int) -> dict:
    """Reading and writing ``pm.parameters()`` between ZeRO-3 steps (this rank's pieces of the shards), then
    training on: sums against the full weights, an in-place halving against the same on the reference."""
    model, batch = build("gpt")
    pm = autopar.compile(model, cluster(world, "zero3"), batch, **options("gpt", "zero3", world))
    reference = autopar.init_weights(build("gpt")[0], init_seed=0)
    train(pm, optimizer(pm, "zero3"), reference, batch)  # ends with full_state_dict: every unit gathered
    with torch.no_grad():
        pm(*batch)  # a forward frees each unit after its last use: the parameters are at rest
    zero3 = set(pm.runner.gradsync.units.of_param)
    pieces = [p.detach() for n, p in pm.named_parameters() if n.rsplit(".", 1)[-1] in zero3]
    whole = [p.detach() for n, p in pm.named_parameters() if n.rsplit(".", 1)[-1] not in zero3]
    norms = [float(p.data.norm()) for p in pm.parameters()]
    mine = torch.stack([p.double().sum() for p in pieces + (whole if dist.get_rank() == 0 else [])]).sum()
    every = [torch.zeros((), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(every, mine)
    full = pm.full_state_dict()
    names = dict(reference.named_parameters())
    total = sum(v.double().sum() for k, v in full.items() if k in names)
    with torch.no_grad():
        for p in pm.parameters():
            p.mul_(0.5)
        for p in reference.parameters():
            p.mul_(0.5)
    halved = pm.full_state_dict()
    after = train(pm, optimizer(pm, "zero3"), reference, batch)
    return {"sum_of_pieces": float(sum(every)), "rank0_pieces": float(every[0]), "full_sum": float(total),
            "norms_finite": all(n == n for n in norms), "piece_numel": sum(p.numel() for p in pieces),
            "numel": sum(p.numel() for p in reference.parameters()) - sum(p.numel() for p in whole),
            "halved": all(torch.equal(halved[k], full[k] * 0.5) for k in full if k in names),
            "after": after}


def checkpoint_case(world: int) -> dict:
    """pm.save of a zero3 module, loaded through weights= into a meta model under the tp layout."""
    model, batch = build("llama")
    pm = autopar.compile(model, cluster(world, "zero3"), batch, init_seed=3, **options("llama", "zero3", world))
    path = shared_dir()
    pm.save(path)
    saved = pm.full_state_dict()
    other = autopar.compile(build("llama")[0], cluster(world, "tp"), batch, weights=path,
                            **options("llama", "tp", world))
    got = other.full_state_dict()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    return {"checkpoint_equal": all(torch.equal(got[k], v) for k, v in saved.items())}


def run_all(rank: int, world: int) -> dict:
    torch.manual_seed(1234 + rank)  # ranks' global RNGs differ: init must not depend on them
    out = {"init": {}, "weights": {}}
    for name in ("gpt", "llama"):
        for layout in LAYOUTS:
            out["init"][(name, layout)] = init_case(name, layout, world)
    path = pretrained_dir()
    loaded = {}
    for layout in LAYOUTS:
        loaded[layout] = weights_case(path, layout, world)
        out["weights"][layout] = {k: v for k, v in loaded[layout].items() if k not in ("pm", "hf")}
    out["save_pretrained"] = {layout: save_pretrained_case(loaded[layout], layout, world) for layout in ("tp", "zero3")}
    out["checkpoint"] = checkpoint_case(world)
    out["tied"] = tied_case(world)
    out["zero3_reads"] = zero3_reads_case(world)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    if rank == 0:
        out["reference_seed1"] = autopar.init_weights(build("llama")[0], init_seed=1).state_dict()
        out["reference_seed0"] = {n: autopar.init_weights(build(n)[0], init_seed=0).state_dict()
                                  for n in ("gpt", "llama")}
    return out if rank == 0 else {}
