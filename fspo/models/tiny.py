"""The embedded tiny policy: a character-level tokenizer (every printable ASCII character one token, plus <pad>=0,
<s>=1, </s>=2, <unk>=3: token counts equal character counts) and a ~1M-parameter Qwen3 built from a config."""
from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = [c for c in string.printable if c not in "\r\x0b\x0c\t"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: vocab = 4 specials + 96 printable characters (100 tokens)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                  eos_token="</s>", unk_token="<unk>", padding_side="left")
    out.model_max_length = 512
    return out


# the tiny model's shape (~0.8M parameters, tied embeddings); ``model.arch`` overrides any field
TINY_ARCH = dict(vocab_size=100, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, intermediate_size=512, max_position_embeddings=512, tie_word_embeddings=True)


def tiny_qwen3_config(**overrides) -> Qwen3Config:
    """A Qwen3-architecture config: `TINY_ARCH` with ``overrides`` (any config field)."""
    return Qwen3Config(**{**TINY_ARCH, **overrides}, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build_tiny_model(seed: int = 0, **config_overrides) -> Qwen3ForCausalLM:
    """A freshly initialised tiny Qwen3 (float32), deterministic for a given seed."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(tiny_qwen3_config(**config_overrides))
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    return model
