"""checkpoint.export_hf under megatron: a real 2-rank run saving a checkpoint every step writes, inside each
one, a Hugging Face folder of the policy gathered from the rank shards at that save. The last checkpoint's
folder loads with transformers and holds exactly the weights of the run's final export (run.export_policy);
the earlier one holds the earlier step's weights. TP=2, TP=PP=1 (DP=2, whole model on every rank) and PP=2, all
in the slow suite: CI's composition matrix exports from TP=2 and PP=2 shards."""

import json

import pytest
import torch
from e2e import ONE_TOKEN_GRPO, experiment, torchrun
from megatron_ranks import needs_megatron
from test_megatron_e2e import DIGITS_TP
from transformers import AutoModelForCausalLM

from yatt.checkpoint.manifest import verify

pytestmark = needs_megatron
STEPS = 2


def weights(folder) -> dict[str, torch.Tensor]:
    """The state of the folder as transformers loads it (tied weights resolved as it resolves them)."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def export_run(tmp, tp: int, pp: int):
    name = f"tp{tp}pp{pp}"
    config = experiment(
        tmp,
        f"""
{ONE_TOKEN_GRPO}run: {{name: {name}, output_dir: {tmp / "runs"}, steps: {STEPS}, eval_every: 0}}
checkpoint: {{every: 1, keep: {STEPS}, export_hf: true}}
""",
        model=DIGITS_TP,
    )
    overrides = [
        "trainer.backend=megatron",
        f"trainer.megatron.tensor_parallel={tp}",
        f"trainer.megatron.pipeline_parallel={pp}",
        "rollout.engine.backend=hf",
        "rollout.engine.vllm=null",
    ]
    proc = torchrun(config, "--placement", "full", *overrides, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp / "runs" / name, tmp / "policy0"


def check_exports(run_dir, initial) -> None:
    root = run_dir / "checkpoints"
    folders = [root / f"step-{s:08d}" for s in range(1, STEPS + 1)]
    for folder in folders:
        manifest = verify(folder)  # the export is part of the committed checkpoint, checksums and all
        assert {"policy/model.safetensors", "policy/config.json", "policy/tokenizer.json"} <= set(manifest["files"])
    assert not list(root.glob("*.tmp-*"))
    final, start = weights(run_dir / "policy"), weights(initial)
    last, first = weights(folders[-1] / "policy"), weights(folders[0] / "policy")
    assert equal(last, final)  # the last save's gathered weights are the run's final policy, bit for bit
    assert set(last) == set(start)
    assert max((last[k] - start[k]).abs().max().item() for k in start) > 1e-3  # trained, not the initial model
    assert not equal(first, last)  # each save exports the weights of its own step
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["checkpoint_stall_seconds"] > 0


# slow, both: CI exports from TP=2 and PP=2 shards in tests/test_composition_matrix.py (checkpoint.export_hf: the
# folder transformers loads equals the final policy)
@pytest.mark.parametrize("tp", [pytest.param(2, marks=pytest.mark.slow), pytest.param(1, marks=pytest.mark.slow)])
def test_export_hf_under_tensor_parallelism(tmp_path, tp):
    check_exports(*export_run(tmp_path, tp, 1))


@pytest.mark.slow
def test_export_hf_under_pipeline_parallelism(tmp_path):
    check_exports(*export_run(tmp_path, 1, 2))
