"""How often a judge agrees with the rule verifier on responses a real policy samples.

    python launch/judge_agreement.py --config configs/quickstart_genrm.yaml [--samples 8] [--out FILE.json]
    python launch/judge_agreement.py --config configs/quickstart_vl_genrm.yaml   # image prompts, a VL judge

The policy (the config's model) samples `--samples` responses per held-out prompt with the config's
rollout settings; every judge of the config reads them; each verdict is compared with the
exact-match rule. Prints agreement, the confusion counts and unreadable verdicts, and writes JSON.
Image prompts go to the policy with their images, and to a vision-language judge too (Judge.request).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from yatt.agents.config import AgentConfig  # noqa: E402
from yatt.config import load_experiment  # noqa: E402
from yatt.controllers.conversations import Agent  # noqa: E402
from yatt.controllers.images import load_batch_images  # noqa: E402
from yatt.controllers.rollouts import encode_prompts, generate_rollouts  # noqa: E402
from yatt.data.sources import load_shard  # noqa: E402
from yatt.engines.base import SamplingSpec  # noqa: E402
from yatt.engines.client import spawn_engine  # noqa: E402
from yatt.engines.pool import EnginePool  # noqa: E402
from yatt.genrm.judge import Judge  # noqa: E402
from yatt.models.tokenizer import load_tokenizer  # noqa: E402
from yatt.models.vision import ImageInputs, is_vision_model  # noqa: E402
from yatt.rewards.rules import score as rule_score  # noqa: E402
from yatt.rewards.rules import use_verifiers


def measure(config: str, samples: int, seed: int = 0) -> dict:
    cfg = load_experiment(config)
    if cfg.data.eval is None or not cfg.reward.judges:
        raise SystemExit(f"{config}: needs data.eval and at least one reward.judges entry")
    tokenizer = load_tokenizer(cfg.model.path)
    inputs = ImageInputs(cfg.model.path) if is_vision_model(cfg.model.path) else None
    rows = load_shard(cfg.data.eval, 0, 1, limit=cfg.data.eval_prompts)
    use_verifiers(cfg.reward.verifiers, rows)  # the config's own verifiers score the rows too
    logs = Path(tempfile.mkdtemp(prefix="yatt-agreement-"))
    sampling = SamplingSpec(
        n=samples,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_tokens=cfg.rollout.max_new_tokens,
        stop_token_ids=[tokenizer.eos_token_id],
        logprobs=False,
    )
    with spawn_engine(str(cfg.model.path), cfg.rollout.engine, seed, logs / "policy.log") as policy:
        prompt_ids = encode_prompts(rows, tokenizer, cfg.data.max_prompt_tokens)
        images = load_batch_images(rows, inputs, prompt_ids)
        rollouts = generate_rollouts(
            EnginePool({"policy": policy}),
            rows,
            prompt_ids,
            sampling,
            tokenizer,
            [seed * 1_000_003 + i * samples for i in range(len(rows))],
            Agent.build(AgentConfig(), tokenizer),  # single_turn: one sampled response per sample
            images,
        )
    rule = [rule_score(r.text, r.row) >= 1.0 for r in rollouts]
    report = {"config": config, "responses": len(rollouts), "rule_correct_frac": sum(rule) / len(rule), "judges": {}}
    for jcfg in cfg.reward.judges:
        judge = Judge(jcfg)
        with spawn_engine(str(jcfg.model), jcfg.engine, seed, logs / f"{jcfg.name}.log") as engine:
            asks = [
                judge.request(r.row.question(), r.row.answer, r.text, r.vision.images if r.vision else None)
                for r in rollouts
            ]
            seen = [im for _, im in asks]
            outs = engine.generate([ids for ids, _ in asks], judge.sampling, images=seen if any(seen) else None)
        verdicts = [judge.score(c) for c in outs]
        said_yes = [v.score > jcfg.verdict.pass_threshold for v in verdicts]
        pairs = list(zip(rule, said_yes))
        report["judges"][jcfg.name] = {
            "agreement": sum(a == b for a, b in pairs) / len(pairs),
            "true_yes": sum(a and b for a, b in pairs),
            "true_no": sum(not a and not b for a, b in pairs),
            "false_yes": sum(not a and b for a, b in pairs),
            "false_no": sum(a and not b for a, b in pairs),
            "unparseable": sum(v.unparseable for v in verdicts),
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--samples", type=int, default=8, help="responses per held-out prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the report as JSON here")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report = measure(args.config, args.samples, args.seed)
    print(f"{report['responses']} responses, rule says {report['rule_correct_frac']:.3f} correct")
    for name, r in report["judges"].items():
        print(
            f"judge {name}: agreement {r['agreement']:.4f}  (yes/yes {r['true_yes']}, no/no {r['true_no']}, "
            f"judge yes/rule no {r['false_yes']}, judge no/rule yes {r['false_no']}, unreadable {r['unparseable']})"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
