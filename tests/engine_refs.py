"""What the engine tests check engines against: two tiny policies (A, B) and plain transformers on them."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from yatt.models.tiny import TinyModelConfig, write_tiny_model

EOS = 2
# 256 positions so a prompt can exceed one 128-token KV block (vLLM's prefix-cache granularity).
TINY = TinyModelConfig(max_position_embeddings=256)
TEXTS = ["123+456=", "7*8=", "hello world ", "a, b? c:"]


def two_policies(root: Path) -> dict[str, Path]:
    return {"A": write_tiny_model(root / "A", TINY, seed=0), "B": write_tiny_model(root / "B", TINY, seed=1)}


def load_policies(folders: dict[str, Path]) -> dict[str, torch.nn.Module]:
    return {k: AutoModelForCausalLM.from_pretrained(v, dtype=torch.float32).eval() for k, v in folders.items()}


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, eos_token_id=EOS,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log_softmax of a plain unpadded forward's raw float32 logits at the completion's tokens."""
    logp = torch.log_softmax(model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float(), -1)
    return logp.gather(1, torch.tensor(completion)[:, None])[:, 0]
