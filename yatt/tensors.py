"""The types several layers share: token batches, loss functions, named weights, their versions, dtypes, weight
buckets.

Nothing here imports another yatt module, so algorithms, balance, checkpoint, data, engines, trainers and the
controllers can all speak these types without importing each other (docs/architecture.md has the layering).

A `TokenBatch` holds prompt+response sequences, right-padded, with per-token tensors aligned to targets.
Per-token tensors have shape [B, L-1]: column t belongs to target token input_ids[:, t+1], predicted
from the logits at position t. `mask` is 1 where that target is a response token. A batch of image prompts
also carries `pixels`: the processor's image tensors once per distinct image prompt (yatt.models.vision), and
`image_index`: the pixel row each sequence's prompt takes its images from (-1: a text row). The G samples of a
prompt share one pixel row, so a batch holds a prompt's pixels once, not G times. A mixture-of-experts policy's
batch may carry `routing`: per input token (the [B, L] layout of input_ids, not the targets'), the experts each
MoE layer routes it to, [B, L, layers x k] (layer-major), -1 where the router chooses (yatt.models.routing;
routing replay). `engine_routing`, the same layout, is the engine's routing at the positions that predict
response tokens, to compare with, not to replay: a forward of a batch carrying it counts the positions whose
router's own top-k differs (moe/routing_mismatch).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

NamedTensors = list[tuple[str, torch.Tensor]]  # weights under Hugging Face parameter names
# the config's dtype names (engine.dtype, trainer.dtype) -> torch dtypes
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class WeightVersions:
    """The version of each weight a sync sends: a number that changes whenever the tensor the trainer sends under
    that name may have changed, so that an engine which acknowledged a name at a version holds those bytes (the delta
    sync, yatt.engines.delta). `named`: per Hugging Face name; `default`: every other name's (None: unknown, always
    sent). Numbers come from one trainer and mean nothing to another."""

    named: Mapping[str, int] = field(default_factory=dict)
    default: int | None = None

    def __call__(self, name: str) -> int | None:
        return self.named.get(name, self.default)


@dataclass
class TokenBatch:
    input_ids: Tensor  # [B, L] long
    attention_mask: Tensor  # [B, L] long
    mask: Tensor  # [B, L-1] float: response targets
    extras: dict[str, Tensor] = field(default_factory=dict)  # [B] or [B, L-1] tensors riding along
    # the sampling temperature of the responses: log-probs are of softmax(logits / temperature), the
    # distribution the engine sampled from (1.0 for data that was not sampled, e.g. SFT)
    temperature: float = 1.0
    # image prompts: the vision inputs the model takes next to input_ids (e.g. pixel_values), [P, ...] each, one
    # row per distinct image prompt, all of one image layout (count and size); empty for text
    pixels: dict[str, Tensor] = field(default_factory=dict)
    image_index: Tensor | None = None  # [B] long: each row's pixel row, -1 for a text row; None: no pixels
    # MoE routing replay: [B, L, layers x k] long expert indices per input token, -1: the router's own choice
    routing: Tensor | None = None
    # MoE routing mismatch: [B, L, layers x k] the engine's experts at the positions that predict response tokens
    # (-1: not compared), which a forward compares with its router's own top-k (before any replay); None: none
    engine_routing: Tensor | None = None

    @classmethod
    def from_sequences(cls, prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> TokenBatch:
        # laid out with whole-tensor ops, not a loop over rows: a model-parallel rank builds its whole
        # data-parallel rank's batch every step, and a Python loop cost ~14 ms per 512 rows on the 2-core box
        lengths = torch.tensor([len(p) + len(r) for p, r in zip(prompts, responses)], dtype=torch.long)
        starts = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long)  # the first response target
        width = int(lengths.max()) if len(prompts) else 2  # a rank may hold no samples after rebalancing
        cols = torch.arange(width)
        real = cols < lengths[:, None]
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        ids[real] = torch.tensor([t for p, r in zip(prompts, responses) for t in (*p, *r)], dtype=torch.long)
        targets = cols[:-1]
        mask = (targets >= starts[:, None]) & (targets < lengths[:, None] - 1)
        return cls(ids, real.long(), mask.float())

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def per_token(self, values: list[list[float]]) -> Tensor:
        """Lay response-aligned lists (e.g. rollout logprobs) into a [B, L-1] tensor under the mask."""
        out = torch.zeros_like(self.mask)
        if len(values) != len(self):
            raise ValueError(f"{len(values)} rows of values for a batch of {len(self)}")
        where = self.mask.bool()
        counts = where.sum(dim=1).tolist()
        for i, (row, count) in enumerate(zip(values, counts)):
            if len(row) != count:
                raise ValueError(f"row {i}: {len(row)} values for {count} response tokens")
        out[where] = torch.tensor([v for row in values for v in row], dtype=out.dtype)  # row-major: each row's own
        return out

    def select(self, rows: Tensor | list[int]) -> TokenBatch:
        """A sub-batch of `rows`, trimmed to its own longest sequence (less padding to compute)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        width = int(self.attention_mask[rows].sum(dim=1).max()) if len(rows) else 2
        extras = {k: (v[rows, : width - 1] if v.dim() == 2 else v[rows]) for k, v in self.extras.items()}
        pixels, index = select_pixels(self.pixels, self.image_index, rows)
        return TokenBatch(
            self.input_ids[rows, :width],
            self.attention_mask[rows, :width],
            self.mask[rows, : width - 1],
            extras,
            self.temperature,
            pixels,
            index,
            None if self.routing is None else self.routing[rows, :width],
            None if self.engine_routing is None else self.engine_routing[rows, :width],
        )

    def lengths(self) -> list[int]:
        """Real (unpadded) tokens per sequence."""
        return self.attention_mask.sum(dim=1).tolist()

    def to(self, device: torch.device) -> TokenBatch:
        return TokenBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.mask.to(device),
            {k: v.to(device) for k, v in self.extras.items()},
            self.temperature,
            {k: v.to(device) for k, v in self.pixels.items()},
            None if self.image_index is None else self.image_index.to(device),
            None if self.routing is None else self.routing.to(device),
            None if self.engine_routing is None else self.engine_routing.to(device),
        )


def select_pixels(
    pixels: dict[str, Tensor], index: Tensor | None, rows: Tensor
) -> tuple[dict[str, Tensor], Tensor | None]:
    """The pixel rows that `rows` use, in their order in `pixels`, and the rows' indices into them: a sub-batch
    holds each of its prompts' pixels once, and none of the others'."""
    if index is None or not pixels:
        return {}, None
    index = index[rows]
    used, inverse = torch.unique(index[index >= 0], return_inverse=True)
    if not len(used):
        return {}, None
    index = index.clone()
    index[index >= 0] = inverse
    return {k: v[used.to(v.device)] for k, v in pixels.items()}, index


# (logprobs [B, L-1] float32 with grad: log-prob of each target token under softmax(logits / mb.temperature)
#  -- with head="value" the value of each target token's prefix instead --,
#  entropy [B, L-1] with grad or None (only when train_mini_batch was asked for it), the micro-batch)
#  -> (loss, {stat: sum over its tokens}).  Backends never hand full-vocabulary logits to a loss: they may
#  compute these per-token values in chunks, packed, or sharded over the vocabulary.
LossFn = Callable[[Tensor, Tensor | None, TokenBatch], tuple[Tensor, dict[str, float]]]


_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def weight_buckets(named_tensors: NamedTensors, max_bytes: int) -> Iterator[NamedTensors]:
    """Split into buckets of at most ``max_bytes``, never splitting one decoder layer.

    vLLM reloads fused modules (qkv_proj, gate_up_proj) layer by layer: a module that receives only some
    of its parts in one reload is silently left half-updated. Keeping each ``*.layers.N.*`` group (or each
    module outside the layers) whole avoids that; a group larger than ``max_bytes`` is a bucket alone.
    A group's tensors come one after the other (a model's parameter order), so `named_tensors` is read as it
    comes: a sharded model's weights, gathered one at a time, are held one bucket at a time.
    """
    bucket: NamedTensors = []
    size = 0

    def groups() -> Iterator[NamedTensors]:
        items: NamedTensors = []
        key = None
        for name, t in named_tensors:
            m = _LAYER.match(name)
            this = m.group(1) if m else name.rpartition(".")[0]
            if items and this != key:
                yield items
                items = []
            items.append((name, t))
            key = this
        if items:
            yield items

    for items in groups():
        n = sum(t.numel() * t.element_size() for _, t in items)
        if bucket and size + n > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.extend(items)
        size += n
    if bucket:
        yield bucket
