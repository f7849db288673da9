"""What the engine tests check engines against: two tiny policies (A, B) and plain transformers on them."""

from __future__ import annotations

import time
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
    out = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, eos_token_id=EOS, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def hf_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log_softmax of a plain unpadded forward's raw float32 logits at the completion's tokens."""
    logp = torch.log_softmax(model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float(), -1)
    return logp.gather(1, torch.tensor(completion)[:, None])[:, 0]


def trainer_logprobs(
    folder: Path, prompt: list[int], completions: list[list[int]], temperature: float
) -> list[torch.Tensor]:
    """The torch trainer's log-probs of each completion at `temperature` (what the RL step compares with)."""
    from yatt.config import TrainerConfig
    from yatt.distributed import World
    from yatt.tensors import TokenBatch
    from yatt.trainers.torch_trainer import TorchTrainer

    trainer = TorchTrainer(folder, TrainerConfig(), World(0, 1, 0, torch.device("cpu")), trainable=False)
    batch = TokenBatch.from_sequences([prompt] * len(completions), completions, pad_id=0)
    batch.temperature = temperature
    logp, _ = trainer.logprobs(batch)
    return [logp[i][batch.mask[i].bool()] for i in range(len(completions))]


@torch.no_grad()
def nucleus_log_mass(
    model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float, top_p: float
) -> torch.Tensor:
    """log of the probability mass of the top-p nucleus of softmax(logits / T) at each completion position."""
    logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float() / temperature
    probs = torch.softmax(logits, -1).sort(dim=-1, descending=True).values
    return torch.log(probs.masked_fill(probs.cumsum(-1) - probs > top_p, 0.0).sum(-1))


class PushAfter:
    """The producer's view of a trainer that pushes `weights` 50 ms after the first of its `requests` groups is
    back (a `Preemption` of `self.pool`): with one request per engine batch, the next one is then decoding and the
    rest are queued."""

    def __init__(self, client, weights, requests: int):
        self.client, self.weights, self.requests = client, weights, requests
        self.version, self.pool, self.first = 0, None, None

    def pending(self) -> bool:
        if self.first is None and len(self.pool.samples) < self.requests:
            self.first = time.monotonic()
        return self.version == 0 and self.first is not None and time.monotonic() - self.first > 0.05

    def pause(self) -> int:
        self.client.update_weights(self.weights)
        self.version = 1
        return 1
