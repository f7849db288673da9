"""Tools without a sandbox: the calculator, the Hermes tool-call parser and response format, the guard around a
call, and the tool sections of `rollout.agent` (built-in and plug-in by import path)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from yatt.agents.config import AgentConfig
from yatt.tools import TOOLS
from yatt.tools.base import ToolResult
from yatt.tools.calculator import Calculator, CalculatorConfig
from yatt.tools.hermes import MalformedCall, ToolCall, parse_tool_calls, tool_response_text
from yatt.tools.python import PythonConfig
from yatt.tools.toolbox import build_tools, call_tool, tool_schemas


def calc(expression, **cfg):
    return Calculator(CalculatorConfig(**cfg)).call({"expression": expression})


# --- calculator


@pytest.mark.parametrize(
    "expression, value",
    [
        ("1234 * 56", "69104"),
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("-3 ** 2", "-9"),
        ("--3", "3"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("2 ** -1", "0.5"),
        ("1.5e3 + 1", "1501.0"),
        (" 10 - 4 - 3 ", "3"),
        ("2 ** 10", "1024"),
    ],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert calc(expression) == ToolResult(output=value)


@pytest.mark.parametrize(
    "expression, error",
    [
        ("1 / 0", "calculator: division by zero"),
        ("5 % 0", "calculator: division by zero"),
        ("9 ** 9 ** 9", "calculator: result too large (over 4096 bits)"),
        ("2 ** 4097", "calculator: result too large (over 4096 bits)"),
        ("10.0 ** 400", "calculator: result too large"),
        ("(-8) ** 0.5", "calculator: result is not a real number"),
        ("__import__('os').system('ls')", "calculator: Call"),
        ("x + 1", "calculator: Name"),
        ("(1).real", "calculator: Attribute"),
        ("'a' * 3", "calculator: the constant 'a' is not allowed"),
        ("True + 1", "calculator: the constant True is not allowed"),
        ("1 < 2", "calculator: Compare"),
        ("1 << 5", "calculator: the operator LShift is not allowed"),
        ("1 +", "calculator: not an arithmetic expression"),
    ],
)
def test_calculator_refuses_with_a_one_line_error(expression, error):
    result = calc(expression)
    assert result.error is not None and result.error.startswith(error), result
    assert "\n" not in result.error and result.output == result.error


def test_calculator_bounds_and_arguments():
    assert calc("2 ** 4096").ok  # exactly at the bound
    assert calc("1 + 1" * 100, max_chars=50).error == "calculator: expression longer than 50 characters"
    assert calc("(" * 300 + "1" + ")" * 300, max_chars=1000).error.startswith("calculator: ")
    tool = Calculator(CalculatorConfig())
    assert tool.call({}).error == "calculator: missing argument 'expression' (a string)"
    assert tool.call({"expression": 3}).error == "calculator: argument 'expression' must be a string, got int"


# --- the Hermes / Qwen2.5 format

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>'


def test_a_well_formed_call_parses():
    parsed = parse_tool_calls("Let me compute.\n" + CALL + "<|im_end|>")
    assert parsed.items == [ToolCall("calculator", {"expression": "1 + 2"})]
    assert parsed.malformed == []


def test_several_calls_keep_their_order_with_malformed_ones_in_place():
    text = (
        CALL
        + 'then <tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
        + "<tool_call>{not json}</tool_call>"
        + '<tool_call>{"name": "python", "arguments": {}, "id": 3}</tool_call>'
    )
    parsed = parse_tool_calls(text)
    assert [type(i).__name__ for i in parsed.items] == ["ToolCall", "ToolCall", "MalformedCall", "ToolCall"]
    assert [c.name for c in parsed.calls] == ["calculator", "python", "python"]
    assert parsed.malformed[0].reason.startswith("not JSON")


@pytest.mark.parametrize(
    "text, reason",
    [
        ("<tool_call>[1, 2]</tool_call>", "expected a JSON object, got list"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'missing "name" (a non-empty string)'),
        ('<tool_call>{"name": "", "arguments": {}}</tool_call>', 'missing "name" (a non-empty string)'),
        ('<tool_call>{"name": "calculator"}</tool_call>', 'missing "arguments" (a JSON object)'),
        ('<tool_call>{"name": "calculator", "arguments": "1+2"}</tool_call>', 'missing "arguments" (a JSON object)'),
        ('<tool_call>{"name": "calculator", "arguments": {}}', "<tool_call> without </tool_call>"),
        ('{"name": "calculator", "arguments": {}}</tool_call>', "</tool_call> without <tool_call>"),
    ],
)
def test_malformed_calls_are_reported_with_why(text, reason):
    parsed = parse_tool_calls(text)
    assert parsed.calls == [] and [m.reason for m in parsed.malformed] == [reason]


def test_text_without_tags_has_no_calls():
    assert parse_tool_calls("The answer is 3.<|im_end|>").items == []
    stray = parse_tool_calls(CALL + "</tool_call>")
    assert len(stray.calls) == 1 and stray.malformed == [
        MalformedCall("</tool_call>", "</tool_call> without <tool_call>")
    ]


def test_tool_response_turn_is_what_the_qwen_template_writes():
    assert tool_response_text(["3"]) == (
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert tool_response_text(["a", "b"]) == (
        "\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tool_response_text(["3"], turn_ended=False).startswith("<|im_end|>\n<|im_start|>user\n")


# --- calling: the guard


class Raises:
    description, parameters = "raises", {"type": "object", "properties": {}}

    def call(self, arguments):
        raise RuntimeError("a bug in the tool\nsecond line")


class ReturnsText:
    description, parameters = "wrong type", {"type": "object", "properties": {}}

    def call(self, arguments):
        return "just text"


def test_a_call_never_raises():
    tools = {"calculator": Calculator(CalculatorConfig()), "raises": Raises(), "text": ReturnsText()}
    assert call_tool(tools, ToolCall("calculator", {"expression": "6*7"})).output == "42"
    unknown = call_tool(tools, ToolCall("weather", {}))
    assert unknown.error == "unknown tool 'weather'; available: calculator, raises, text"
    assert call_tool(tools, ToolCall("raises", {})).error == "raises: RuntimeError: a bug in the tool"
    assert call_tool(tools, ToolCall("text", {})).error == "text: returned str, not a ToolResult"


def test_failed_results_state_the_error_in_the_output():
    assert ToolResult.failed("x: bad") == ToolResult("x: bad", "x: bad")
    assert ToolResult.failed("x: bad", "printed\n") == ToolResult("printed\nx: bad", "x: bad")
    assert ToolResult.failed("x: bad", "printed\nx: bad\n") == ToolResult("printed\nx: bad", "x: bad")


# --- the tools' sections in rollout.agent, and plug-ins


def test_tool_sections_are_typed_and_kind_defaults_to_the_name():
    cfg = AgentConfig(kind="tool_loop", tools={"calculator": None, "python": {"timeout_s": 2}})
    assert isinstance(cfg.tools["python"], PythonConfig) and cfg.tools["python"].timeout_s == 2
    assert cfg.tools["calculator"] == CalculatorConfig()  # null: the defaults
    assert cfg.model_dump()["tools"]["python"]["memory_mb"] == 256  # serialized with the tool's own fields


def test_validation_reads_no_file():
    """An interpreter or work directory that does not exist is found on the first call, not by validation."""
    cfg = PythonConfig(interpreter="/nonexistent/python", workdir_root="/nonexistent")
    assert cfg.interpreter == "/nonexistent/python"


@pytest.mark.parametrize(
    "tools, message",
    [
        ({"python": {"timeout_s": -1}}, "greater than 0"),
        ({"python": {"timeout": 5}}, "Extra inputs are not permitted"),
        ({"weather": {}}, "unknown rollout.agent.tools.weather.kind 'weather'; registered: calculator, python"),
        ({"calc": {"kind": "calculator", "max_chars": 0}}, "greater than 0"),
        ({"x": {"kind": "no_such_pkg.tools:T"}}, "rollout.agent.tools.x.kind: cannot import 'no_such_pkg.tools'"),
        ({"x": {"kind": "tests.plugins.my_tool:Missing"}}, "has no attribute 'Missing'"),
        ({"x": 5}, "a tool's section is a mapping"),
    ],
)
def test_bad_tool_sections_fail_naming_the_problem(tools, message):
    with pytest.raises(ValidationError, match=message):
        AgentConfig(kind="tool_loop", tools=tools)


def test_a_bare_kind_is_that_tool_s_section():
    assert AgentConfig(kind="tool_loop", tools={"c": "calculator"}) == AgentConfig(
        kind="tool_loop", tools={"c": {"kind": "calculator"}}
    )
    assert AgentConfig.model_validate("single_turn") == AgentConfig()


def test_a_user_tool_plugs_in_by_import_path_with_its_own_section():
    from tests.plugins.my_tool import Reverse, ReverseConfig

    cfg = AgentConfig(kind="tool_loop", tools={"reverse": {"kind": "tests.plugins.my_tool:Reverse", "upper": True}})
    assert isinstance(cfg.tools["reverse"], ReverseConfig) and cfg.tools["reverse"].upper
    tools = build_tools(cfg.tools)
    assert isinstance(tools["reverse"], Reverse)
    assert call_tool(tools, ToolCall("reverse", {"text": "abc"})).output == "CBA"
    assert tool_schemas(tools) == [
        {"type": "function", "function": {"name": "reverse", "description": "Reverse a string.",
                                          "parameters": Reverse.parameters}}
    ]  # fmt: skip
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        AgentConfig(kind="tool_loop", tools={"reverse": {"kind": "tests.plugins.my_tool:Reverse", "lower": True}})


def test_a_user_tool_registered_by_name(monkeypatch):
    monkeypatch.setattr(TOOLS, "_entries", dict(TOOLS._entries))
    TOOLS.register("reverse", "tests.plugins.my_tool:Reverse")
    cfg = AgentConfig(kind="tool_loop", tools={"reverse": {}})
    assert call_tool(build_tools(cfg.tools), ToolCall("reverse", {"text": "ab"})).output == "ba"
