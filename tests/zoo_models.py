"""Tiny Hugging Face ``transformers`` models for the zoo tests: configs with random weights, no downloads.

Each factory returns (model, example_inputs): the model's forward takes the inputs positionally and returns
the scalar loss; weights and data are deterministic per seed; dropout is 0, so a sharded run can match one
device exactly. Sizes are the smallest that keep every architecture's structure (GQA, MoE routing,
cross-attention) and still split over 4 devices: hidden 32-64, 2 layers, vocabulary 128, sequence 16.
"""
import torch
import torch.nn as nn

VOCAB, SEQ, BATCH = 128, 16, 8


class HFLoss(nn.Module):
    """A transformers model whose forward(*inputs) returns ``.loss``; ``names`` are its keyword arguments."""

    def __init__(self, model, names: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *inputs):
        return self.model(**dict(zip(self.names, inputs))).loss


def _tokens(seed: int, batch: int = BATCH, seq: int = SEQ, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _lm(cls_name: str, config, seed: int, names=("input_ids", "labels")):
    import transformers

    config.use_cache = False
    torch.manual_seed(seed)
    model = HFLoss(getattr(transformers, cls_name)(config), names)
    ids = _tokens(seed)
    return model, (ids, ids.clone())


_DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=SEQ * 2, attention_dropout=0.0)
_MOE = dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0)


def llama(seed=0):
    from transformers import LlamaConfig
    return _lm("LlamaForCausalLM", LlamaConfig(**_DECODER, num_key_value_heads=2), seed)


def mistral(seed=0):
    from transformers import MistralConfig
    return _lm("MistralForCausalLM", MistralConfig(**_DECODER, num_key_value_heads=2, sliding_window=None), seed)


def qwen2(seed=0):
    from transformers import Qwen2Config
    return _lm("Qwen2ForCausalLM", Qwen2Config(**_DECODER, num_key_value_heads=2), seed)


def gemma(seed=0):
    from transformers import GemmaConfig
    return _lm("GemmaForCausalLM", GemmaConfig(**_DECODER, num_key_value_heads=2, head_dim=16), seed)


def gpt2(seed=0):
    from transformers import GPT2Config
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ * 2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return _lm("GPT2LMHeadModel", cfg, seed)


def gpt_neox(seed=0):
    from transformers import GPTNeoXConfig
    cfg = GPTNeoXConfig(**_DECODER, hidden_dropout=0.0)
    return _lm("GPTNeoXForCausalLM", cfg, seed)


def bert(seed=0):
    from transformers import BertConfig
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=SEQ * 2, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return _lm("BertForMaskedLM", cfg, seed)


def roberta(seed=0):
    from transformers import RobertaConfig
    cfg = RobertaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=SEQ * 2 + 2, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, pad_token_id=1)
    return _lm("RobertaForMaskedLM", cfg, seed)


def t5(seed=0):
    from transformers import T5Config
    cfg = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                   num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return _lm("T5ForConditionalGeneration", cfg, seed)


def vit(seed=0):
    import transformers
    from transformers import ViTConfig

    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=128, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, num_labels=8)
    torch.manual_seed(seed)
    model = HFLoss(transformers.ViTForImageClassification(cfg), ("pixel_values", "labels"))
    g = torch.Generator().manual_seed(seed)
    return model, (torch.randn(BATCH, 3, 16, 16, generator=g), torch.randint(0, 8, (BATCH,), generator=g))


def mixtral(seed=0, **extra):
    from transformers import MixtralConfig
    return _lm("MixtralForCausalLM", MixtralConfig(**_DECODER, num_key_value_heads=2, **{**_MOE, **extra}), seed)


def qwen2_moe(seed=0, **extra):
    from transformers import Qwen2MoeConfig
    cfg = Qwen2MoeConfig(**_DECODER, **{**dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=64, shared_expert_intermediate_size=64, router_aux_loss_coef=0.0,
                         decoder_sparse_step=1), **extra})
    return _lm("Qwen2MoeForCausalLM", cfg, seed)


ZOO = {"llama": llama, "mistral": mistral, "qwen2": qwen2, "gemma": gemma, "gpt2": gpt2, "gpt_neox": gpt_neox,
       "bert": bert, "roberta": roberta, "t5": t5, "vit": vit, "mixtral": mixtral, "qwen2_moe": qwen2_moe}
