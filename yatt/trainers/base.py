"""What a controller shard needs from a training backend (`Trainer`).

Backends are registered in `yatt.trainers.TRAINERS` under the name `trainer.backend` selects and built as
``Backend(model_path, cfg: TrainerConfig, world, trainable=True, total_steps=1, head="lm", freeze_vision=False)``;
`trainable=False` is a frozen reference model (log-probs only); `freeze_vision` (model.freeze_vision) keeps a
vision-language policy's vision tower fixed. A backend whose registry entry declares `lora` (yatt.backends) is
also given `lora=` (yatt.models.lora_config.LoRAConfig, model.lora) when it is on; its `reference()` then gives
the frozen reference as the policy with its adapter off (log-probs, offload/onload), instead of a second model,
and `save_adapter` writes the adapters into an export.
Batches of image prompts carry `TokenBatch.pixels` once per distinct prompt and `TokenBatch.image_index` per row.
A backend knows nothing about RL: the controller hands it
a loss function, so the policy objective, a value loss or an SFT loss run through the same update.

A mixture-of-experts policy replays `TokenBatch.routing` where it is set (>= 0) in every forward, and a
`logprobs(..., record_routing=True)` pass leaves the routing it used in the batch it was given (`batch.routing`,
created if None), so routing replay R2 can replay the old-log-prob pass's routing in the update; a dense policy
ignores both. A forward of a batch carrying `TokenBatch.engine_routing` compares its router's own top-k with it,
and `routing_counts()` gives what those forwards counted (moe/routing_mismatch). Only a backend that declares
`routing_replay` (yatt.backends) is asked to record or to count.

`head` says what the model computes per response token. "lm": a causal LM, whose per-token outputs are
log-probs (`logprobs`). "value": a value model for PPO's critic, the same decoder with one scalar per
position, whose per-token outputs are values (`values`); its loss_fn gets those values where a policy's
gets log-probs (and no entropy). A backend without value models raises ValueError for head="value".
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from torch import Tensor

from yatt.tensors import LossFn, NamedTensors, TokenBatch, WeightVersions


class Trainer(Protocol):
    # True: every rank holds the same full state (DDP), so a checkpoint stores it once, from rank 0.
    # False: each rank holds its own shard (TP/PP/FSDP) and saves it with its rank's files.
    replicated: bool
    # None: a checkpoint of this trainer resumes on another number of ranks (DDP's state is whole; FSDP2's DTensor
    # rows are cut again, yatt.checkpoint.resume); else why it cannot, said when such a resume is asked for
    reshard_refusal: str | None
    head: str  # "lm" (log-probs) or "value" (values): see the module docstring

    def logprobs(
        self, batch: TokenBatch, with_entropy: bool = False, record_routing: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Per-token log-probs (and entropies) of the batch's own tokens under softmax(logits / batch.temperature),
        [B, L-1] on CPU, 0 outside the mask. head="lm" only."""
        ...

    def routing_counts(self) -> dict[str, float]:
        """This rank's routing-mismatch counts since the last call, and reset: `routing/tokens` (the positions
        compared, one per response token, of forwards whose batch carried engine_routing), `routing/tokens_differ`
        (those whose router's own top-k, before any replay, differs from the engine's in some MoE layer), and the
        same per token and MoE layer (`routing/layers`, `routing/layers_differ`)."""
        ...

    def values(self, batch: TokenBatch) -> Tensor:
        """Per-token values [B, L-1] on CPU, 0 outside the mask: column t is V of the prefix input_ids[:, :t+1],
        the state in which the target token input_ids[:, t+1] was chosen. head="value" only."""
        ...

    def train_mini_batch(self, batch: TokenBatch, loss_fn: LossFn, with_entropy: bool = False) -> dict[str, float]:
        """One optimizer step over `batch` (every rank calls it together); the loss_fn sums plus grad_norm,
        lr and skipped (1.0 when a non-finite gradient norm skipped the step). `with_entropy`: the loss
        needs the entropy (with its gradient), e.g. for an entropy bonus."""
        ...

    def engine_weights(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        """The policy's weights under Hugging Face names, in buckets of about `bucket_bytes` that never
        split a decoder layer (engines reload fused modules whole). A sharded backend gathers its shards
        bucket by bucket, so no rank holds the whole model twice."""
        ...

    def weight_versions(self) -> WeightVersions:
        """The version of each tensor `engine_weights` gives, which changes whenever that tensor may have (an
        optimizer step that updated it, a checkpoint load): the delta sync (rollout.engine.delta_sync) leaves out
        what an engine acknowledged at its current version. Cheap: nothing is gathered or read."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Live references to what resuming needs (this rank's shard if not `replicated`)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def hf_weights(self, state: dict[str, Any]) -> dict[str, Tensor]:
        """The Hugging Face-named policy weights within a (snapshot of a) `state_dict()`: how a `replicated`
        trainer's checkpoint export finds them (rank 0's snapshot holds the whole policy). Replicated only."""
        ...

    def stream_hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Collective (every rank reads it to the end): the whole policy under Hugging Face names on rank 0, a
        decoder layer's weights one after the other, each gathered as it is reached (valid until the stream
        goes on; other ranks may get nothing). A sharded trainer's checkpoint export and `save_hf` write its
        shards this way (yatt.checkpoint.export.write_weights), so no rank holds the whole policy."""
        ...

    def gather_adapter(self) -> dict[str, Any] | None:
        """Collective like `stream_hf_weights`: a host copy on rank 0 of the adapters as a snapshot's `state` holds
        them (what `save_adapter` takes), for a sharded trainer's checkpoint export; None elsewhere and without
        adapters."""
        ...

    @property
    def hf_config(self) -> Any:
        """The policy's transformers config (written next to exported weights)."""
        ...

    def save_hf(self, folder: str | Path, tokenizer: Any) -> None:
        """Write the policy as a Hugging Face folder (safetensors, config, tokenizer)."""
        ...

    def save_adapter(self, folder: str | Path, state: dict[str, Any] | None = None) -> None:
        """An export's adapter folder (peft's) of a snapshot's `state` (None: live); nothing without adapters."""
        ...

    def reference(self) -> Trainer | None:
        """The frozen reference model for free (LoRA: the policy with its adapter off), or None: the caller loads
        a frozen copy (`trainable=False`)."""
        ...

    def offload(self) -> dict[str, Any]:
        """Free the device for another role (weights, gradients, optimizer state to host); says what moved."""
        ...

    def onload(self) -> dict[str, Any]: ...
