"""Judges of image prompts (yatt.genrm.judge): a vision-language judge gets the prompt's images with its request,
at the template's {images}; a text-only judge gets the text alone. Tiny models built here; the engine test runs
real hf and vLLM judge engines as services behind the pools generate_and_judge uses."""

from __future__ import annotations

import pytest

from yatt.agents.config import AgentConfig
from yatt.config import load_experiment
from yatt.config_loading import ConfigError
from yatt.controllers.conversations import Agent
from yatt.controllers.generation import JudgeLane, generate_and_judge
from yatt.controllers.images import load_batch_images
from yatt.data.jsonl import read_jsonl_shard
from yatt.data.prepare import encode_prompts
from yatt.engines.base import SamplingSpec
from yatt.engines.client import spawn_engine
from yatt.engines.config import EngineConfig
from yatt.engines.pool import EnginePool
from yatt.genrm.config import JudgeConfig
from yatt.genrm.judge import Judge
from yatt.models.tiny import TinyModelConfig, write_tiny_model
from yatt.models.tiny_vl import write_tiny_vl_model
from yatt.models.tokenizer import load_tokenizer
from yatt.models.vision import ImageInputs
from yatt.preflight import check_run
from yatt.quickstart.shapes import write_shapes_files

TEMPLATE = "{images}{question}:{response}?"
HF = EngineConfig(backend="hf", max_model_len=128, max_num_seqs=64, startup_timeout_s=120)
VLLM = EngineConfig(max_model_len=128, max_num_seqs=64, vllm={"kv_cache_gib": 0.25}, startup_timeout_s=300)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_judge")
    write_shapes_files(root / "data", sizes={"train": 4})
    return {
        "data": root / "data",
        "policy": write_tiny_vl_model(root / "policy", seed=1),
        "vl": write_tiny_vl_model(root / "vl_judge", seed=2),
        "text": write_tiny_model(root / "text_judge", TinyModelConfig(), seed=3),
    }


def image_bytes(folders) -> bytes:
    return (folders["data"] / "images" / "train_000000.png").read_bytes()


def test_a_vl_judge_sees_the_images_at_their_field(folders):
    judge = Judge(JudgeConfig(name="vl", model=folders["vl"], template=TEMPLATE))
    image = image_bytes(folders)
    ids, seen = judge.request("<image>how many red?", "2", "3<image>", [image])
    assert seen == [image]
    # the question's marker and one written by the policy are no images: only {images} places one
    assert ids == judge.tokenizer("<image>how many red?:3?", add_special_tokens=False)["input_ids"]
    assert ids.count(judge.image_id) == 1 and ids[0] == judge.image_id
    # without {images} in the template the images go in front, as in a data row without markers
    front = Judge(JudgeConfig(name="vl", model=folders["vl"], template="{question}:{response}?"))
    assert front.request("<image>how many red?", "2", "3", [image]) == (ids, [image])
    # a text prompt: judged on its text, no images
    ids, seen = judge.request("how many red?", "2", "3", None)
    assert seen is None and judge.image_id not in ids


def test_a_long_vl_judge_prompt_keeps_its_images_and_the_end(folders):
    """The context counts each image as the judge's engine expands it (7 tokens for the tiny model)."""
    image = image_bytes(folders)
    cfg = JudgeConfig(name="vl", model=folders["vl"], template=TEMPLATE, max_tokens=6, engine=HF)
    judge = Judge(cfg.model_copy(update={"engine": HF.model_copy(update={"max_model_len": 20})}))
    text = judge.tokenizer("how many red?:3?", add_special_tokens=False)["input_ids"]
    ids, _ = judge.request("<image>how many red?", None, "3", [image])
    assert ids == [judge.image_id] + text[-7:]  # 14 prompt tokens: the image's 7 and the text's last 7
    tight = Judge(cfg.model_copy(update={"engine": HF.model_copy(update={"max_model_len": 12})}))
    with pytest.raises(ValueError, match="image\\(s\\) alone need more"):
        tight.request("<image>how many red?", None, "3", [image])


def test_a_text_judge_reads_the_text_of_an_image_prompt(folders):
    judge = Judge(JudgeConfig(name="text", model=folders["text"], template="{question}{reference}:{response}?"))
    ids, seen = judge.request("<image>how many red?", "2", "3", [image_bytes(folders)])
    assert seen is None
    assert ids == judge.tokenizer("how many red?2:3?", add_special_tokens=False)["input_ids"]


def test_images_field_needs_a_vl_judge(folders, tmp_path):
    config = tmp_path / "exp.yaml"
    config.write_text(f"""
model: {{path: {folders["policy"]}}}
data:
  train: {{kind: jsonl, files: [{folders["data"] / "train.jsonl"}]}}
  prompts_per_step: 2
  max_prompt_tokens: 32
rollout: {{engine: {{backend: hf}}}}
reward:
  kind: genrm
  judges: [{{name: text, model: {folders["text"]}, template: "{TEMPLATE}", engine: {{backend: hf}}}}]
run: {{output_dir: {tmp_path / "runs"}}}
""")
    with pytest.raises(ConfigError, match=r"reward.judges\[text\].template: \{images\} needs a vision-language judge"):
        check_run(load_experiment(config), 2, str(config))


class Recording(EnginePool):
    """A real pool over real engines that also keeps the requests sent through it."""

    def __init__(self, client):
        super().__init__({"e": client})
        self.sent = []

    def submit(self, requests) -> None:
        self.sent += requests
        super().submit(requests)


@pytest.mark.engine
@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])  # vLLM VL: test_vl_engines
def test_judge_requests_carry_the_images_to_a_vl_judge_only(folders, tmp_path, backend):
    """Real engines: a VL policy rolls out image prompts, a VL judge and a text judge read every sample. The VL
    judge's engine gets each sample's prompt images (and could not serve its placeholders without them), the
    text judge's engine none (an hf text engine refuses images)."""
    engine = {"hf": HF, "vllm": VLLM}[backend]
    tok = load_tokenizer(folders["policy"])
    rows = read_jsonl_shard([folders["data"] / "train.jsonl"], 0, 1)
    prompt_ids = encode_prompts(rows, tok, 32)
    images = load_batch_images(rows, ImageInputs(folders["policy"]), prompt_ids)
    judges = {
        "vl": Judge(JudgeConfig(name="vl", model=folders["vl"], template=TEMPLATE, max_tokens=3, engine=engine)),
        "text": Judge(
            JudgeConfig(
                name="text", model=folders["text"], template="{question}:{response}?", max_tokens=3, engine=engine
            )
        ),
    }
    sampling = SamplingSpec(n=2, temperature=1.0, max_tokens=2, stop_token_ids=[tok.eos_token_id], logprobs=True)
    spawn = dict(seed=0, log_path=tmp_path / "engine.log")
    with (
        spawn_engine(folders["policy"], HF, **spawn) as policy,
        spawn_engine(folders["vl"], engine, **spawn) as vl,
        spawn_engine(folders["text"], engine, **spawn) as text,
    ):
        lanes = {"vl": JudgeLane(judges["vl"], Recording(vl)), "text": JudgeLane(judges["text"], Recording(text))}
        rollouts, stats = generate_and_judge(
            rows, prompt_ids, [1, 2, 3, 4], sampling, tok, EnginePool({"p": policy}), lanes,
            step=1, run_seed=0, stream=True, images=images, agent=Agent.build(AgentConfig(), tok),
        )  # fmt: skip
    assert len(rollouts) == 8 and stats.judged == 16
    assert all(set(r.judge_scores) == {"vl", "text"} for r in rollouts)
    vl_image = judges["vl"].image_id
    for req in lanes["vl"].pool.sent:
        group = int(req.key.split("/")[1][1:])
        assert req.images == images[group].images and req.prompt.count(vl_image) == 1
    for req in lanes["text"].pool.sent:
        assert req.images is None
        assert judges["text"].tokenizer.decode(req.prompt).startswith("how many")
