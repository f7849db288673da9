"""The composition matrix: yatt's features run together, pairwise. Twelve dimensions (trainer backend, placement,
reward, balancing, HF export in checkpoints, algorithm (GRPO, PPO with a critic, on-policy distillation), dynamic
sampling, rollout schedule, LoRA, dense or MoE policy, agent loop, text or image prompts) would make 23040 runs;
every pair of values of every two dimensions that yatt takes appears in at least one of the 17 combinations below,
so a bug that needs two features at once to show (the usual kind) shows here. Each combination is a real 2-rank
torchrun run of 2 steps with tiny models and hf engines: it must exit 0, log only finite metrics, log the keys of
its features, and (export on) leave an HF folder in its checkpoint that transformers loads. The main combination
(megatron TP=2, partial placement, a GenRM judge, balancing) runs 3 steps, saving each, and also resumes exactly
after kill -9 during a background checkpoint write: its one uninterrupted run serves both tests. An environment
package as the data source and agent loop (verifiers) is a row of its own with an ahead schedule, FSDP2, balancing,
LoRA and an HF export."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import signal
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from e2e import JUDGE_TINY, bigram_table, experiment, process_tree, torchrun
from megatron_ranks import HAVE_MEGATRON
from safetensors.torch import load_file
from test_checkpoint_resume_e2e import comparable, finish, launch, logged_steps, wait_for
from test_megatron_composed_e2e import varied_rows
from test_megatron_e2e import DIGITS_TP
from test_verifiers_env import chat_policy, guessing_policy, needs_verifiers, small_nltk_data
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from yatt.checkpoint.manifest import verify
from yatt.config import load_experiment
from yatt.config_loading import ConfigError
from yatt.models.tiny import write_tiny_model
from yatt.quickstart.sft_vl import run_sft_vl
from yatt.quickstart.shapes import write_shapes_files
from yatt.refusals import launch_refusals

HAS_ENV_PACKAGE = importlib.util.find_spec("vf_reasoning_gym") is not None  # implies verifiers


class Combination(NamedTuple):
    # torch (DDP) | fsdp2 (torch, trainer.torch.parallel) | tp2 | pp2 (megatron tensor/pipeline=2) | ep2 (megatron
    # expert_parallel=2: the MoE policy's experts split over the ranks)
    backend: str
    placement: str  # full | partial
    reward: str  # rule (no judge) | genrm (the judge alone) | mixed (genrm_with_rule)
    balance: bool
    export_hf: bool  # checkpoint.export_hf, with a checkpoint at the last step
    algorithm: str  # grpo | ppo (GAE advantages from a critic) | distill (on-policy distillation from a teacher)
    dynamic: bool  # algorithm.dynamic_sampling.enabled
    # sync | one_step_off (rollout.schedule.mode: the next batch generated while this one trains; an MoE policy's
    # single-turn runs also resume the requests a push cuts, in_flight=resume, so r3 replays resumed samples)
    schedule: str
    lora: bool  # model.lora (rank 2, merged sync)
    policy: str  # dense | moe (a tiny Qwen3-MoE, routing replay r3)
    agent: str = "single_turn"  # single_turn | tool_loop (rollout.agent: the calculator, 2 turns, in lockstep)
    prompts: str = "text"  # text | images (the counting-squares task, a tiny VL policy warmed up on it)

    @property
    def id(self) -> str:
        flags = [("bal", self.balance), ("exp", self.export_hf), ("ds", self.dynamic), ("osf", self.schedule != "sync"),
                 ("lora", self.lora), ("moe", self.policy == "moe"), ("tools", self.agent == "tool_loop"),
                 ("img", self.prompts == "images")]  # fmt: skip
        return "-".join([self.backend, self.placement, self.reward, self.algorithm] + [n for n, on in flags if on])


DIMENSIONS = {
    "backend": ("torch", "fsdp2", "tp2", "pp2", "ep2"),
    "placement": ("full", "partial"),
    "reward": ("rule", "genrm", "mixed"),
    "balance": (True, False),
    "export_hf": (True, False),
    "algorithm": ("grpo", "ppo", "distill"),
    "dynamic": (True, False),
    "schedule": ("sync", "one_step_off"),
    "lora": (False, True),
    "policy": ("dense", "moe"),
    "agent": ("single_turn", "tool_loop"),
    "prompts": ("text", "images"),
}
MEGATRON = ("tp2", "pp2", "ep2")
TORCH = ("torch", "fsdp2")


def allowed(c: Combination) -> bool:
    """What yatt refuses (yatt.refusals): partial placement without a judge or a distillation teacher (it splits the
    devices between rollout and them); LoRA on the megatron backend; with a vision-language policy (image prompts),
    LoRA, agent loops, distillation and PPO's critic. And what the matrix's models are: the VL policy is dense,
    megatron's MoE policy is the EP=2 one (ep2, no other policy; tp2 and pp2 are dense)."""
    partial_without_judge = c.placement == "partial" and c.reward == "rule" and c.algorithm != "distill"
    vl = c.prompts == "images" and (c.algorithm != "grpo" or c.lora or c.agent != "single_turn" or c.policy == "moe")
    megatron = c.backend in MEGATRON and (c.lora or (c.policy == "moe") != (c.backend == "ep2"))
    return not (partial_without_judge or vl or megatron)


# a seeded greedy search, pruned of rows the others made redundant (test_the_matrix_covers_every_allowed_pair keeps
# it honest); the first is the main combination
MAIN = Combination("tp2", "partial", "genrm", True, True, "grpo", False, "sync", False, "dense")
ST, TOOLS = "single_turn", "tool_loop"
COMBINATIONS = [
    MAIN,
    Combination("ep2", "full", "rule", False, False, "distill", True, "one_step_off", False, "moe", TOOLS),
    Combination("fsdp2", "full", "mixed", True, True, "ppo", True, "sync", True, "dense", TOOLS),
    Combination("torch", "partial", "mixed", False, False, "grpo", True, "one_step_off", False, "dense", ST, "images"),
    Combination("pp2", "full", "rule", True, False, "grpo", False, "sync", False, "dense", ST, "images"),
    Combination("torch", "partial", "rule", True, True, "distill", False, "one_step_off", True, "moe"),
    Combination("pp2", "partial", "genrm", False, True, "distill", True, "sync", False, "dense", TOOLS),
    Combination("ep2", "partial", "mixed", True, True, "grpo", False, "sync", False, "moe", TOOLS),
    Combination("tp2", "full", "rule", False, False, "ppo", False, "one_step_off", False, "dense", TOOLS),
    Combination("torch", "full", "genrm", False, True, "ppo", False, "sync", False, "dense", TOOLS),
    Combination("fsdp2", "full", "rule", False, True, "grpo", False, "one_step_off", False, "dense", ST, "images"),
    Combination("tp2", "partial", "mixed", True, False, "distill", True, "one_step_off", False, "dense"),
    Combination("ep2", "full", "genrm", False, False, "ppo", True, "sync", False, "moe"),
    Combination("pp2", "partial", "mixed", False, False, "ppo", False, "one_step_off", False, "dense"),
    Combination("tp2", "full", "genrm", False, False, "grpo", False, "sync", False, "dense", ST, "images"),
    Combination("fsdp2", "full", "genrm", False, False, "grpo", True, "one_step_off", True, "moe", TOOLS),
    Combination("fsdp2", "partial", "mixed", False, False, "distill", True, "one_step_off", False, "dense"),
]
# none: 9-36 s each on 2 CPU cores (the resume test ~1 min)
SLOW: set[Combination] = set()


def pairs(c: Combination) -> set[tuple]:
    return {(a, b, c[i], c[j]) for (i, a), (j, b) in itertools.combinations(enumerate(Combination._fields), 2)}


def test_the_matrix_covers_every_allowed_pair():
    everything = [c for c in itertools.starmap(Combination, itertools.product(*DIMENSIONS.values())) if allowed(c)]
    wanted = set().union(*map(pairs, everything))
    covered = set().union(*map(pairs, COMBINATIONS))
    assert wanted - covered == set(), sorted(wanted - covered)
    assert all(allowed(c) for c in COMBINATIONS)
    assert all(getattr(c, f) in DIMENSIONS[f] for c in COMBINATIONS for f in Combination._fields)
    assert len({c.id for c in COMBINATIONS}) == len(COMBINATIONS)


def test_the_constraint_is_the_configs(tmp_path, vl_policy):
    """`allowed` leaves out exactly what yatt refuses (partial placement with a rule-only reward, LoRA on megatron,
    LoRA, agent loops, PPO's critic and distillation with a VL policy), and yatt takes every combination of the
    matrix."""
    config = tmp_path / "exp.yaml"
    config.write_text(f"model: {{path: {tmp_path}}}\ndata: {{train: {{kind: jsonl, files: [{tmp_path}/t.jsonl]}}}}\n")
    with pytest.raises(ConfigError, match="placement.mode=partial"):
        load_experiment(config, placement="partial")
    assert load_experiment(config, placement="full").reward.kind == "rule"
    megatron = ["trainer.backend=megatron"]
    with pytest.raises(ConfigError, match="trainer.backend=megatron does not train LoRA adapters"):
        load_experiment(config, [*megatron, "model.lora.rank=2"])
    vl = f"model.path={vl_policy[0]}"
    teacher = [f"reward.teacher={{model: {vl_policy[0]}}}", "algorithm.advantage={kind: distill}"]
    for refused in (
        ["model.lora.rank=2"],
        ["algorithm.advantage.kind=gae"],
        ["rollout.agent={kind: tool_loop, tools: {calculator: {}}}"],
        teacher,
    ):
        assert launch_refusals(load_experiment(config, [vl, *refused]), 2) is not None, refused
    for c in COMBINATIONS:  # every combination of the matrix is one yatt takes
        (tmp_path / c.id).mkdir()
        path, overrides = config_of(tmp_path / c.id, c, run_body(STEPS, STEPS, 1), vl_policy)
        at = overrides.index("--placement")
        cfg = load_experiment(path, overrides[:at] + overrides[at + 2 :], placement=overrides[at + 1])
        assert launch_refusals(cfg, 2) is None, c.id


MOE_TP = DIGITS_TP.model_copy(
    update={"architecture": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
)
STEPS = 2
BODY = """rollout: {group_size: 8, max_new_tokens: 1, engine: {backend: hf, vllm: null}}
algorithm: {mini_batches: 2, dynamic_sampling: {max_rounds: 2}}
trainer: {lr: 0.01, micro_batch_size: 16}
critic: {lr: 0.01, warmup_steps: 1}
"""
BACKENDS = {
    "torch": [],
    "fsdp2": ["trainer.torch.parallel=fsdp2"],
    "tp2": ["trainer.backend=megatron", "trainer.megatron.tensor_parallel=2"],
    "pp2": ["trainer.backend=megatron", "trainer.megatron.pipeline_parallel=2"],
    "ep2": ["trainer.backend=megatron", "trainer.megatron.expert_parallel=2"],
}
REWARD_KINDS = {"rule": "rule", "genrm": "genrm", "mixed": "genrm_with_rule"}
TOOL_LOOP = "{kind: tool_loop, max_turns: 2, max_trajectory_tokens: 24, tools: {calculator: {}}, lockstep: true}"


def readable_judge(folder: Path) -> Path:
    """A tiny judge whose verdicts are always readable, so a GenRM-only reward varies within a group (the random
    judge of e2e.genrm_reward never says a whole "yes" or "no": its reward would be constant, GRPO would train
    nothing and dynamic sampling would keep nothing). Its layers add nothing to the residual stream (zero output
    projections), so the next token is a fixed function of the last one, a bigram table in an untied output layer
    (e2e.bigram_table): the response's last character an even digit -> "yes", anything else -> "no"."""
    shape = JUDGE_TINY.model_copy(update={"max_position_embeddings": 32, "tie_word_embeddings": False})
    write_tiny_model(folder, shape, seed=4)
    follows = {**{str(d): "yn"[d % 2] for d in range(10)}, "y": "e", "e": "s", "n": "o", "s": "</s>", "o": "</s>"}
    return bigram_table(folder, {token: {nxt} for token, nxt in follows.items()}, default="n")


def judge_section(tmp: Path, kind: str) -> str:
    """e2e.genrm_reward's section with the readable judge and the combination's reward kind; the template ends
    with the response, whose last character the judge reads."""
    judge = readable_judge(tmp / "judge")
    return f"""reward:
  kind: {kind}
  judges:
    - name: j
      model: {judge}
      template: "{{question}}{{reference}}:{{response}}"
      max_tokens: 3
      unparseable_score: 0.5
      engine: {{backend: hf}}
"""


def config_of(tmp: Path, c: Combination, body: str, vl: tuple[Path, Path] | None = None) -> tuple[Path, list[str]]:
    """The experiment YAML (shared settings, the judge when there is one, `body`) and the overrides that pick
    the combination's values, as a user would type them. `vl`: the image rows' policy and data (vl_policy)."""
    judge = judge_section(tmp, REWARD_KINDS[c.reward]) if c.reward != "rule" else ""
    if c.prompts == "images":
        assert vl is not None
        config = images_experiment(tmp, BODY + judge + body, *vl)
    else:
        config = experiment(tmp, BODY + judge + body, model=MOE_TP if c.policy == "moe" else DIGITS_TP)
        varied_rows(tmp / "train.jsonl", 64)
    overrides = [
        "--placement",
        c.placement,
        *BACKENDS[c.backend],
        f"reward.kind={REWARD_KINDS[c.reward]}",
        f"balance.enabled={str(c.balance).lower()}",
        f"checkpoint.export_hf={str(c.export_hf).lower()}",
        f"algorithm.dynamic_sampling.enabled={str(c.dynamic).lower()}",
        *(["algorithm.advantage.kind=gae"] if c.algorithm == "ppo" else []),
        *(distill_overrides(tmp) if c.algorithm == "distill" else []),
        f"rollout.schedule.mode={c.schedule}",
        *(["rollout.schedule.in_flight=resume"] if resumes(c) else []),
        *(["model.lora.rank=2", "model.lora.alpha=4"] if c.lora else []),
        *(["algorithm.routing_replay=r3"] if c.policy == "moe" else []),
        *([f"rollout.agent={TOOL_LOOP}"] if c.agent == "tool_loop" else []),
        # the warmed-up VL policy at 0.01 learns the judge's taste (an even digit) in one step: no variance left
        *(["trainer.lr=0.001"] if c.prompts == "images" else []),
    ]
    return config, overrides


def images_experiment(tmp: Path, body: str, policy: Path, data: Path) -> Path:
    """e2e.experiment's shape with image prompts: the VL policy, 64 train / 16 eval counting-squares rows."""
    config = tmp / "exp.yaml"
    config.write_text(f"""
model: {{path: {policy}}}
data:
  train: {{kind: jsonl, files: [{data / "train.jsonl"}]}}
  eval: {{kind: jsonl, files: [{data / "eval.jsonl"}]}}
  prompts_per_step: 8
  eval_prompts: 16
  max_prompt_tokens: 32
{body}""")
    return config


def distill_overrides(tmp: Path) -> list[str]:
    """A larger random teacher with the policy's tokenizer, and the distillation advantage mixed with the reward."""
    shape = DIGITS_TP.model_copy(update={"hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 3})
    teacher = write_tiny_model(tmp / "teacher", shape, seed=5)
    return [
        f"reward.teacher={{model: {teacher}, engine: {{backend: hf}}}}",
        "algorithm.advantage={kind: distill, reward_coef: 0.5}",
    ]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def resumes(c: Combination) -> bool:
    """An MoE policy's single-turn ahead runs resume the requests a push cuts (in_flight=resume, with r3)."""
    return c.schedule != "sync" and c.policy == "moe" and c.agent == ST


def feature_keys(c: Combination) -> list[str]:
    keys = ["reward/mean", "actor/policy_loss", "actor/grad_norm", "rollout/samples", "balance/moved_samples"]
    keys += ["balance/imbalance_before", "balance/imbalance_after"]
    if c.reward != "rule":
        keys += ["genrm/judged", "genrm/unparseable_frac", "genrm/j/agree_with_rule"]
    if c.algorithm == "ppo":
        keys += ["critic/value_loss", "critic/grad_norm", "critic/explained_var", "critic/value_mean", "critic/warmup"]
    if c.algorithm == "distill":
        keys += ["distill/reverse_kl", "teacher/rerouted", "teacher/duplicates_dropped"]
    if c.dynamic:
        keys += ["dynamic_sampling/kept_groups", "dynamic_sampling/dropped_groups", "dynamic_sampling/queue"]
    if c.placement == "partial":
        keys += ["placement/rollout_devices", "placement/genrm_devices"]
    if c.schedule != "sync":
        keys += ["async/staleness_mean"]
    if c.policy == "moe":
        keys += ["moe/aux_loss", "moe/tokens_per_expert_max", "moe/tokens_per_expert_mean", "moe/routing_mismatch"]
    if c.agent == "tool_loop":
        keys += ["agent/turns_mean", "agent/tool_calls_per_sample", "agent/tool_token_frac"]
    return keys


def check_steps_finite(logged: list[dict], steps: int) -> None:
    """Every step 0..steps logged once, each metric a finite number."""
    assert [r["step"] for r in logged] == list(range(steps + 1))
    for r in logged:
        bad = {k: v for k, v in r.items() if not isinstance(v, (int, float)) or not math.isfinite(v)}
        assert not bad, (r["step"], bad)


def check_metrics(c: Combination, logged: list[dict], steps: int = STEPS) -> None:
    # no exception needed: a step that trains on nothing (dynamic sampling keeping no group) logs 0, not NaN
    check_steps_finite(logged, steps)
    assert logged[0]["eval/count"] == logged[-1]["eval/count"] == 16  # held-out rows at start and end, once each
    steps = logged[1:]
    for r in steps:
        # an MoE policy's metrics come from its update: none in a PPO step that warms the critic up alone
        warming = r.get("critic/warmup") == 1.0
        missing = [k for k in feature_keys(c) if k not in r and not (warming and k.startswith("moe/"))]
        assert not missing, (r["step"], missing)
        # the engine samples from the weights the trainer holds (hf engines, float32): their log-probs agree,
        # except for groups dynamic sampling kept from the previous step (sampled before its update) and batches
        # made a step ahead (one_step_off: step 2's with step 0's weights)
        if not r.get("dynamic_sampling/from_queue") and (c.schedule == "sync" or r["step"] == 1):
            assert r["rollout/trainer_logprob_diff_max"] < 1e-3, r
        if c.dynamic:  # the kept groups, 8 samples each; the megatron group counts its data slice once
            assert r["rollout/samples"] == 8 * r["dynamic_sampling/kept_groups"] <= 64, r
        else:
            assert r["rollout/samples"] == 64, r
        if c.reward != "rule":  # every fresh sample judged, readably; dynamic sampling may judge more or fewer
            assert r["genrm/judged"] % 8 == 0 and (c.dynamic or r["genrm/judged"] == 64), r
            # the VL policy writes letters too: a response ending in one of "yes"/"no"'s starts the judge mid-word
            assert r["genrm/unparseable_frac"] <= (0.1 if c.prompts == "images" else 0.0), r
            # throughput over every device's judge time (a rollout device of a TP group has none of its own)
            assert r["genrm/judged_per_busy_s"] == pytest.approx(r["genrm/judged"] / r["load/genrm_busy_s"]), r
        if c.placement == "partial":
            assert r["placement/rollout_devices"] == r["placement/genrm_devices"] == 1, r
        if c.balance:
            assert r["balance/imbalance_after"] <= r["balance/imbalance_before"] + 1e-9, r
        else:
            assert r["balance/moved_samples"] == 0 and r["balance/imbalance_after"] == r["balance/imbalance_before"]
    if c.algorithm == "ppo":  # the first step warms the critic up, the policy trains after it
        assert [r["critic/warmup"] for r in steps] == [1.0, 0.0] and steps[0]["actor/grad_norm"] == 0.0
        assert all(r["critic/grad_norm"] > 0 for r in steps)
    assert steps[-1]["actor/grad_norm"] > 0, steps[-1]  # the policy trained on a batch with signal


def check_export(run_dir: Path, steps: int = STEPS, lora: bool = False, images: bool = False) -> None:
    """The checkpoint of the last step holds an HF folder (under the manifest's checksums) that transformers
    loads, with finite logits and the final policy's weights (LoRA: and its adapter folder, the final one's; a VL
    policy: a VL folder, with its processor)."""
    folder = run_dir / "checkpoints" / f"step-{steps:08d}"
    files = set(verify(folder)["files"])
    assert {"policy/model.safetensors", "policy/config.json", "policy/tokenizer.json"} <= files
    if lora:
        assert {"policy/adapter/adapter_model.safetensors", "policy/adapter/adapter_config.json"} <= files
        saved = load_file(folder / "policy" / "adapter" / "adapter_model.safetensors")
        final = load_file(run_dir / "policy" / "adapter" / "adapter_model.safetensors")
        assert set(saved) == set(final) and all(torch.equal(saved[k], final[k]) for k in final)
    auto = AutoModelForImageTextToText if images else AutoModelForCausalLM
    model = auto.from_pretrained(folder / "policy", dtype=torch.float32)
    if images:
        assert "policy/processor_config.json" in files
    with torch.no_grad():
        ids = AutoTokenizer.from_pretrained(folder / "policy")("12+34=", return_tensors="pt").input_ids
        logits = model(input_ids=ids).logits  # a VL policy's decoder reads text alone too
    assert logits.shape[:2] == (1, ids.shape[1]) and torch.isfinite(logits).all()
    final = auto.from_pretrained(run_dir / "policy", dtype=torch.float32).state_dict()
    exported = model.state_dict()
    assert set(exported) == set(final) and all(torch.equal(exported[k], final[k]) for k in final)


def run_body(steps: int, every: int, keep: int) -> str:
    return f"""checkpoint: {{every: {every}, keep: {keep}}}
run: {{name: m, steps: {steps}, eval_every: 0}}
"""


def params(combinations: list[Combination]) -> list:
    megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed")
    return [
        pytest.param(
            c, id=c.id, marks=[*([pytest.mark.slow] if c in SLOW else []), *([megatron] * (c.backend in MEGATRON))]
        )
        for c in combinations
    ]


RESUME_STEPS = 3


@pytest.fixture(scope="module")
def main_run(tmp_path_factory) -> tuple[Path, list[str], Path]:
    """MAIN run uninterrupted for RESUME_STEPS steps, saving every step: its combination's run and the reference
    of its resume test (config, overrides, run dir)."""
    tmp = tmp_path_factory.mktemp("main")
    config, overrides = config_of(tmp, MAIN, run_body(RESUME_STEPS, 1, 2))
    out = finish(launch(tmp, config, "full", *overrides))
    assert "done:" in out, out[-3000:]
    return config, overrides, tmp / "full" / "m"


@pytest.fixture(scope="module")
def vl_policy(tmp_path_factory) -> tuple[Path, Path]:
    """The image rows' policy and data: the counting-squares task and a tiny VL policy warmed up on it for 60 steps
    (about half its answers right, so a group's rewards vary), built once (~10 s)."""
    tmp = tmp_path_factory.mktemp("vl")
    write_shapes_files(tmp / "data", sizes={"sft": 256, "train": 64, "eval": 16})
    run_sft_vl(
        tmp / "data", tmp / "policy", stop_at=1.01, batch_size=32, max_steps=60, eval_every=60, log=lambda _: None
    )
    return tmp / "policy", tmp / "data"


@pytest.mark.parametrize("c", params(COMBINATIONS))
def test_combination(tmp_path, c, request):
    if c == MAIN:
        run_dir, steps = request.getfixturevalue("main_run")[2], RESUME_STEPS
    else:
        vl = request.getfixturevalue("vl_policy") if c.prompts == "images" else None
        config, overrides = config_of(tmp_path, c, run_body(STEPS, STEPS, 1), vl)
        proc = torchrun(config, *overrides, f"run.output_dir={tmp_path / 'runs'}", cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        run_dir, steps = tmp_path / "runs" / "m", STEPS
    check_metrics(c, records(run_dir), steps)
    if c.export_hf:
        check_export(run_dir, steps, c.lora, c.prompts == "images")


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed")
def test_main_combination_resumes_exactly_after_kill_9(tmp_path, main_run):
    """MAIN (megatron TP=2, partial placement, a GenRM judge, balancing, HF export) saving every step: killed
    with kill -9 while step 2's checkpoint (shards and gathered HF folder) is being written in the background,
    rerun, it skips the partial checkpoint, resumes from step 1, and logs the uninterrupted run's per-step
    metrics and ends with its weights."""
    config, overrides, uninterrupted = main_run
    run_dir = tmp_path / "chain" / "m"
    ckpts = run_dir / "checkpoints"
    proc = launch(tmp_path, config, "chain", *overrides, "checkpoint.debug_write_delay_s=1.0")
    first = ckpts / "step-00000001" / "manifest.json"
    wait_for(proc, lambda: first.is_file() and any(".tmp-" in p.name for p in ckpts.iterdir()))
    staging = [p.name for p in ckpts.iterdir() if ".tmp-" in p.name]
    for pid in process_tree(proc.pid):
        os.kill(pid, signal.SIGKILL)
    finish(proc)
    assert all((ckpts / name).exists() for name in staging), "the kill did not land during the write"
    assert not (ckpts / "step-00000002").exists()

    out = finish(launch(tmp_path, config, "chain", *overrides))
    assert "warning: skipping partial checkpoint" in out and "done:" in out, out[-3000:]
    assert f"resuming from {ckpts / 'step-00000001'}" in out, out[-3000:]
    assert logged_steps(run_dir) == list(range(RESUME_STEPS + 1))
    for want, have in zip(comparable(uninterrupted), comparable(run_dir)):
        assert want == have, {
            k: (want.get(k), have.get(k)) for k in set(want) | set(have) if want.get(k) != have.get(k)
        }
    a = load_file(uninterrupted / "policy" / "model.safetensors")
    b = load_file(run_dir / "policy" / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert sum(r["actor/grad_norm"] > 0 for r in records(run_dir)[1:]) >= 2  # the resumed steps trained


@needs_verifiers
def test_an_environment_source_with_an_ahead_schedule(tmp_path):
    """An environment package as the data and the agent loop (verifiers' TextArena Wordle: `data.train.kind:
    verifiers`, `rollout.agent.kind: verifiers`, docs/environments.md), its reward the game's own, with an ahead
    schedule (one_step_off), FSDP2, balancing, LoRA and an HF export: a row of its own, not a pairwise dimension
    (its package is an optional extra and its prompts are the environment's tasks). 2 steps on 2 ranks of a policy
    that guesses the game's nouns (test_verifiers_env.guessing_policy): finite metrics; step 1's samples come
    from the weights the trainer holds, so its log-probs of the model's tokens equal the engine's (the feedback
    turns between them masked); the games' rewards vary and the policy trains; the export loads."""
    nltk = small_nltk_data(tmp_path / "nltk_data")
    policy = guessing_policy(tmp_path / "policy")
    split = "{kind: verifiers, taskset: textarena, options: {game: Wordle-v0}, nltk_data: %s, start: %d, size: %d}"
    config = tmp_path / "wordle.yaml"
    config.write_text(f"""
model: {{path: {policy}}}
data:
  train: {split % (nltk, 0, 16)}
  eval: {split % (nltk, 100, 4)}
  prompts_per_step: 2
  eval_prompts: 4
  max_prompt_tokens: 1024
rollout:
  group_size: 4
  max_new_tokens: 8
  engine: {{backend: hf}}
  agent: {{kind: verifiers, max_turns: 3, max_trajectory_tokens: 1200}}
reward: {{kind: rule}}
trainer: {{lr: 0.01, micro_batch_size: 4}}
{run_body(STEPS, STEPS, 1)}""")
    overrides = [*BACKENDS["fsdp2"], "balance.enabled=true", "checkpoint.export_hf=true"]
    overrides += ["rollout.schedule.mode=one_step_off", "model.lora.rank=2", "model.lora.alpha=4"]
    run_dir, steps, _ = environment_run(tmp_path, config, overrides, "verifiers/textarena")
    for r in steps:
        assert r["rollout/samples"] == 8 and r["agent/turns_mean"] >= 1, r
        assert {"async/staleness_mean", "balance/moved_samples", "agent/tool_token_frac"} <= set(r), r
        assert 0.0 <= r["reward/mean"] <= 1.0, r
        assert r["env/reward/game_reward"] == pytest.approx(r["reward/mean"]), r  # the game's reward, by name
    check_export(run_dir, STEPS, lora=True)


def environment_run(tmp_path: Path, config: Path, overrides: list[str], source: str) -> tuple[Path, list, list]:
    """Run an environment row for STEPS steps on 2 ranks and check what every one holds: finite metrics, the 4
    held-out tasks evaluated at the start and the end, step 1's samples from the weights the trainer holds (its
    log-probs of the model's tokens equal the engine's), rewards that vary (the policy trains), and samples of the
    environment (`source`). Returns the run dir, the steps' records and the samples."""
    proc = torchrun(config, *overrides, f"run.output_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "m"
    logged = records(run_dir)
    check_steps_finite(logged, STEPS)
    assert logged[0]["eval/count"] == logged[-1]["eval/count"] == 4
    steps = logged[1:]
    assert steps[0]["rollout/trainer_logprob_diff_max"] < 1e-3, steps[0]
    assert any(r["actor/grad_norm"] > 0 for r in steps), steps  # a group's samples scored differently
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["data_source"] == source for s in samples)
    return run_dir, steps, samples


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed")
@pytest.mark.skipif(not HAS_ENV_PACKAGE, reason="needs environments/vf-reasoning-gym (make setup installs it)")
def test_a_single_turn_environment_on_megatron_with_a_judge(tmp_path):
    """A single-turn environment package (environments/vf-reasoning-gym: reasoning-gym's syllogisms, each task
    scored by its own `@vf.reward` over the verifiers trace, docs/environments.md) with Megatron TP=2, partial
    placement, a GenRM judge mixed with the environment's reward, and dynamic sampling: a row of its own, like the
    Wordle row above, covering the dimensions that one does not. 2 steps on 2 ranks of a policy that answers "Yes"
    or "No" at random (test_verifiers_env.chat_policy), so half its answers are right: finite metrics, one model
    turn per sample, the judge served on its own device and judging every fresh sample, step 1's trainer/engine
    log-prob gap, rewards that vary (the policy trains), and the rewards are the environment's plus the judge's."""
    policy = chat_policy(tmp_path / "policy", ["Yes", "No"], {":": {"Yes", "No"}}, kv_heads=2)
    judge = readable_judge(tmp_path / "judge")
    task = "{dataset: syllogism, size: 64, seed: %d, instruction: '{question}'}"
    split = "{kind: verifiers, taskset: vf-reasoning-gym, options: %s, size: %d}"
    config = tmp_path / "syllogism.yaml"
    config.write_text(f"""
model: {{path: {policy}}}
data:
  train: {split % (task % 0, 64)}
  eval: {split % (task % 1, 4)}
  prompts_per_step: 4
  eval_prompts: 4
  max_prompt_tokens: 320
rollout:
  group_size: 4
  max_new_tokens: 4
  engine: {{backend: hf}}
  agent: {{kind: verifiers, max_turns: 1, max_trajectory_tokens: 330}}
reward:
  kind: genrm_with_rule
  judges: [{{name: j, model: {judge}, template: ":{{response}}", max_tokens: 3, unparseable_score: 0.5,
            engine: {{backend: hf}}}}]
trainer: {{lr: 0.01, micro_batch_size: 8}}
algorithm: {{dynamic_sampling: {{enabled: true}}}}
{run_body(STEPS, STEPS, 1)}""")
    overrides = ["--placement", "partial", *BACKENDS["tp2"]]
    _, steps, samples = environment_run(tmp_path, config, overrides, "verifiers/vf-reasoning-gym")
    for r in steps:
        assert r["agent/turns_mean"] == 1.0 and r["placement/genrm_devices"] == 1, r
        assert r["genrm/judged"] % 4 == 0 and r["genrm/judged"] > 0, r
        assert r["rollout/samples"] == 4 * r["dynamic_sampling/kept_groups"], r
        assert 0.0 <= r["env/reward/correct"] <= 1.0 and r["env/metric/has_answer"] == 1.0, r
    # each sample's scores by name: the task's @vf.reward is the rule part of its reward
    scored = [r for s in samples if s["split"] == "train" for r in s["responses"]]
    assert scored and all(r["env_scores"]["reward/correct"] == r["rule_score"] for r in scored), scored
    # the answers of the weights before any update (at lr 0.01 the table drifts after one)
    answers = [s["response"] for s in samples if s["split"] == "eval" and s["step"] == 0]
    answers += [r["text"] for s in samples if s["split"] == "train" and s["step"] == 1 for r in s["responses"]]
    assert answers and {a.strip() for a in answers} <= {"Yes", "No"}, answers
