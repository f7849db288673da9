"""Bad configs fail at start-up with a short message naming the file and the field."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from yatt.config import load_experiment
from yatt.config_loading import ConfigError, dump_config
from yatt.models.tiny import TinyModelConfig, write_tiny_model
from yatt.preflight import check_run

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def write_config(tmp_path: Path, model_dir: Path, extra: str = "", model_path: str | None = None) -> Path:
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    path = tmp_path / "exp.yaml"
    path.write_text(
        f"model: {{path: {model_path or model_dir}}}\n"
        f"data:\n  train: {{kind: jsonl, files: [{data}]}}\n  prompts_per_step: 4\n  max_prompt_tokens: 64\n{extra}"
    )
    return path


def test_valid_config_loads_with_overrides_and_placement_shortcut(tmp_path, model_dir):
    cfg = load_experiment(write_config(tmp_path, model_dir), ["trainer.lr=3e-4", "rollout.group_size=4"], "full")
    assert cfg.trainer.lr == 3e-4 and cfg.rollout.group_size == 4 and cfg.placement.mode == "full"


def test_unknown_key_names_the_field_and_file(tmp_path, model_dir):
    path = write_config(tmp_path, model_dir, "trainer:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_experiment(path)
    assert str(path) in str(err.value) and "trainer.learning_rate: unknown key" in str(err.value)


def test_wrong_type_names_the_field(tmp_path, model_dir):
    with pytest.raises(ConfigError) as err:
        load_experiment(write_config(tmp_path, model_dir), ["rollout.group_size=many"])
    assert "rollout.group_size" in str(err.value) and "'many'" in str(err.value)


def test_missing_files_are_found_where_the_run_starts_not_by_validation(tmp_path, model_dir):
    path = write_config(tmp_path, model_dir, model_path=str(tmp_path / "nope"))
    cfg = load_experiment(path)  # validation reads no files
    with pytest.raises(ConfigError, match="model.path: model folder not found"):
        check_run(cfg, 1, str(path))
    cfg = load_experiment(write_config(tmp_path, model_dir))
    check_run(cfg, 1, str(path))
    (tmp_path / "train.jsonl").unlink()
    with pytest.raises(ConfigError, match="data.train.files: not found"):
        check_run(cfg, 1, str(path))


def test_a_missing_model_folder_names_the_command_that_builds_it(tmp_path, model_dir):
    for folder, builder in (
        ("quickstart-tools-policy", "make quickstart-tools"),
        ("quickstart-vl", "make quickstart-vl"),
    ):
        path = write_config(tmp_path, model_dir, model_path=str(tmp_path / "models" / folder))
        with pytest.raises(ConfigError, match=f"model folder not found: .*{folder} \\(`{builder}` builds it\\)"):
            check_run(load_experiment(path), 1, str(path))


def test_a_bare_name_is_the_section_of_that_kind(tmp_path, model_dir):
    overrides = ["algorithm.advantage=rloo", "algorithm.policy_loss=gspo", "rollout.agent=single_turn"]
    cfg = load_experiment(write_config(tmp_path, model_dir), overrides)
    assert (cfg.algorithm.advantage.kind, cfg.algorithm.policy_loss.kind) == ("rloo", "gspo")
    assert cfg.algorithm.policy_loss.clip_high == type(cfg.algorithm.policy_loss)().clip_high
    assert cfg.rollout.agent.kind == "single_turn"
    with pytest.raises(ConfigError, match="unknown algorithm.advantage.kind 'rlooo'; registered: .*rloo"):
        load_experiment(write_config(tmp_path, model_dir), ["algorithm.advantage=rlooo"])


def test_an_error_from_the_command_line_says_so(tmp_path, model_dir):
    path = write_config(tmp_path, model_dir, "trainer:\n  lr: -1\n")
    with pytest.raises(ConfigError) as err:
        load_experiment(path)
    assert str(err.value).startswith(f"{path}: invalid config\n") and "command line" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_experiment(write_config(tmp_path, model_dir), ["rollout.group_size=0"])
    assert str(err.value).startswith(f"{path} with its command-line overrides: invalid config\n"), err.value
    assert "rollout.group_size: " in str(err.value) and "[command line: rollout.group_size=0]" in str(err.value)


def test_validation_does_not_change_values(tmp_path, model_dir):
    cfg = load_experiment(write_config(tmp_path, model_dir))
    assert cfg.rollout.engine.max_model_len is None  # derived where engines start: prompt + response tokens
    assert cfg.rollout_tokens == 64 + 16


def test_unknown_registry_names_are_config_errors_listing_the_registered(tmp_path, model_dir):
    path = write_config(tmp_path, model_dir)
    cases = {
        "trainer.backend=jax": "trainer.backend: unknown trainer.backend 'jax'; registered: megatron, torch",
        "rollout.engine.backend=trt": "unknown rollout.engine.backend 'trt'; registered: hf, vllm",
        "algorithm.advantage.kind=ppo": (
            "unknown algorithm.advantage.kind 'ppo'; registered: distill, gae, gpg, grpo, "
            "grpo_passk, opo, reinforce_pp, reinforce_pp_baseline, remax, rloo"
        ),
        "algorithm.policy_loss.kind=trpo": "unknown algorithm.policy_loss.kind 'trpo'; registered: cispo, clip_cov, "
        "gmpo, gspo, kl_cov, ppo_clip, sapo",
        "algorithm.loss_agg=sum": "unknown algorithm.loss_agg 'sum'",
        "algorithm.kl_estimator=k4": "unknown algorithm.kl_estimator 'k4'; registered: abs, k1, k1+, k2, k3, k3+",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as err:
            load_experiment(path, [override])
        assert message in str(err.value), (override, str(err.value))
    cfg = load_experiment(path, ["algorithm.policy_loss.clip_high=0.28", "trainer.dtype=bfloat16"])
    assert cfg.algorithm.policy_loss.clip_high == 0.28 and cfg.algorithm.advantage.normalize_std
    with pytest.raises(ConfigError, match="algorithm.policy_loss.ppo_clip.clip_hi: unknown key"):
        load_experiment(path, ["algorithm.policy_loss.clip_hi=0.28"])


def test_impossible_combinations(tmp_path, model_dir):
    path = write_config(tmp_path, model_dir)
    with pytest.raises(ConfigError, match="group_size must be >= 2"):
        load_experiment(path, ["rollout.group_size=1"])
    with pytest.raises(ConfigError, match="partial"):
        load_experiment(path, placement="partial")
    with pytest.raises(ConfigError, match="exceeds rollout.engine.max_model_len=64"):
        load_experiment(path, ["rollout.engine.max_model_len=64", "data.max_prompt_tokens=60"])
    with pytest.raises(ConfigError, match="the model has 128 positions"):
        check_run(load_experiment(path, ["data.max_prompt_tokens=200"]), 1, str(path))
    with pytest.raises(ConfigError, match="split evenly over 3 data-parallel ranks"):
        check_run(load_experiment(path), 3, str(path))
    megatron = [
        "trainer.backend=megatron",
        "trainer.megatron.tensor_parallel=2",
        "trainer.megatron.pipeline_parallel=2",
    ]
    with pytest.raises(ConfigError, match="tensor_parallel x pipeline_parallel = 4 must divide the 2 ranks"):
        check_run(load_experiment(path, megatron), 2, str(path))
    with pytest.raises(ConfigError, match="rollout.sync_every must be 1"):
        load_experiment(path, ["rollout.schedule.mode=one_step_off", "rollout.sync_every=2"])
    with pytest.raises(ConfigError, match="in_flight=resume: the sync schedule never pushes while requests"):
        load_experiment(path, ["rollout.schedule.in_flight=resume"])
    with pytest.raises(ConfigError, match=r"rollout.engine.cores=\[4096\]: this machine lets the run use cores"):
        check_run(load_experiment(path, ["rollout.engine.cores=[4096]"]), 2, str(path))


def test_refusals_new_to_the_table_are_found_before_any_rank_starts(tmp_path, model_dir):
    """yatt.refusals: what used to surface inside the ranks (at the first step, the first generation or the trainer's
    build) is now refused by validation or by the launcher's checks, in one line naming the fields."""
    import json
    import shutil

    from yatt.models.tiny_vl import write_tiny_vl_model

    path = write_config(tmp_path, model_dir)
    with pytest.raises(ConfigError, match=r"algorithm.advantage.k=9 must be between 1 and rollout.group_size=8"):
        load_experiment(path, ["algorithm.advantage.kind=grpo_passk", "algorithm.advantage.k=9"])
    vl = write_tiny_vl_model(tmp_path / "vl")
    agent = ["rollout.agent.kind=tool_loop", "rollout.agent.tools={c: {kind: calculator}}", f"model.path={vl}"]
    with pytest.raises(ConfigError, match="agent loops take text prompts only, and model.path is a vision-language"):
        check_run(load_experiment(path, agent), 2, str(path))
    with pytest.raises(ConfigError, match="PPO's critic .* cannot be built from .*vl, a vision-language model"):
        check_run(load_experiment(path, ["algorithm.advantage.kind=gae", f"model.path={vl}"]), 2, str(path))
    gemma = tmp_path / "gemma"
    shutil.copytree(model_dir, gemma)
    config = json.loads((gemma / "config.json").read_text())
    (gemma / "config.json").write_text(json.dumps({**config, "model_type": "gemma"}))
    megatron = ["trainer.backend=megatron", f"model.path={gemma}"]
    with pytest.raises(ConfigError, match="the megatron backend maps qwen2, llama, qwen3, qwen3_moe models, not gemma"):
        check_run(load_experiment(path, megatron), 2, str(path))
    dense_ep = ["trainer.backend=megatron", "trainer.megatron.expert_parallel=2"]
    with pytest.raises(ConfigError, match="expert_parallel=2 needs a mixture-of-experts model"):
        check_run(load_experiment(path, dense_ep), 2, str(path))
    check_run(load_experiment(path, ["trainer.backend=megatron"]), 2, str(path))  # the tiny qwen2 maps


def test_a_backend_section_is_its_backends_own(tmp_path, model_dir):
    """trainer.torch, trainer.megatron and rollout.engine.vllm are validated by their backend's class when it is
    selected, and are errors naming it when it is not; null drops one (how an override switches the backend)."""
    path = write_config(tmp_path, model_dir)
    cases = {
        (
            "trainer.megatron.tensor_parallel=3",
        ): "trainer: megatron is set but backend is torch; remove it (or set it to null) or set backend=megatron",
        (
            "rollout.engine.backend=hf",
            "rollout.engine.vllm.kv_cache_gib=0.5",
        ): "rollout.engine: vllm is set but backend is hf; remove it (or set it to null) or set backend=vllm",
        ("trainer.backend=megatron", "trainer.megatron.tp=2"): "trainer.megatron.tp: unknown key",
        (
            "trainer.backend=megatron",
            "trainer.torch.autocast=bfloat16",
        ): "trainer: torch is set but backend is megatron",
        ("trainer.activation_checkpointing=true",): "trainer.activation_checkpointing: unknown key",
        ("rollout.engine.vllm.kv_cache_gib=0",): "rollout.engine.vllm.kv_cache_gib: Input should be greater",
        ("rollout.engine.kv_cache_gib=0.5",): "rollout.engine.kv_cache_gib: unknown key",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError) as err:
            load_experiment(path, list(overrides))
        assert message in str(err.value), (overrides, str(err.value))
    default = load_experiment(path)
    assert default.trainer.model_parallel == (1, 1) and default.trainer.backend_config.logprob_chunk_tokens == 256
    assert default.rollout.engine.backend_config.kv_cache_gib == 1.0  # vllm, the default engine: its defaults
    cfg = load_experiment(
        path,
        [
            "trainer.backend=megatron",
            "trainer.megatron.tensor_parallel=2",
            "rollout.engine.backend=hf",
            "rollout.engine.vllm=null",
        ],
    )
    assert cfg.trainer.model_parallel == (2, 1) and cfg.rollout.engine.backend_config is None
    dump_config(cfg, tmp_path / "resolved.yaml")  # what a run writes into its directory loads back the same
    assert load_experiment(tmp_path / "resolved.yaml") == cfg


def test_checking_a_config_imports_no_backend(tmp_path, model_dir):
    path = write_config(tmp_path, model_dir)
    code = (
        "import sys; from yatt.config import load_experiment; load_experiment(sys.argv[1], "
        "['trainer.backend=megatron', 'rollout.engine.backend=vllm']); "
        "print(sorted(m for m in ('megatron', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


def test_backends_preflight_checks_name_the_field(tmp_path, model_dir, monkeypatch):
    judge = (
        f"reward:\n  kind: genrm\n  judges: [{{name: j, model: {model_dir}, "
        "template: '{question}{reference}:{response}?'}]\n"
    )
    path = write_config(tmp_path, model_dir, judge)
    tp2 = ["trainer.backend=megatron", "trainer.megatron.tensor_parallel=2"]
    # balancing over data-parallel groups, partial placement and export_hf (gathered at each save) compose with
    # the split model; what megatron still refuses is below
    for overrides in (["balance.enabled=true", "placement.mode=partial"], ["checkpoint.export_hf=true"]):
        check_run(load_experiment(path, [*tp2, *overrides]), 2, str(path))
    with pytest.raises(ConfigError, match=r"tensor_parallel x pipeline_parallel = 2 must divide the 3 ranks"):
        check_run(load_experiment(path, tp2), 3, str(path))
    find_spec = importlib.util.find_spec  # a machine without megatron-core or vLLM
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("megatron", "vllm") else find_spec(name, *a)
    )
    with pytest.raises(ConfigError, match=r"trainer.backend=megatron needs megatron-core: pip install 'yatt\[megatron"):
        check_run(load_experiment(path, tp2), 2, str(path))
    with pytest.raises(ConfigError, match=r"exp.yaml: rollout.engine: backend=vllm needs vLLM"):
        check_run(load_experiment(path), 1, str(path))
    with pytest.raises(ConfigError, match=r"reward.judges\[j\].engine: backend=vllm needs vLLM"):
        check_run(load_experiment(path, ["rollout.engine.backend=hf", "rollout.engine.vllm=null"]), 1, str(path))


def test_balance_and_dynamic_sampling_sections(tmp_path, model_dir):
    path = write_config(tmp_path, model_dir)
    cfg = load_experiment(
        path,
        [
            "balance.enabled=true",
            "algorithm.dynamic_sampling.enabled=true",
            "trainer.micro_batch_tokens=512",
            "rollout.engines_per_rank=2",
        ],
    )
    assert cfg.balance.partitioner == "kk" and cfg.algorithm.dynamic_sampling.max_rounds == 4
    assert not load_experiment(path).balance.enabled  # off by default: today's behaviour
    with pytest.raises(ConfigError, match="grpo advantages need whole groups"):
        load_experiment(path, ["balance.keep_groups=false"])
    with pytest.raises(ConfigError, match="balance.partitioner"):
        load_experiment(path, ["balance.partitioner=random"])
    with pytest.raises(ConfigError, match="min_oversample <= initial_oversample"):
        load_experiment(path, ["algorithm.dynamic_sampling.max_oversample=1.2"])


def test_launcher_reports_config_errors_before_starting(tmp_path, model_dir):
    path = write_config(tmp_path, model_dir, "bogus: 1\n")
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch/train.py"), "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert f"error: {path}: invalid config" in proc.stderr and "bogus: unknown key" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_launcher_reports_malformed_jsonl_line(tmp_path, model_dir):
    path = write_config(tmp_path, model_dir, f"run: {{output_dir: {tmp_path / 'runs'}}}\n")
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch/train.py"), "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{tmp_path / 'train.jsonl'}:2: not valid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_registered_plugin_is_a_valid_choice(tmp_path, model_dir, monkeypatch):
    from yatt.trainers import TRAINERS

    path = write_config(tmp_path, model_dir)
    monkeypatch.setattr(TRAINERS, "_entries", dict(TRAINERS._entries))  # undone after the test
    TRAINERS.register("mine", "yatt.trainers.torch_trainer:TorchTrainer")
    assert load_experiment(path, ["trainer.backend=mine"]).trainer.backend == "mine"
    assert TRAINERS.get("mine").__name__ == "TorchTrainer"


def test_a_model_whose_vocabulary_is_smaller_than_its_tokenizer_is_caught_at_config_check(tmp_path):
    import json

    folder = write_tiny_model(tmp_path / "small-vocab")
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = 10  # the character tokenizer has more tokens than that
    (folder / "config.json").write_text(json.dumps(config))
    path = write_config(tmp_path, folder, f"run: {{output_dir: {tmp_path / 'runs'}}}\n")
    with pytest.raises(ConfigError, match=r"model.path: the model's vocab_size \(10.*smaller than its tokenizer's"):
        check_run(load_experiment(path), 1, str(path))


def test_an_unwritable_run_directory_stops_the_launcher_with_one_line_before_engines_start(tmp_path, model_dir):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a run directory under a regular file can never be created, even by root
    path = write_config(tmp_path, model_dir, f"run: {{output_dir: {blocker / 'runs'}}}\n")
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch" / "train.py"), "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin"},
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "run.output_dir: cannot write to" in lines[0] and "Traceback" not in proc.stderr
    assert not list((tmp_path).glob("**/logs"))  # nothing (no engine) started


def test_the_critic_section_follows_the_estimator_and_is_checked_without_files(tmp_path, model_dir):
    path = write_config(tmp_path, model_dir)
    assert not load_experiment(path).uses_critic  # grpo: no critic
    cfg = load_experiment(path, ["algorithm.advantage.kind=gae"])
    assert cfg.uses_critic and cfg.critic_path == model_dir and cfg.critic.enabled is None  # not rewritten
    assert cfg.critic.value_clip == 0.2 and cfg.critic.loss_agg is None and cfg.critic.warmup_steps == 0
    assert load_experiment(path, ["critic.enabled=true"]).uses_critic  # by hand, with grpo
    cases = {
        ("algorithm.advantage.kind=gae", "critic.enabled=false"): "reads a critic's values, but critic.enabled",
        ("algorithm.advantage.kind=gae", "critic.warmup_steps=40"): "critic.warmup_steps=40 would leave no step",
        ("critic.loss_agg=sum",): "unknown critic.loss_agg 'sum'",
        ("critic.lr=0",): "critic.lr",
        ("critic.value_clip=-1",): "critic.value_clip",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError) as err:
            load_experiment(path, list(overrides))
        assert message in str(err.value), (overrides, str(err.value))
    cfg = load_experiment(path, ["algorithm.advantage.kind=gae", f"critic.model={tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match="critic.model: model folder not found"):
        check_run(cfg, 1, str(path))
    small = write_tiny_model(tmp_path / "small", TinyModelConfig(alphabet="01"))
    with pytest.raises(ConfigError, match="critic.model: its vocab_size .* smaller than the policy's tokenizer"):
        check_run(load_experiment(path, ["algorithm.advantage.kind=gae", f"critic.model={small}"]), 1, str(path))
    ppo = load_experiment(REPO / "configs" / "quickstart_ppo.yaml")  # the shipped config validates as PPO
    assert ppo.uses_critic and ppo.algorithm.advantage.kind == "gae" and ppo.critic.warmup_steps == 10
