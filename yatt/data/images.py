"""Images of prompt rows: the `images` field, and reading one image's bytes when (and only when) a step needs it.

A row may carry `images: [ref, ...]` next to `prompt`/`messages`. A ref is a file path, relative to the data
file that holds the row (absolute paths are kept), or a data URI (`data:image/png;base64,...`). The row's text
marks where each image goes with the placeholder `<image>`; a row with images and no placeholder gets one per
image in front of its prompt (or its last user message). Placeholder count and image count must agree.

Rows hold only the refs (short strings). The bytes are read by the rank that owns the row, for the step that
uses it (`read_image_bytes`), and are dropped with that step's rollouts; `check_row_images` opens each of a
rank's images once before any engine starts (data.check_images), so a missing or corrupt file stops the run
with one line naming the file and the row. Every read goes through `read_image_bytes`, which is what tests
instrument to show that a rank never opens another rank's images.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from yatt.data.errors import DataError

if TYPE_CHECKING:
    from torch import Tensor

IMAGE_PLACEHOLDER = "<image>"
_DATA_URI = "data:"


def parse_images(value, base_dir: Path | None, where: str) -> list[str]:
    """Validate a record's `images` value and resolve relative paths against `base_dir`; [] when absent."""
    if value is None:
        return []
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: 'images' must be a non-empty list of file paths or data URIs, "
                        f"got {type(value).__name__}")
    refs = []
    for i, ref in enumerate(value):
        if not isinstance(ref, str) or not ref.strip():
            raise DataError(f"{where}: images[{i}] must be a non-empty string (a file path or a data URI), "
                            f"got {ref!r}"[:300])
        if ref.startswith(_DATA_URI):
            head, sep, _ = ref.partition(",")
            if not sep or not head.endswith(";base64") or not head[len(_DATA_URI):].startswith("image/"):
                raise DataError(f"{where}: images[{i}] is a data URI but not 'data:image/<type>;base64,<data>' "
                                f"({head[:60]!r})")
            refs.append(ref)
        else:
            path = Path(ref)
            refs.append(str(path if path.is_absolute() or base_dir is None else base_dir / path))
    return refs


def place_image_markers(text: str, count: int, where: str, field: str) -> str:
    """`text` with exactly `count` image placeholders: as written, or `count` of them put in front."""
    found = text.count(IMAGE_PLACEHOLDER)
    if found == 0:
        return IMAGE_PLACEHOLDER * count + text
    if found != count:
        raise DataError(f"{where}: '{field}' has {found} {IMAGE_PLACEHOLDER} placeholder(s) for {count} image(s)")
    return text


def describe_ref(ref: str) -> str:
    return f"data URI ({len(ref)} chars)" if ref.startswith(_DATA_URI) else ref


def read_image_bytes(ref: str, where: str) -> bytes:
    """The encoded bytes (PNG, JPEG, ...) of one image: the file's contents or the data URI's payload."""
    if ref.startswith(_DATA_URI):
        try:
            return base64.b64decode(ref.partition(",")[2], validate=True)
        except (binascii.Error, ValueError) as err:
            raise DataError(f"{where}: image data URI is not valid base64 ({err})") from None
    try:
        return Path(ref).read_bytes()
    except FileNotFoundError:
        raise DataError(f"{where}: image file not found: {ref}") from None
    except OSError as err:
        raise DataError(f"{where}: cannot read image file {ref}: {err.strerror or err}") from None


def decode_image(data: bytes, ref: str, where: str):
    """Encoded bytes -> an RGB PIL image; a file PIL cannot decode is a DataError naming it and the row."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()  # decode now: a truncated file fails here, not inside an engine
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise DataError(f"{where}: image {describe_ref(ref)} is not a readable image ({err})") from None


def check_row_images(refs: list[str], where: str) -> None:
    """Read and decode each image once (then drop it): a missing or corrupt image fails before engines start."""
    for ref in refs:
        decode_image(read_image_bytes(ref, where), ref, where)


@dataclass
class PromptImages:
    engine_ids: list[int]  # the prompt with one placeholder per image (what engines receive)
    images: list[bytes]  # the images' encoded bytes, in placeholder order
    prompt_ids: list[int]  # the expanded prompt (what the model sees and the trainer scores)
    pixels: dict[str, Tensor]  # the processor's image tensors, batch dimension 1

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.images) + sum(t.numel() * t.element_size() for t in self.pixels.values())
