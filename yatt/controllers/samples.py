"""samples.jsonl: what the policy actually says, at every eval, for people watching a run.

Each eval appends, from rank 0's shard, `run.samples` held-out prompts with the greedy response and its
verifier score (split "eval"), and `run.samples` of the step's training prompts with all their sampled
responses, rewards, rule scores and judge scores (split "train"; with an agent loop also each trajectory's ids,
response mask and tool-call counts, its text being the last model turn). One JSON object per line.
"""

from __future__ import annotations

import json
from pathlib import Path

from yatt.data.rollout import Rollout
from yatt.data.rows import PromptRow


def _prompt(row: PromptRow) -> dict:
    return {"prompt": row.prompt} if row.messages is None else {"messages": row.messages}


def _response(r: Rollout) -> dict:
    out = {
        "text": r.text,
        "reward": r.reward,
        "rule_score": r.rule_score,
        "judge_scores": r.judge_scores,
        "finish_reason": r.finish_reason,
        "tokens": len(r.response_ids),
    }
    if r.agent_stats:  # an agent loop's trajectory: every id and its mask (1 model, 0 tool/environment), the counts
        out.update(response_ids=r.response_ids, response_mask=r.loss_mask(), agent=r.agent_stats)
    if r.env_scores:  # the environment's named rewards and metrics
        out["env_scores"] = r.env_scores
    return out


def sample_records(step: int, eval_rollouts: list[Rollout], train_rollouts: list[Rollout], count: int) -> list[dict]:
    out = []
    for r in eval_rollouts[:count]:
        out.append(
            {
                "step": step,
                "split": "eval",
                "index": r.row.index,
                **_prompt(r.row),
                "answer": r.row.answer,
                "data_source": r.row.data_source,
                "response": r.text,
                "score": r.reward,
            }
        )
    groups: dict[int, list[Rollout]] = {}
    for r in train_rollouts:
        if r.row is not None and (r.row.index in groups or len(groups) < count):
            groups.setdefault(r.row.index, []).append(r)
    for index, group in groups.items():
        row = group[0].row
        out.append(
            {
                "step": step,
                "split": "train",
                "index": index,
                **_prompt(row),
                "answer": row.answer,
                "data_source": row.data_source,
                "responses": [_response(r) for r in group],
            }
        )
    return out


class SamplesWriter:
    """Appends to run_dir/samples.jsonl (rank 0 only; others hold a disabled writer)."""

    def __init__(self, path: Path, count: int, enabled: bool):
        self.path, self.count, self.enabled = path, count, enabled and count > 0

    def write(self, step: int, eval_rollouts: list[Rollout], train_rollouts: list[Rollout]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            for record in sample_records(step, eval_rollouts, train_rollouts, self.count):
                f.write(json.dumps(record) + "\n")


def keep_samples_until(path: Path, step: int) -> None:
    """A resumed run logs the steps after its checkpoint again: drop their samples."""
    if path.exists():
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        path.write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] <= step))
