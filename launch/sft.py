"""Supervised fine-tuning of a tiny yatt model or any Hugging Face causal LM (init_from), stopped on a held-out
accuracy threshold (yatt.quickstart.sft).

    python launch/sft.py --config configs/sft_quickstart.yaml [key.sub=value ...] [--force]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make the repo's yatt importable

import torch  # noqa: E402

from yatt.config_loading import ConfigError, load_config  # noqa: E402
from yatt.data.errors import DataError  # noqa: E402
from yatt.quickstart.sft import SFTConfig, changed_fields, run_sft  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML file of an SFTConfig")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides of the config")
    parser.add_argument("--force", action="store_true", help="train and replace the output folder even if it exists")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(SFTConfig, args.config, args.overrides)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    if cfg.output_dir.exists() and not args.force:
        changed = changed_fields(cfg, cfg.output_dir)
        if changed:  # e.g. a folder from an older checkout: running on from it would be a different experiment
            print(
                f"error: {cfg.output_dir} was trained from another config (it differs in {', '.join(changed)}); "
                "remove it, or pass --force, to train it again",
                file=sys.stderr,
            )
            return 2
        print(f"sft: {cfg.output_dir} already exists; skipping (pass --force to train again)")
        return 0
    torch.set_num_threads(cfg.threads)
    try:
        run_sft(cfg)
    except DataError as err:  # a bad row or file: one line naming it
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
