"""Text and chat messages -> a flat list of token ids, checked, with errors that name the row.

Tokenizers do not agree on what they return: `apply_chat_template(..., tokenize=True)` gives a list of ids
in transformers 4.x but a `BatchEncoding` in 5.x (whose iteration yields the *keys*, so `list()` of it is
`['input_ids', 'attention_mask']`). Everything that turns a row into ids goes through `flat_ids`, which
accepts the shapes seen in the wild and refuses anything that is not a flat list of ints.
"""

from __future__ import annotations

from collections.abc import Mapping

from yatt.data.errors import DataError


def flat_ids(encoded, where: str) -> list[int]:
    """A flat list of ints from a list, a (1, n) nested list, a tensor/array, or a mapping with input_ids."""
    if isinstance(encoded, Mapping):  # BatchEncoding is a Mapping
        if "input_ids" not in encoded:
            raise DataError(f"{where}: the tokenizer returned a mapping without 'input_ids' ({sorted(encoded)})")
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):  # torch tensor, numpy array
        encoded = encoded.tolist()
    if isinstance(encoded, (list, tuple)) and len(encoded) == 1 and isinstance(encoded[0], (list, tuple)):
        encoded = encoded[0]  # a batch of one
    if not isinstance(encoded, (list, tuple)):
        raise DataError(f"{where}: the tokenizer returned {type(encoded).__name__}, not a list of token ids")
    bad = next((t for t in encoded if not isinstance(t, int) or isinstance(t, bool)), None)
    if bad is not None:
        raise DataError(f"{where}: the tokenizer returned {bad!r} ({type(bad).__name__}) among the token ids; "
                        "expected a flat list of ints")
    return list(encoded)


def check_known_characters(tokenizer, text: str, ids: list[int], where: str) -> None:
    """Refuse text that the tokenizer can only encode as its unknown token (e.g. the tiny character tokenizer
    maps characters outside its alphabet to <pad>): training on it would silently corrupt the prompt."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or unk not in ids:
        return
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    for token, (start, end) in zip(enc["input_ids"], enc["offset_mapping"]):
        if token == unk and text[start:end] != tokenizer.unk_token:
            raise DataError(f"{where}: character {text[start:end]!r} (position {start}) is not in the tokenizer's "
                            f"vocabulary; it would become {tokenizer.unk_token!r}")


def text_ids(tokenizer, text: str, where: str) -> list[int]:
    """Plain text as the tokenizer splits it, without special tokens added."""
    ids = flat_ids(tokenizer(text, add_special_tokens=False)["input_ids"], where)
    check_known_characters(tokenizer, text, ids, where)
    return ids


def chat_ids(tokenizer, messages: list[dict], where: str, add_generation_prompt: bool = True) -> list[int]:
    """Chat messages through the tokenizer's chat template (rendered to text, then tokenized as text, so the
    result does not depend on what `tokenize=True` returns in this transformers version)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{where}: a chat row ('messages') needs a tokenizer with a chat template, and this one "
                        "has none; use 'prompt' rows or a tokenizer with a template")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    except Exception as err:  # jinja raises its own types (e.g. a template's raise_exception)
        raise DataError(f"{where}: the chat template failed on these messages: {err}") from None
    if not isinstance(text, str):
        raise DataError(f"{where}: apply_chat_template(tokenize=False) returned {type(text).__name__}, not text")
    return text_ids(tokenizer, text, where)
