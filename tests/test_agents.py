"""Agent loops, token by token, with a scripted model (a fake `Generate`): masks, log-prob alignment, the history
handed to each turn (never re-tokenized), max_turns and the token cap; a user loop by import path; and that a
tool_loop trajectory is exactly what the Qwen2.5 chat template renders for the same conversation."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from yatt.agents import AGENT_LOOPS, build_loop
from yatt.agents.base import Trajectory, replay, turn_seed
from yatt.agents.config import AgentConfig
from yatt.tools.hermes import tool_response_text

SPECIALS = {"<|im_start|>": 1000, "<|im_end|>": 1001}


class CharCodec:
    """One id per character (its code point), one per special token."""

    merges: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        pieces = {**SPECIALS, **self.merges}
        while i < len(text):
            piece = next((p for p in pieces if text.startswith(p, i)), None)
            ids.append(pieces[piece] if piece else ord(text[i]))
            i += len(piece) if piece else 1
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        inverse = {v: k for k, v in {**SPECIALS, **self.merges}.items()}
        return "".join(
            ("" if skip_special_tokens and i in SPECIALS.values() else inverse[i]) if i in inverse else chr(i)
            for i in ids
        )


class MergingCodec(CharCodec):
    """Like a BPE tokenizer, encodes "12" as one id: re-tokenizing a history the model wrote as "1", "2" would
    change its ids."""

    merges = {"12": 2000}


class Scripted:
    """A model that writes the given turns (text, or ids as sampled), then repeats the last; records each call.
    The log-prob of the k-th token of turn t is -t - k/1000, so alignment is checkable."""

    def __init__(self, codec: CharCodec, *turns: str | list[int]):
        self.turns = [codec.encode(t) if isinstance(t, str) else list(t) for t in turns]
        self.calls: list[tuple[list[int], int, int]] = []

    def __call__(self, prompt_ids: list[int], max_tokens: int, seed: int) -> tuple[list[int], list[float], str]:
        self.calls.append((list(prompt_ids), max_tokens, seed))
        turn = len(self.calls)
        ids = self.turns[min(turn, len(self.turns)) - 1]
        finish = "stop" if len(ids) <= max_tokens else "length"
        ids = ids[:max_tokens]
        return ids, logprobs_of(turn, len(ids)), finish


def logprobs_of(turn: int, n: int) -> list[float]:
    return [-turn - k / 1000 for k in range(n)]


def call(expression: str, name: str = "calculator") -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {"expression": expression}}) + "\n</tool_call>"


CODEC = CharCodec()
PROMPT = CODEC.encode("<|im_start|>user\nWhat is 1234 * 56?<|im_end|>\n<|im_start|>assistant\n")
TURN_1 = "I will compute it.\n" + call("1234 * 56") + "<|im_end|>"
TURN_2 = "69104<|im_end|>"


def tool_loop(codec=CODEC, **cfg):
    return build_loop(AgentConfig(**{"kind": "tool_loop", "tools": {"calculator": {}}, **cfg}), codec)


def test_single_turn_is_one_generate_call():
    model = Scripted(CODEC, "42<|im_end|>")
    t = build_loop(AgentConfig(), CODEC).run(PROMPT, model, max_new_tokens=16, seed=7)
    assert model.calls == [(PROMPT, 16, 7)]
    assert t.response_ids == CODEC.encode("42<|im_end|>") and t.response_mask == [1, 1, 1]
    assert t.rollout_logprobs == logprobs_of(1, 3)
    assert (t.finish_reason, t.ended_by, t.num_turns, t.text, t.final_text) == ("stop", "no_tool_call", 1, "42", "42")
    cut = build_loop(AgentConfig(), CODEC).run(PROMPT, Scripted(CODEC, "4242"), max_new_tokens=2, seed=0)
    assert (cut.response_ids, cut.finish_reason, cut.ended_by) == ([ord("4"), ord("2")], "length", "turn_length")


def test_tool_loop_token_by_token():
    model = Scripted(CODEC, TURN_1, TURN_2)
    t = tool_loop().run(PROMPT, model, max_new_tokens=200, seed=11)
    turn_1, turn_2 = CODEC.encode(TURN_1), CODEC.encode(TURN_2)
    environment = CODEC.encode(tool_response_text(["69104"]))
    # the response is the turns' ids as sampled and the environment's ids, concatenated
    assert t.response_ids == turn_1 + environment + turn_2
    assert t.response_mask == [1] * len(turn_1) + [0] * len(environment) + [1] * len(turn_2)
    assert t.rollout_logprobs == logprobs_of(1, len(turn_1)) + [0.0] * len(environment) + logprobs_of(2, len(turn_2))
    # each turn continued exactly the ids so far, with its own seed
    assert model.calls == [(PROMPT, 200, 11), (PROMPT + turn_1 + environment, 200, turn_seed(11, 1))]
    assert turn_seed(11, 1) != 11
    assert CODEC.decode(environment) == "\n<|im_start|>user\n<tool_response>\n69104\n</tool_response><|im_end|>\n" \
        "<|im_start|>assistant\n"  # fmt: skip
    assert (t.finish_reason, t.ended_by, t.num_turns) == ("stop", "no_tool_call", 2)
    assert (t.tool_calls, t.malformed_tool_calls, t.tool_errors) == (1, 0, 0)
    assert t.final_text == "69104" and "<tool_response>\n69104\n</tool_response>" in t.text
    assert "<|im_end|>" not in t.text


def test_replay_is_the_loop_with_the_given_turns():
    """A warm-up's example is the trajectory the loop builds from the row's turns: the same ids and mask as a
    rollout whose model wrote them, the tool run and its response added by the loop."""
    turns = [CODEC.encode(TURN_1), CODEC.encode(TURN_2)]
    replayed = replay(tool_loop(), PROMPT, turns, max_new_tokens=200)
    sampled = tool_loop().run(PROMPT, Scripted(CODEC, TURN_1, TURN_2), max_new_tokens=200, seed=0)
    assert (replayed.response_ids, replayed.response_mask) == (sampled.response_ids, sampled.response_mask)
    assert replayed.tool_calls == 1 and replayed.final_text == "69104"
    with pytest.raises(ValueError, match="asks for model turn 2 but there are 1"):
        replay(tool_loop(), PROMPT, turns[:1], max_new_tokens=200)  # the last turn calls a tool
    with pytest.raises(ValueError, match="ended after model turn 1 of 2"):
        replay(tool_loop(), PROMPT, [turns[1], turns[1]], max_new_tokens=200)  # turn 1 calls nothing
    with pytest.raises(ValueError, match="more than the 10 the loop allows"):
        replay(tool_loop(), PROMPT, turns, max_new_tokens=10)


def test_the_history_is_never_re_tokenized():
    """The model wrote "1" and "2" as two ids; the tokenizer would encode "12" as one. The second turn must see the
    two ids the model sampled, and the trajectory must hold them."""
    codec = MergingCodec()
    before, after = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "', '"}}\n</tool_call><|im_end|>'
    sampled = codec.encode(before) + [ord("1"), ord("2")] + codec.encode(after)
    model = Scripted(codec, sampled, "done<|im_end|>")
    t = tool_loop(codec).run(PROMPT, model, max_new_tokens=200, seed=0)
    history = model.calls[1][0]
    environment = codec.encode(tool_response_text(["12"]))  # tokenized alone: here "12" is one id
    assert history == PROMPT + sampled + environment and 2000 in environment
    assert codec.encode(codec.decode(history)) != history  # what re-tokenizing would have done
    assert t.response_ids[: len(sampled)] == sampled and t.response_mask[: len(sampled)] == [1] * len(sampled)
    assert t.tool_calls == 1 and t.tool_errors == 0


def test_two_calls_in_a_turn_get_two_responses_in_order_and_bad_calls_are_answered():
    turn = call("2 + 2") + call("1 / 0") + "<tool_call>{oops</tool_call>" + call("1", name="weather") + "<|im_end|>"
    model = Scripted(CODEC, turn, "ok<|im_end|>")
    t = tool_loop().run(PROMPT, model, max_new_tokens=500, seed=0)
    environment = CODEC.decode(model.calls[1][0][len(PROMPT) + len(CODEC.encode(turn)) :])
    assert environment == tool_response_text(
        [
            "4",
            "calculator: division by zero",
            "malformed tool call: not JSON (Expecting property name enclosed in double quotes at character 1)",
            "unknown tool 'weather'; available: calculator",
        ]
    )
    assert (t.tool_calls, t.malformed_tool_calls, t.tool_errors) == (3, 1, 2)


def test_a_turn_that_did_not_end_at_im_end_is_closed_by_the_environment():
    model = Scripted(CODEC, call("1 + 1"), "2<|im_end|>")  # stopped at another stop token, after </tool_call>
    t = tool_loop().run(PROMPT, model, max_new_tokens=200, seed=0)
    start = len(CODEC.encode(call("1 + 1")))
    assert t.response_ids[start] == SPECIALS["<|im_end|>"] and t.response_mask[start] == 0


def test_max_turns_stops_a_model_that_keeps_calling():
    calls = []

    class Counting:
        description, parameters = "counts", {"type": "object", "properties": {}}

        def call(self, arguments):
            from yatt.tools.base import ToolResult

            calls.append(arguments)
            return ToolResult(output=str(len(calls)))

    loop = tool_loop(max_turns=3)
    loop.tools = {"calculator": Counting()}
    model = Scripted(CODEC, call("1") + "<|im_end|>")
    t = loop.run(PROMPT, model, max_new_tokens=200, seed=0)
    assert len(model.calls) == 3 and t.num_turns == 3 and len(calls) == 2  # the last turn's call is not run
    assert (t.finish_reason, t.ended_by, t.tool_calls) == ("length", "max_turns", 3)
    assert t.response_mask.count(0) == 2 * len(CODEC.encode(tool_response_text(["1"])))


def test_the_token_cap_bounds_every_turn_and_the_trajectory():
    turn_1 = CODEC.encode(TURN_1)
    environment = CODEC.encode(tool_response_text(["69104"]))
    # room for turn 1 and the tool response, then 3 tokens of the answer: the second turn is cut by the cap
    cap = len(PROMPT) + len(turn_1) + len(environment) + 3
    model = Scripted(CODEC, TURN_1, TURN_2)
    t = tool_loop(max_trajectory_tokens=cap).run(PROMPT, model, max_new_tokens=200, seed=0)
    assert [c[1] for c in model.calls] == [min(200, cap - len(PROMPT)), 3]
    assert t.num_tokens == cap and (t.finish_reason, t.ended_by) == ("length", "token_cap")
    assert t.response_mask == [1] * len(turn_1) + [0] * len(environment) + [1] * 3
    # a tool response that would leave no room to answer is not added
    model = Scripted(CODEC, TURN_1, TURN_2)
    t = tool_loop(max_trajectory_tokens=cap - 3).run(PROMPT, model, max_new_tokens=200, seed=0)
    assert (
        len(model.calls) == 1 and t.response_ids == turn_1 and (t.finish_reason, t.ended_by) == ("length", "token_cap")
    )
    # the first turn already gets only what the cap leaves
    model = Scripted(CODEC, TURN_1)
    t = tool_loop(max_trajectory_tokens=len(PROMPT) + 5).run(PROMPT, model, max_new_tokens=200, seed=0)
    assert model.calls[0][1] == 5 and t.num_tokens == len(PROMPT) + 5 and t.ended_by == "token_cap"
    # a turn cut by max_new_tokens, with room left under the cap
    t = tool_loop().run(PROMPT, Scripted(CODEC, TURN_1), max_new_tokens=5, seed=0)
    assert (t.finish_reason, t.ended_by, len(t.response_ids)) == ("length", "turn_length", 5)


def test_the_python_tool_in_the_loop():
    turn = '<tool_call>\n{"name": "python", "arguments": {"code": "print(sum(range(10)))"}}\n</tool_call><|im_end|>'
    model = Scripted(CODEC, turn, "45<|im_end|>")
    t = tool_loop(tools={"python": {}}).run(PROMPT, model, max_new_tokens=500, seed=0)
    assert "<tool_response>\n45\n</tool_response>" in CODEC.decode(t.response_ids)
    assert (t.tool_calls, t.tool_errors, t.final_text) == (1, 0, "45")


def test_trajectory_append_checks_alignment():
    t = Trajectory(prompt_ids=[1])
    with pytest.raises(ValueError, match="a model turn of 2 ids came with 1 log-probs"):
        t.append([5, 6], [-0.1])


# --- rollout.agent and plug-in loops


def test_agent_config_checks_kind_and_combinations():
    assert AgentConfig().kind == "single_turn"
    with pytest.raises(ValidationError, match="unknown rollout.agent.kind 'react'; registered: single_turn, tool_loop"):
        AgentConfig(kind="react")
    with pytest.raises(ValidationError, match="tools is set but kind is single_turn"):
        AgentConfig(tools={"calculator": {}})
    with pytest.raises(ValidationError, match="tool_loop needs at least one tool"):
        AgentConfig(kind="tool_loop")
    with pytest.raises(ValidationError, match="options is set but loop 'tool_loop' declares no `config` class"):
        AgentConfig(kind="tool_loop", tools={"calculator": {}}, options={"x": 1})
    with pytest.raises(ValidationError, match="max_turns"):
        AgentConfig(kind="tool_loop", tools={"calculator": {}}, max_turns=0)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        AgentConfig(max_turn=3)


LOOP = "tests.plugins.my_agent_loop:AskTwice"


def test_a_user_loop_plugs_in_by_import_path_with_its_own_options():
    from tests.plugins.my_agent_loop import AskTwice, AskTwiceConfig

    cfg = AgentConfig(kind=LOOP, options={"nudge": "\nSure?\n"})
    assert isinstance(cfg.options, AskTwiceConfig)
    loop = build_loop(cfg, CODEC)
    assert isinstance(loop, AskTwice)
    model = Scripted(CODEC, "41<|im_end|>", "42<|im_end|>")
    t = loop.run(PROMPT, model, max_new_tokens=8, seed=3)
    nudge = CODEC.encode("\nSure?\n")
    assert t.response_ids == CODEC.encode("41<|im_end|>") + nudge + CODEC.encode("42<|im_end|>")
    assert t.response_mask == [1, 1, 1] + [0] * len(nudge) + [1, 1, 1]
    assert model.calls[1] == (PROMPT + CODEC.encode("41<|im_end|>") + nudge, 8, turn_seed(3, 1))
    assert t.final_text == "42"
    assert AgentConfig(kind=LOOP).options == AskTwiceConfig()  # no options: its defaults
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        AgentConfig(kind=LOOP, options={"nudges": "x"})
    with pytest.raises(ValidationError, match="cannot import 'tests.plugins.nope'"):
        AgentConfig(kind="tests.plugins.nope:Loop")


def test_a_user_loop_registered_by_name(monkeypatch):
    monkeypatch.setattr(AGENT_LOOPS, "_entries", dict(AGENT_LOOPS._entries))
    AGENT_LOOPS.register("ask_twice", LOOP)
    t = build_loop(AgentConfig(kind="ask_twice"), CODEC).run(PROMPT, Scripted(CODEC, "1"), 4, 0)
    assert t.num_turns == 2


# --- against a real tokenizer and chat template

# Qwen2.5-Instruct's chat template (tokenizer_config.json), the branches a tool conversation uses
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou are a helpful assistant.\\n\\n# Tools\\n\\n"
    "You may call one or more functions to assist with the user query.\\n\\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_trajectory_is_what_the_chat_template_renders():
    """Turn by turn, with a Hugging Face tokenizer: prompt + response decode to the template's rendering of the same
    conversation (which ends with a newline after the last <|im_end|>, a token no model turn contains)."""
    import string

    from yatt.agents.base import TokenizerCodec
    from yatt.models.tiny import build_char_tokenizer
    from yatt.tools.toolbox import build_tools, tool_schemas

    tokenizer = build_char_tokenizer(string.printable)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = QWEN_TOOLS_TEMPLATE
    tokenizer.clean_up_tokenization_spaces = False
    codec = TokenizerCodec(tokenizer)
    cfg = AgentConfig(kind="tool_loop", tools={"calculator": {}})
    schemas = tool_schemas(build_tools(cfg.tools))
    question = [{"role": "user", "content": "What is 1234 * 56?"}]
    prompt = tokenizer.apply_chat_template(question, tools=schemas, add_generation_prompt=True, tokenize=False)
    prompt_ids = codec.encode(prompt)
    model = Scripted(codec, call("1234 * 56") + "<|im_end|>", "1234 * 56 = 69104<|im_end|>")
    t = build_loop(cfg, codec).run(prompt_ids, model, max_new_tokens=200, seed=0)
    conversation = question + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1234 * 56"}}}]},
        {"role": "tool", "content": "69104"},
        {"role": "assistant", "content": "1234 * 56 = 69104"},
    ]  # fmt: skip
    rendered = tokenizer.apply_chat_template(conversation, tools=schemas, tokenize=False)
    assert codec.decode(t.prompt_ids + t.response_ids) + "\n" == rendered
    assert t.prompt_ids + t.response_ids + codec.encode("\n") == codec.encode(rendered)
    assert t.final_text == "1234 * 56 = 69104" and t.num_turns == 2
