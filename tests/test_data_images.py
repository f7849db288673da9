"""Image rows: the tiny VL policy folder, the visual task files, the `images` field, lazy per-rank image reads,
and clear errors (missing file, corrupt file, malformed field) that name the file and the row."""

import base64
import json

import pytest
import torch

from yatt.config import ExperimentConfig
from yatt.data import images as images_mod
from yatt.data.errors import DataError
from yatt.data.jsonl import read_jsonl_shard
from yatt.data.prepare import encode_prompts, load_rank_data
from yatt.distributed import World
from yatt.models.tiny_vl import TinyVLConfig, write_tiny_vl_model
from yatt.models.vision import ImageInputs, is_vision_model, load_policy
from yatt.quickstart.shapes import write_shapes_files

ONE = World(0, 1, 0, torch.device("cpu"))


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory):
    return write_tiny_vl_model(tmp_path_factory.mktemp("vl") / "policy")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes")
    write_shapes_files(out, sizes={"train": 12, "eval": 4})
    return out


def test_tiny_vl_folder_loads_in_transformers_and_expands_images(vl_folder, shapes):
    from transformers import AutoProcessor

    assert is_vision_model(vl_folder) and (vl_folder / "processor_config.json").is_file()
    model = load_policy(vl_folder, dtype=torch.float32)
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    assert any(".vision_model." in n for n, _ in model.named_parameters())
    cfg = TinyVLConfig()
    enc = ImageInputs(vl_folder)
    row = read_jsonl_shard([shapes / "train.jsonl"], 0, 1)[0]
    ids = encode_prompts([row], enc.processor.tokenizer, 256)[0]
    expanded, pixels = enc.encode(ids, [images_mod.read_image_bytes(row.images[0], row.where)])
    # the placeholder became <fake><global-img><image> x image_seq_len <fake>: what the processor gives on text
    reference = AutoProcessor.from_pretrained(vl_folder)(
        text=[row.prompt],
        images=[
            [images_mod.decode_image(images_mod.read_image_bytes(row.images[0], row.where), row.images[0], row.where)]
        ],
        add_special_tokens=False,
    )
    assert expanded == list(reference["input_ids"][0])
    assert len(expanded) == len(ids) - 1 + cfg.image_seq_len + 3
    assert pixels["pixel_values"].shape == (1, 1, 3, cfg.image_size, cfg.image_size)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([expanded]), **pixels)
    assert out.logits.shape[:2] == (1, len(expanded)) and torch.isfinite(out.logits).all()


def test_shapes_task_rows_are_consistent(shapes):
    from PIL import Image

    from yatt.quickstart.shapes import COLOURS

    rows = read_jsonl_shard([shapes / "train.jsonl"], 0, 1)
    assert len(rows) == 12 and all(r.prompt.startswith("<image>how many ") for r in rows)
    for r in rows:
        colour = r.prompt.removeprefix("<image>how many ").rstrip("?")
        pixels = Image.open(r.images[0]).convert("RGB")
        # count the cells whose centre has the asked colour: the answer must agree with the picture
        count = sum(pixels.getpixel((x * 16 + 8, y * 16 + 8)) == COLOURS[colour] for x in range(2) for y in range(2))
        assert str(count) == r.answer


def _write(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "images, message",
    [
        ("a.png", "'images' must be a non-empty list"),
        ([], "'images' must be a non-empty list"),
        ([3], r"images\[0\] must be a non-empty string"),
        (["data:text/plain;base64,AAAA"], r"images\[0\] is a data URI but not"),
    ],
)
def test_malformed_images_field_names_the_row(tmp_path, images, message):
    path = _write(tmp_path, [{"prompt": "x", "answer": "1"}, {"prompt": "y", "answer": "1", "images": images}])
    with pytest.raises(DataError, match=rf"{path}:2: {message}"):
        read_jsonl_shard([path], 0, 1)


def test_placeholders_must_match_images(tmp_path):
    path = _write(tmp_path, [{"prompt": "<image><image>how many red?", "images": ["a.png"]}])
    with pytest.raises(DataError, match=rf"{path}:1: 'prompt' has 2 <image> placeholder\(s\) for 1 image"):
        read_jsonl_shard([path], 0, 1)
    path = _write(tmp_path, [{"messages": [{"role": "user", "content": "how many?"}], "images": ["a.png", "b.png"]}])
    row = read_jsonl_shard([path], 0, 1)[0]
    assert row.messages[0]["content"] == "<image><image>how many?"  # put in front of the last user message
    assert row.images == [str(tmp_path / "a.png"), str(tmp_path / "b.png")]  # relative to the data file


def _cfg(model, train, eval_=None):
    return ExperimentConfig(
        model={"path": str(model)},
        data={
            "train": {"kind": "jsonl", "files": [str(train)]},
            **({"eval": {"kind": "jsonl", "files": [str(eval_)]}} if eval_ else {}),
        },
    )


def test_missing_or_corrupt_image_stops_before_engines_naming_file_and_row(tmp_path, vl_folder, shapes):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vl_folder)
    good = json.loads((shapes / "train.jsonl").read_text().splitlines()[0])
    good["images"] = [str(shapes / good["images"][0])]
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    missing = _write(tmp_path, [good, {**good, "images": ["nowhere.png"]}], "missing.jsonl")
    with pytest.raises(DataError, match=rf"{missing}:2: image file not found: {tmp_path / 'nowhere.png'}"):
        load_rank_data(_cfg(vl_folder, missing).data, ONE, tok)
    corrupt = _write(tmp_path, [good, {**good, "images": ["broken.png"]}], "corrupt.jsonl")
    with pytest.raises(DataError, match=rf"{corrupt}:2: image {tmp_path / 'broken.png'} is not a readable image"):
        load_rank_data(_cfg(vl_folder, corrupt).data, ONE, tok)
    bad_uri = _write(tmp_path, [good, {**good, "images": ["data:image/png;base64,@@@"]}], "uri.jsonl")
    with pytest.raises(DataError, match=rf"{bad_uri}:2: image data URI is not valid base64"):
        load_rank_data(_cfg(vl_folder, bad_uri).data, ONE, tok)
    # a data URI of a real PNG is as good as a file
    png = (shapes / good["images"][0]).read_bytes()
    uri = _write(
        tmp_path,
        [good, {**good, "images": ["data:image/png;base64," + base64.b64encode(png).decode()]}],
        "uri_ok.jsonl",
    )
    assert len(load_rank_data(_cfg(vl_folder, uri).data, ONE, tok).train) == 2
    # a text-only tokenizer cannot take image rows
    from yatt.models.tiny import DEFAULT_ALPHABET, build_char_tokenizer

    with pytest.raises(DataError, match=rf"{uri}:1: the row has images but the tokenizer has no <image> token"):
        encode_prompts(read_jsonl_shard([uri], 0, 1), build_char_tokenizer(DEFAULT_ALPHABET + "<>"), 256)


def test_a_rank_opens_only_its_own_rows_images(monkeypatch, vl_folder, shapes):
    """Instrument the one reader of image bytes; run the start-up check and every step's encoding on 2 ranks."""
    from transformers import AutoTokenizer

    from yatt.controllers.images import load_batch_images

    tok = AutoTokenizer.from_pretrained(vl_folder)
    opened: list[str] = []
    real = images_mod.read_image_bytes

    def spy(ref, where):
        opened.append(ref)
        return real(ref, where)

    monkeypatch.setattr(images_mod, "read_image_bytes", spy)
    cfg = _cfg(vl_folder, shapes / "train.jsonl", shapes / "eval.jsonl")
    all_rows = read_jsonl_shard([shapes / "train.jsonl"], 0, 1) + read_jsonl_shard([shapes / "eval.jsonl"], 0, 1)
    assert len({r.images[0] for r in all_rows}) == 16
    seen = {}
    for rank in (0, 1):
        opened.clear()
        world = _SoloRankWorld(rank, 2)
        data = load_rank_data(cfg.data, world, tok)
        own = {ref for r in data.train + data.eval for ref in r.images}
        assert set(opened) == own and len(opened) == len(own)  # the start-up check: each own image once
        opened.clear()
        encoded = load_batch_images(data.train[:3], ImageInputs(vl_folder), encode_prompts(data.train[:3], tok, 256))
        assert opened == [r.images[0] for r in data.train[:3]]  # a step reads its own rows' images, and only those
        assert all(e.pixels["pixel_values"].shape[1] == 1 for e in encoded)
        seen[rank] = own
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 16


class _SoloRankWorld(World):
    """Rank `rank` of `size` for the data-loading code, without a process group: the collectives that
    load_rank_data uses answer as if every other rank's data were fine (each rank is checked on its own here)."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size, rank, torch.device("cpu"))

    def sum(self, values):
        return [v * self.size for v in values[:2]] + [values[2]]

    def max(self, values):
        return list(values)


def test_restored_rollouts_get_their_images_back(vl_folder, shapes):
    """A checkpoint's rollouts (batches made ahead, dynamic sampling's queue) hold rows, not pixels: on resume
    each image prompt's images are read and encoded again, once per prompt, to the same pixels."""
    from transformers import AutoTokenizer

    from yatt.controllers.images import load_batch_images, reload_images
    from yatt.data.rollout import Rollout

    tok = AutoTokenizer.from_pretrained(vl_folder)
    rows = read_jsonl_shard([shapes / "train.jsonl"], 0, 1)[:2]
    encode = lambda rs: encode_prompts(rs, tok, 256)  # noqa: E731
    images = load_batch_images(rows, ImageInputs(vl_folder), encode(rows))
    saved = [
        Rollout(row, im.prompt_ids, [5], [-1.0], "stop", vision=im) for row, im in zip(rows, images) for _ in range(3)
    ]
    restored = [Rollout.from_dict(r.to_dict()) for r in saved]
    assert all(r.vision is None for r in restored)
    reload_images(restored, ImageInputs(vl_folder), encode)
    for before, after in zip(saved, restored):
        assert after.vision.prompt_ids == before.vision.prompt_ids and after.vision.images == before.vision.images
        for k, v in before.vision.pixels.items():
            assert torch.equal(after.vision.pixels[k], v)
    assert restored[0].vision is restored[2].vision and restored[0].vision is not restored[3].vision  # per prompt
