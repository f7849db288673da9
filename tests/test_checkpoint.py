"""Checkpoint pieces without engines: snapshot round trip, the 2-rank write protocol, manifests, resume choice."""

import json
import random
import warnings

import numpy as np
import pytest
import torch

from yatt.checkpoint.aside import drop_aside, set_aside
from yatt.checkpoint.manifest import CheckpointError, fingerprint_differences, verify
from yatt.checkpoint.resume import CheckpointWarning, check_compatible, find_resume, load_part
from yatt.checkpoint.rng import rng_state, set_rng_state
from yatt.checkpoint.snapshot import restore, snapshot
from yatt.checkpoint.writer import LATEST, CheckpointWriter, SaveJob, remove_stale
from yatt.controllers.metrics import keep_metrics_until


def save(root, step, world_size=2, keep=3, token="t0", **writer_kw):
    """One save by `world_size` writers sharing the root, as the ranks of a run would."""
    writers = [CheckpointWriter(root, r, world_size, token, keep, **writer_kw) for r in range(world_size)]
    for w in reversed(writers):  # rank 0 last: its commit must wait for the other ranks' markers
        parts = {f"rank{w.rank}": snapshot({"progress": {"step": step, "rank": w.rank}})}
        if w.rank == 0:
            parts["shared"] = snapshot({"weights": {"w": torch.full((64,), float(step))}})
        w.submit(SaveJob(step, parts, {"world_size": world_size}))
    for w in writers:
        w.wait()
    return root / f"step-{step:08d}"


def test_snapshot_round_trip_keeps_types_and_copies():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"optimizer": opt.state_dict(), "rng": rng_state(), "cursor": {"epoch": 1, "cursor": 5}}
    snap = snapshot(state)
    json.dumps(snap.tree)  # nothing pickled: the tree is plain JSON
    exp_avg = opt.state[model.weight]["exp_avg"]
    before = exp_avg.clone()
    exp_avg.add_(1.0)  # training goes on while the writer reads the snapshot
    back = restore(json.loads(json.dumps(snap.tree)), snap.tensors)
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], before)
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert back["cursor"] == {"epoch": 1, "cursor": 5}
    opt.load_state_dict(back["optimizer"])  # loads into a real optimizer


def test_rng_state_restores_every_generator():
    state = rng_state()
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(restore(json.loads(json.dumps(snapshot({"r": state}).tree)), snapshot({"r": state}).tensors)["r"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_two_rank_save_commits_verifies_and_points_latest(tmp_path):
    folder = save(tmp_path, 2)
    manifest = verify(folder)
    assert manifest["step"] == 2 and manifest["world_size"] == 2
    assert set(manifest["files"]) == {
        "rank0.safetensors",
        "rank0.json",
        "rank1.safetensors",
        "rank1.json",
        "shared.safetensors",
        "shared.json",
    }
    assert (tmp_path / LATEST).read_text().strip() == "step-00000002"
    assert load_part(folder, "rank1")["progress"] == {"step": 2, "rank": 1}
    assert torch.equal(load_part(folder, "shared")["weights"]["w"], torch.full((64,), 2.0))
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # the staging dir was renamed


def test_synchronous_write_and_keep_last_k(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step, keep=2, async_write=False)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step-00000003", "step-00000004"]
    assert (tmp_path / LATEST).read_text().strip() == "step-00000004"


def test_rank0_never_commits_without_every_rank(tmp_path):
    w0 = CheckpointWriter(tmp_path, 0, 2, "t", keep=3, commit_timeout_s=0.3)
    w0.submit(SaveJob(5, {"rank0": snapshot({"x": {"a": 1}})}))
    with pytest.raises(CheckpointError, match="rank 1 did not finish"):
        w0.wait()
    assert not (tmp_path / "step-00000005").exists()


@pytest.mark.parametrize("damage", ["truncate", "flip", "missing_file", "missing_manifest"])
def test_verify_detects_damage(tmp_path, damage):
    folder = save(tmp_path, 1)
    target = folder / "shared.safetensors"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-10])
        match = "bytes, the manifest says"
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[-5] ^= 0xFF
        target.write_bytes(bytes(data))
        match = "corrupted"
    elif damage == "missing_file":
        target.unlink()
        match = "missing"
    else:
        (folder / "manifest.json").unlink()
        match = "no manifest.json"
    with pytest.raises(CheckpointError, match=match):
        verify(folder)


def test_auto_resume_skips_partial_and_corrupt_with_warnings(tmp_path):
    save(tmp_path, 2)
    corrupt = save(tmp_path, 4)
    (corrupt / "rank1.json").write_text("{}")
    (tmp_path / "step-00000006.tmp-dead").mkdir()  # a crash during the write of step 6
    with pytest.warns(CheckpointWarning) as caught:
        folder, manifest = find_resume(tmp_path, "auto")
    assert folder.name == "step-00000002" and manifest["step"] == 2
    messages = [str(w.message) for w in caught]
    assert "partial checkpoint" in messages[0] and "step-00000006" in messages[0]
    assert "step-00000004" in messages[1] and "rank1.json" in messages[1]
    assert find_resume(tmp_path, "none") is None
    assert find_resume(tmp_path, str(tmp_path / "step-00000002"))[1]["step"] == 2
    with pytest.raises(CheckpointError, match="corrupted|bytes"):
        find_resume(tmp_path, str(corrupt))
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        find_resume(tmp_path, str(tmp_path / "nope"))
    assert remove_stale(tmp_path) == ["step-00000006.tmp-dead"]


def test_auto_resume_with_nothing_starts_fresh(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert find_resume(tmp_path / "absent", "auto") is None


def test_incompatible_config_names_the_fields(tmp_path):
    folder = save(tmp_path, 1)
    manifest = verify(folder)
    check_compatible(folder, manifest, {"world_size": 2})
    with pytest.raises(CheckpointError, match=r"incompatible config.*: world_size: checkpoint 2, now 4; use another"):
        check_compatible(folder, manifest, {"world_size": 4})
    assert fingerprint_differences({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}}) == ["a.c: checkpoint 2, now 3"]


def test_metrics_are_cut_back_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(6)))
    assert [r["step"] for r in keep_metrics_until(path, 3)] == [0, 1, 2, 3]
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]


def test_export_hf_writes_a_loadable_policy_listed_in_the_manifest(tmp_path):
    from functools import partial

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from yatt.checkpoint.export import export_snapshot
    from yatt.models.tiny import TinyModelConfig, write_tiny_model

    src = write_tiny_model(
        tmp_path / "m",
        TinyModelConfig(
            alphabet="0123456789",
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
    )
    model, tokenizer = AutoModelForCausalLM.from_pretrained(src), AutoTokenizer.from_pretrained(src)
    snap = snapshot({"trainer": {"model": dict(model.named_parameters())}})
    export = partial(
        export_snapshot,
        snap=snap,
        key="trainer",
        hf_weights=lambda state: state["model"],
        hf_config=model.config,
        tokenizer=tokenizer,
        save_adapter=lambda folder, state: None,  # no adapters
    )
    writer = CheckpointWriter(tmp_path / "ck", 0, 1, "t", keep=1)
    (tmp_path / "ck").mkdir()
    writer.submit(SaveJob(1, {"shared": snap}, export=export))
    writer.wait()
    manifest = verify(tmp_path / "ck" / "step-00000001")
    assert {"policy/model.safetensors", "policy/config.json"} <= set(manifest["files"])
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ck" / "step-00000001" / "policy")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))


def test_preemption_signal_only_sets_a_flag():
    import os
    import signal

    from yatt.checkpoint.checkpointer import PreemptionFlag
    from yatt.distributed import World

    flag = PreemptionFlag()
    try:
        world = World(0, 1, 0, torch.device("cpu"))
        assert flag.agreed(world) == 0
        os.kill(os.getpid(), signal.SIGUSR1)  # would end the process without the handler
        assert flag.agreed(world) == signal.SIGUSR1
    finally:
        flag.restore()


def _checkpointer(tmp_path, overrides=(), **writer_kw):
    from yatt.checkpoint.checkpointer import Checkpointer
    from yatt.config import load_experiment
    from yatt.controllers.fingerprint import config_fingerprint
    from yatt.distributed import World
    from yatt.models.tiny import write_tiny_model

    policy = write_tiny_model(tmp_path / "policy")  # the config fingerprint reads the model's config.json
    cfg = load_experiment(
        "configs/quickstart.yaml",
        [f"run.output_dir={tmp_path}", f"model.path={policy}", f"checkpoint.dir={tmp_path / 'ck'}", *overrides],
    )
    world = World(0, 1, 0, torch.device("cpu"))
    return Checkpointer(cfg.checkpoint, cfg.run.run_dir, config_fingerprint(cfg), world, **writer_kw)


def test_replaced_checkpoints_are_set_aside_until_this_launch_commits(tmp_path):
    committed = []
    checkpoints = _checkpointer(tmp_path, on_commit=lambda: committed.append(True))
    root = checkpoints.root
    for step in (2, 4):
        save(root, step, world_size=1)
    before = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != LATEST}
    assert (root / LATEST).read_text().strip() == "step-00000004"
    assert checkpoints.replace_newer(2) == root / "replaced" / "1"  # resuming from step 2 abandons step 4
    assert (root / LATEST).read_text().strip() == "step-00000002"
    assert checkpoints.replace_newer(0) == root / "replaced" / "2"  # --resume none --overwrite: start over
    assert not (root / LATEST).exists() and not list(root.glob("step-*"))
    assert checkpoints.find("auto") is None  # nothing set aside is ever resumed
    kept = {
        p.relative_to(root / "replaced" / n): p.read_bytes()
        for n in "12"
        for p in (root / "replaced" / n).rglob("*")
        if p.is_file()
    }
    assert kept == before  # every byte of both checkpoints, until ...
    checkpoints.save(6, _Source())
    checkpoints.finish()  # ... this launch's first checkpoint commits
    assert committed and not (root / "replaced").exists() and (root / LATEST).read_text().strip() == "step-00000006"


class _Source:
    replicated = ("shared",)

    def state_dict(self):
        return {"progress": {"step": 6}, "shared": {"w": torch.ones(2)}}


class _TrainerSource:
    """A run's state with a real trainer in it, replicated (saved once, in `shared`) or held per rank."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.replicated = ("trainer",) if trainer.replicated else ()

    def state_dict(self):
        return {"progress": {"step": 1}, "trainer": self.trainer.state_dict()}


@pytest.mark.parametrize("replicated", [True, False])
def test_checkpointer_exports_the_policy_from_the_snapshot_or_gathered(tmp_path, replicated):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from yatt.checkpoint.export import policy_writer
    from yatt.config import TrainerConfig
    from yatt.trainers.torch_trainer import TorchTrainer

    # the writer waits after the parts, so training moves the weights before the export is written
    checkpoints = _checkpointer(tmp_path, ["checkpoint.export_hf=true", "checkpoint.debug_write_delay_s=0.2"])
    policy = tmp_path / "policy"
    trainer = TorchTrainer(policy, TrainerConfig(), checkpoints.world)
    # False: the export gathers (stream_hf_weights) and writes at the save, as a sharded trainer's does
    trainer.replicated = replicated
    saved = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    calls = []

    def hook(snap, folder):
        calls.append(snap is not None and folder is not None)
        return policy_writer(trainer, snap, folder, "trainer", AutoTokenizer.from_pretrained(policy))

    stall = checkpoints.save(1, _TrainerSource(trainer), hook)
    with torch.no_grad():
        for p in trainer.module.parameters():
            p.add_(1.0)  # the next step, while the writer runs
    folder = checkpoints.finish()
    assert calls == [True] and stall > 0  # called once, in the training thread, with rank 0's snapshot
    manifest = verify(folder)
    assert {"policy/model.safetensors", "policy/config.json", "policy/tokenizer.json"} <= set(manifest["files"])
    back = AutoModelForCausalLM.from_pretrained(folder / "policy").state_dict()
    assert set(back) == set(saved) and all(torch.equal(back[k], saved[k]) for k in saved)
    assert ("trainer" in load_part(folder, "shared")) == replicated  # a sharded trainer's goes in rank0.*


def test_resume_none_over_checkpoints_needs_overwrite(tmp_path):
    checkpoints = _checkpointer(tmp_path)
    assert checkpoints.find("none") is None  # nothing to replace yet
    save(checkpoints.root, 2, world_size=1)
    with pytest.raises(CheckpointError, match=r"has 1 checkpoint\(s\) in .*newest step-00000002.*add --overwrite"):
        checkpoints.find("none")
    assert checkpoints.find("none", overwrite=True) is None
    assert (checkpoints.root / "step-00000002").is_dir()  # finding only reads


def test_set_aside_numbers_each_launch_and_copies_what_is_rewritten(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("a\n")
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "model.safetensors").write_text("w")
    assert set_aside(tmp_path, move=["summary.json"]) is None  # absent entries are skipped
    first = set_aside(tmp_path, move=["policy"], copy=["metrics.jsonl"])
    assert first == tmp_path / "replaced" / "1" and (first / "policy" / "model.safetensors").read_text() == "w"
    assert (first / "metrics.jsonl").read_text() == (tmp_path / "metrics.jsonl").read_text() == "a\n"
    second = set_aside(tmp_path, move=["metrics.jsonl"])  # a later launch that also did not commit
    assert second == tmp_path / "replaced" / "2" and not (tmp_path / "metrics.jsonl").exists()
    drop_aside(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    drop_aside(tmp_path)  # nothing set aside: nothing to do
