"""Every quickstart's warm-up hands its run what the run needs, measured the way the run sees it (issue 44).

A warm-up (launch/sft.py, yatt.quickstart.sft_vl, yatt.quickstart.shapes_judge) writes a model folder that the
quickstart's run then reads with its own code: its tokenizer, its prompt encoding, its rollout engine and
verifier, or its GenRM `Judge` (template, engine, verdict parser). Were the two to disagree (a prompt encoded
another way, a verdict the run's parser cannot read), the run would start from nothing and neither side's own
tests would notice: the tools quickstart once shipped such a warm-up. Each test takes the warm-up's real code
with the quickstart's own warm-up settings, loads what it wrote through the run's code (the run's config file
with model.path pointed at it, the hf engine in process), and checks the start:
- the visual policy: its real warm-up (about 40 steps), on the run's held-out rows: the accuracy it stopped at,
  and every count answered right on some rows (GRPO can only reinforce answers the policy samples);
- the addition policy and the two judges: a warm-up fitted on the run's own rows (the full warm-ups take
  minutes; they run in `make quickstart*` and the slow tests), which the run must then answer (or judge)
  as the warm-up's own evaluation says it does.
The tools warm-up has its own module (tests/test_quickstart_tools_warmup.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from yatt.config import ExperimentConfig, load_experiment
from yatt.config_loading import load_config
from yatt.controllers.generation import sampling_specs
from yatt.controllers.images import load_batch_images
from yatt.controllers.rollouts import group_rollouts, score_rollouts
from yatt.data.prepare import load_rank_data
from yatt.distributed import World
from yatt.engines.base import generate
from yatt.engines.hf_engine import HFEngine
from yatt.genrm.judge import Judge, judge_engine
from yatt.models.tokenizer import load_tokenizer
from yatt.models.vision import ImageInputs, is_vision_model
from yatt.quickstart import judge_data, shapes_judge
from yatt.quickstart.addition import read_jsonl, write_jsonl
from yatt.quickstart.sft import SFTConfig, run_sft
from yatt.quickstart.sft_vl import run_sft_vl
from yatt.quickstart.shapes import write_shapes_files

REPO = Path(__file__).resolve().parents[1]
ONE_RANK = World(rank=0, size=1, local_rank=0, device=torch.device("cpu"))
FITTED = 64  # rows a fitted warm-up learns, and the run reads back


def run_config(config: str, *overrides: str) -> ExperimentConfig:
    """The quickstart's run config, as `make` starts it, with `overrides` (model.path, data files)."""
    return load_experiment(REPO / config, list(overrides))


def hf_engine(folder: Path, engine) -> HFEngine:
    """The run's engine section with the hf backend, in process (the run's vLLM, where it has one, is checked
    against hf in tests/test_vllm_engine.py)."""
    return HFEngine(str(folder), engine.model_copy(update={"backend": "hf"}), seed=0)


def greedy_rewards(run: ExperimentConfig) -> list[tuple[str, str, float]]:
    """(gold answer, response, rule reward) of the run's greedy evaluation, every held-out row read, encoded,
    generated and scored by the run's own functions."""
    tokenizer = load_tokenizer(run.model.path)
    data = load_rank_data(run.data, ONE_RANK, tokenizer, run.reward.verifiers)
    images = ImageInputs(run.model.path) if is_vision_model(run.model.path) else None
    loaded = load_batch_images(data.eval, images, data.eval_prompt_ids)
    _, greedy = sampling_specs(run.rollout, tokenizer.eos_token_id)
    engine = hf_engine(run.model.path, run.rollout.engine)
    try:
        with_images = {"images": [im.images if im else None for im in loaded]} if images else {}
        completions = generate(engine, data.eval_prompt_ids, greedy, **with_images)
    finally:
        engine.shutdown()
    rollouts = [
        r
        for row, ids, im, c in zip(data.eval, data.eval_prompt_ids, loaded, completions)
        for r in group_rollouts(row, ids, im, c, tokenizer)
    ]
    score_rollouts(rollouts)
    return [(r.row.answer, r.text, r.reward) for r in rollouts]


def judged(judge_cfg, cases: list[tuple[str, str | None, str, list[bytes] | None]]) -> list[float]:
    """The run's GenRM scores of (question, reference, response, images) cases: its `Judge` renders and parses,
    its engine section serves (hf, in process)."""
    judge = Judge(judge_cfg)
    requests = [judge.request(*case) for case in cases]
    engine = hf_engine(judge_cfg.model, judge_engine(judge_cfg))
    try:
        with_images = {"images": [im for _, im in requests]} if any(im for _, im in requests) else {}
        completions = generate(engine, [ids for ids, _ in requests], judge.sampling, **with_images)
    finally:
        engine.shutdown()
    return [judge.score(c).score for c in completions]


def fit(warmup: str, rows: Path, out: Path, *overrides: str) -> dict:
    """launch/sft.py's training with `warmup`'s settings on `rows` alone (they are also its eval rows), until
    its own greedy evaluation gets them all right; its summary."""
    fixed = [f"sft_file={rows}", f"eval_file={rows}", f"output_dir={out}", "stop_at_accuracy=1.0", "log_every=0"]
    often = ["eval_every=25", "eval_often_every=25", "warmup_steps=0"]
    return run_sft(load_config(SFTConfig, REPO / warmup, fixed + often + list(overrides)), log=lambda *a: None)


def test_the_addition_run_answers_what_its_warmup_learned(tmp_path):
    """The policy fitted on 32 of the run's held-out rows (at a higher lr than the real warm-up's, which only
    changes how soon it fits: 200 steps) answers them in the run as its own evaluation says it does."""
    rows, count = tmp_path / "rows.jsonl", FITTED // 2
    write_jsonl(rows, read_jsonl(REPO / "data/addition/eval.jsonl")[:count])
    summary = fit("configs/sft_quickstart.yaml", rows, tmp_path / "policy", "lr=5e-3", "max_steps=600")
    assert summary["final_accuracy"] >= 0.9, summary
    run = run_config("configs/quickstart.yaml", f"model.path={tmp_path / 'policy'}", f"data.eval.files=[{rows}]")
    rewards = [reward for _, _, reward in greedy_rewards(run)]
    assert len(rewards) == count
    assert sum(r >= 1.0 for r in rewards) / count >= summary["final_accuracy"] - 1 / count, rewards


@pytest.mark.parametrize("stage", ["basic", "near_miss"])
def test_the_genrm_run_reads_its_judge_s_verdicts(tmp_path, stage):
    """The judge's rows are the run's judgements: `Judge.request` renders each case to the ids the warm-up
    trained on, and a judge fitted on them gives the run the rule's verdicts (configs/sft_judge.yaml trains on
    basic rows, configs/sft_judge_near_miss.yaml goes on from it on near misses, into the run's judge folder)."""
    addition = read_jsonl(REPO / "data/addition/eval.jsonl")[:FITTED]
    cases = judge_data.judge_cases(addition, seed=1, mix=stage)  # as judge_eval_{stage}.jsonl is written
    rows = tmp_path / "rows.jsonl"
    write_jsonl(rows, judge_data.judge_rows(addition, seed=1, mix=stage))
    assert rows.read_text() == "".join(
        line + "\n" for line in (REPO / f"data/addition/judge_eval_{stage}.jsonl").read_text().splitlines()[:FITTED]
    )
    summary = fit("configs/sft_judge.yaml", rows, tmp_path / "judge", "max_steps=300")
    assert summary["final_accuracy"] >= 0.9, summary
    second = load_config(SFTConfig, REPO / "configs/sft_judge_near_miss.yaml")
    first = load_config(SFTConfig, REPO / "configs/sft_judge.yaml")
    run = run_config("configs/quickstart_genrm.yaml")
    [judge_cfg] = run.reward.judges
    assert second.init_from == first.output_dir and second.output_dir == judge_cfg.model
    judge_cfg = judge_cfg.model_copy(update={"model": tmp_path / "judge"})
    tokenizer = load_tokenizer(tmp_path / "judge")
    requests = [Judge(judge_cfg).request(q, ref, resp) for q, ref, resp, _ in cases]
    trained = [json.loads(line)["prompt"] for line in rows.read_text().splitlines()]
    assert [ids for ids, _ in requests] == [tokenizer(t, add_special_tokens=False)["input_ids"] for t in trained]
    scores = judged(judge_cfg, [(q, ref, resp, None) for q, ref, resp, _ in cases])
    agree = sum(score == (label == "yes") for score, (*_, label) in zip(scores, cases)) / len(cases)
    assert agree >= summary["final_accuracy"] - 2 / FITTED, (agree, summary)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    """The shapes task as `make quickstart-vl` writes it (its default sizes: a few seconds)."""
    data = tmp_path_factory.mktemp("shapes")
    write_shapes_files(data)
    return data


def test_the_visual_run_starts_where_its_warmup_stopped(shapes, tmp_path):
    """The real warm-up (`python -m yatt.quickstart.sft_vl` with its defaults), then the run's held-out
    evaluation of what it wrote: the accuracy the warm-up stopped at, and every count answered right on some
    rows (RL can only reinforce counts the policy gives)."""
    policy = tmp_path / "policy"
    result = run_sft_vl(shapes, policy, log=lambda *a: None)
    run = run_config(
        "configs/quickstart_vl.yaml",
        f"model.path={policy}",
        f"data.eval.files=[{shapes / 'eval.jsonl'}]",
        f"data.train.files=[{shapes / 'train.jsonl'}]",
    )
    scored = greedy_rewards(run)
    accuracy = sum(reward >= 1.0 for *_, reward in scored) / len(scored)
    assert accuracy >= 0.3 and abs(accuracy - result["accuracy"]) <= 0.02, (accuracy, result["accuracy"])
    counts = {answer for answer, _, reward in scored if reward >= 1.0}
    assert counts == {answer for answer, *_ in scored}, f"right only on counts {sorted(counts)}"


def test_the_visual_genrm_run_reads_its_judge_s_verdicts(shapes, tmp_path):
    """The VL judge fitted on the run's judgements (rows of `shapes_judge.judge_rows`, the template of
    configs/quickstart_vl_genrm.yaml): the run's Judge, seeing the prompt's image, gives the rule's verdicts."""
    run = run_config("configs/quickstart_vl_genrm.yaml")
    [judge_cfg] = run.reward.judges
    assert judge_cfg.template == shapes_judge.TEMPLATE and judge_cfg.verdict == shapes_judge.VERDICT
    policy_rows = read_jsonl(shapes / "eval.jsonl")[: FITTED // 2]
    cases = shapes_judge.judge_cases(policy_rows, seed=1)
    write_jsonl(shapes / "fitted_judge.jsonl", shapes_judge.judge_rows(policy_rows, seed=1))
    result = shapes_judge.train_judge(
        shapes,
        tmp_path / "judge",
        stop_at=1.0,
        train_file="fitted_judge.jsonl",
        eval_file="fitted_judge.jsonl",
        max_steps=400,
        eval_every=25,
        log=lambda *a: None,
    )
    assert result["accuracy"] >= 0.9, result
    judge_cfg = judge_cfg.model_copy(update={"model": tmp_path / "judge"})
    requests = [
        (row["prompt"], None, resp, [(shapes / ref).read_bytes() for ref in row["images"]]) for row, resp, _ in cases
    ]
    scores = judged(judge_cfg, requests)
    agree = sum(score == verdict.endswith("yes") for score, (*_, verdict) in zip(scores, cases)) / len(cases)
    assert agree >= result["accuracy"] - 2 / FITTED, (agree, result["accuracy"])
