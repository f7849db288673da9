"""Tiny Qwen2 policies with a character tokenizer, built by yatt itself so nothing is downloaded.

The folder written here is an ordinary Hugging Face model folder (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json), so transformers and vLLM load it like any checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
DEFAULT_ALPHABET = "0123456789+-*=?:, abcdefghijklmnopqrstuvwxyz"


class TinyModelConfig(BaseModel):
    """Shape of a tiny Qwen2 model and the characters its tokenizer knows."""

    model_config = ConfigDict(extra="forbid")

    alphabet: str = Field(DEFAULT_ALPHABET, description="Characters of the vocabulary, one token each.")
    special_tokens: list[str] = Field(
        default_factory=list,
        description="More tokens of one id each, matched in text before its characters (e.g. a chat format's "
        "<|im_start|> and <|im_end|>); decoding without special tokens drops them.",
    )
    words: list[str] = Field(
        default_factory=list,
        description="More tokens of one id each that decode as text, matched before its characters (e.g. "
        "Qwen2.5's <tool_call> and <tool_response>, which its tokenizer also holds as one token each).",
    )
    hidden_size: int = Field(128, gt=0)
    intermediate_size: int = Field(384, gt=0)
    num_hidden_layers: int = Field(4, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    max_position_embeddings: int = Field(128, gt=0)
    tie_word_embeddings: bool = True


def build_char_tokenizer(alphabet: str, special_tokens: list[str] = (), words: list[str] = ()
                         ) -> PreTrainedTokenizerFast:
    """A tokenizer that maps every character of `alphabet` to one token; specials come first, then the
    characters, `special_tokens`, and `words` last."""
    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, *alphabet])}
    core = Tokenizer(WordLevel(vocab, unk_token=PAD))
    # Every character is its own pre-token, and decoding glues tokens back without spaces.
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=PAD
    )
    if special_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    if words:
        tokenizer.add_tokens(list(words))
    return tokenizer


def build_tiny_model(cfg: TinyModelConfig, vocab_size: int, eos_id: int, pad_id: int, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    hf_config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    return Qwen2ForCausalLM(hf_config).float()


def write_tiny_model(folder: str | Path, cfg: TinyModelConfig | None = None, seed: int = 0) -> Path:
    """Write a randomly initialised tiny model and its tokenizer as an HF folder; returns the folder."""
    cfg = cfg or TinyModelConfig()
    folder = Path(folder)
    tokenizer = build_char_tokenizer(cfg.alphabet, cfg.special_tokens, cfg.words)
    model = build_tiny_model(cfg, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
