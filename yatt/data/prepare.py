"""A rank's data, read and checked before any engine starts.

Every row of the rank's train and eval shards is tokenized once here (chat template included), so a bad row
(not UTF-8, not JSON, a missing column, a character the tokenizer cannot encode, a prompt longer than
data.max_prompt_tokens, a template that does not give a flat list of ids, a data_source without a verifier) stops
the run with one line naming the row, instead of failing inside an engine minutes later. reward.verifiers are
imported here too (yatt.rewards.rules.use_verifiers). Ranks agree on the outcome with one collective: the rank
that found the problem raises it, the others raise a quiet DataError so the launcher prints one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from yatt.data.config import DataConfig
from yatt.data.errors import DataError
from yatt.data.images import IMAGE_PLACEHOLDER, check_row_images
from yatt.data.rows import PromptRow
from yatt.data.sources import describe, load_shard
from yatt.rewards.rules import use_verifiers


@dataclass
class RankData:
    train: list[PromptRow]
    eval: list[PromptRow]  # may be empty on some ranks (fewer held-out rows than ranks), never on all
    eval_prompt_ids: list[list[int]]


def encode_prompts(rows: list[PromptRow], tokenizer, max_prompt_tokens: int) -> list[list[int]]:
    """Prompt ids per row, each a flat list of ints no longer than max_prompt_tokens (else DataError).
    A row with images keeps one placeholder token per image here (engines and the trainer expand them)."""
    encoded = []
    image_id = None
    for row in rows:
        ids = row.prompt_ids(tokenizer)
        if not ids:
            raise DataError(f"{row.where}: the prompt is empty after tokenization")
        if row.images:
            image_id = image_id if image_id is not None else image_token_id(tokenizer, row.where)
            if ids.count(image_id) != len(row.images):
                raise DataError(f"{row.where}: the tokenized prompt has {ids.count(image_id)} image placeholder "
                                f"token(s) for {len(row.images)} image(s) (does the chat template drop them?)")
        if len(ids) > max_prompt_tokens:
            raise DataError(f"{row.where}: the prompt has {len(ids)} tokens, more than "
                            f"data.max_prompt_tokens={max_prompt_tokens}")
        encoded.append(ids)
    return encoded


def image_token_id(tokenizer, where: str) -> int:
    """The id of the image placeholder; a tokenizer without it cannot take image rows."""
    token = tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
    if token is None or token == tokenizer.unk_token_id:
        raise DataError(f"{where}: the row has images but the tokenizer has no {IMAGE_PLACEHOLDER} token "
                        "(use a vision-language policy, e.g. yatt.models.tiny_vl)")
    return int(token)


def _read(data: DataConfig, verifiers: Mapping[str, str], rank: int, world_size: int, tokenizer) -> RankData:
    train = load_shard(data.train, rank, world_size)
    encode_prompts(train, tokenizer, data.max_prompt_tokens)  # checks every row; steps encode their batch again
    evals = load_shard(data.eval, rank, world_size, limit=data.eval_prompts) if data.eval is not None else []
    if data.check_images:  # this rank's rows only, one image at a time
        for row in train + evals:
            check_row_images(row.images, row.where)
    use_verifiers(verifiers, train + evals)  # every row can be scored (reward.verifiers imported)
    return RankData(train, evals, encode_prompts(evals, tokenizer, data.max_prompt_tokens))


def load_rank_data(data: DataConfig, world, tokenizer, verifiers: Mapping[str, str] | None = None) -> RankData:
    """This rank's checked data (`verifiers`: reward.verifiers, imported so that every row can be scored); raises
    DataError on every rank if any rank's data is unusable."""
    error = None
    try:
        out = _read(data, verifiers or {}, world.rank, world.size, tokenizer)
        counts = [float(len(out.train)), float(len(out.eval)), 0.0]
    except DataError as err:
        error, counts = err, [0.0, 0.0, 1.0]
    train_min = world.max([-counts[0]])[0] * -1.0  # the smallest train shard
    train_total, eval_total, failed = world.sum(counts)
    if error is not None:
        raise error
    if failed:
        raise DataError("another rank's data is unusable (it printed why)", quiet=True)
    if train_total == 0:
        raise DataError(f"data.train: no rows in {describe(data.train)}", quiet=not world.is_main)
    if train_min == 0:
        raise DataError(f"data.train: {int(train_total)} row(s) in {describe(data.train)} cannot give each of "
                        f"{world.size} ranks at least one", quiet=not world.is_main)
    if data.eval is not None and eval_total == 0:
        raise DataError(f"data.eval: no rows in {describe(data.eval)} (remove data.eval to run without "
                        "held-out evaluation)", quiet=not world.is_main)
    return out
