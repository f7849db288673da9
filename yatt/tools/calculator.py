"""The calculator tool: arithmetic on numbers, read with `ast` and evaluated node by node (never `eval`).

Allowed: int and float literals, + - * / // % **, unary + and -, parentheses. Anything else (names, calls,
attributes, strings, comparisons) is a per-call error naming what was refused. Powers are bounded before
they are computed (`max_result_bits`), so ``9**9**9`` is an error, not a stuck rank.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, ClassVar, Literal

from pydantic import Field

from yatt.tools.base import ToolConfig, ToolResult, string_argument


class CalculatorConfig(ToolConfig):
    kind: Literal["calculator"] = "calculator"
    max_chars: int = Field(256, gt=0, description="Longest expression accepted, in characters.")
    max_result_bits: int = Field(
        4096,
        gt=0,
        description="Largest integer a power may produce, in bits (estimated before computing it); "
        "4096 bits is about 1233 decimal digits.",
    )


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    pass


def evaluate(expression: str, max_result_bits: int = 4096) -> int | float:
    """The value of an arithmetic expression; CalculatorError (one line) for anything not allowed."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise CalculatorError(f"not an arithmetic expression ({err.msg})") from None
    return _value(tree.body, max_result_bits)


def _value(node: ast.AST, max_bits: int) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # bool is an int subclass: refused
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand, max_bits))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left, max_bits), _value(node.right, max_bits)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right, max_bits)
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
        if isinstance(result, complex):  # (-8) ** 0.5
            raise CalculatorError("result is not a real number")
        if isinstance(result, float) and not math.isfinite(result):
            raise CalculatorError("result too large")
        return result
    raise CalculatorError(f"{_describe(node)} is not allowed (numbers, + - * / // % **, parentheses)")


def _check_power(base: int | float, exponent: int | float, max_bits: int) -> None:
    """Refuse a power whose integer result would exceed max_bits, before computing it: the one operation whose
    cost is not bounded by the expression's length."""
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if math.log2(abs(base)) * exponent > max_bits:
            raise CalculatorError(f"result too large (over {max_bits} bits)")


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Constant):
        return f"the constant {node.value!r}"
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        return f"the operator {type(node.op).__name__}"
    return f"{type(node).__name__} ({ast.unparse(node)[:40]!r})"


class Calculator:
    """Evaluates ``{"expression": "1234 * 56"}``; the output is the value as Python prints it."""

    config: ClassVar[type[ToolConfig]] = CalculatorConfig
    description = "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 1234 * 56"}},
        "required": ["expression"],
    }

    def __init__(self, cfg: CalculatorConfig):
        self.cfg = cfg

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        expression = string_argument(arguments, "expression", "calculator")
        if isinstance(expression, ToolResult):
            return expression
        if len(expression) > self.cfg.max_chars:
            return ToolResult.failed(f"calculator: expression longer than {self.cfg.max_chars} characters")
        try:
            return ToolResult(output=repr(evaluate(expression, self.cfg.max_result_bits)))
        except CalculatorError as err:
            return ToolResult.failed(f"calculator: {err}")
        except RecursionError:  # thousands of nested parentheses
            return ToolResult.failed("calculator: expression nested too deeply")
        except ValueError:  # int -> str beyond Python's 4300-digit limit (a product of many large powers)
            return ToolResult.failed("calculator: result too large to print")
