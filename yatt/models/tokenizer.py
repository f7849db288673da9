"""Loading a model folder's tokenizer as it was written.

transformers 5's `AutoTokenizer` builds the tokenizer class of the folder's model type: for a Qwen2 folder a
byte-level BPE `Qwen2Tokenizer`, whatever `tokenizer.json` says. A tokenizer written from a `tokenizers` object
(yatt.models.tiny's character tokenizer, `tokenizer_class: TokenizersBackend`) then loses what its own
pre-tokenizer kept: "\\n" and " " become byte-level symbols that are not in its vocabulary and are dropped. Such a
folder is loaded as the generic fast tokenizer over its `tokenizer.json`; any other goes through `AutoTokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERIC = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(folder: str | Path, **kwargs: Any):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = Path(folder) / "tokenizer_config.json"
    if config.is_file() and (Path(folder) / "tokenizer.json").is_file():
        if json.loads(config.read_text()).get("tokenizer_class") in GENERIC:
            return PreTrainedTokenizerFast.from_pretrained(str(folder), **kwargs)
    return AutoTokenizer.from_pretrained(str(folder), **kwargs)
