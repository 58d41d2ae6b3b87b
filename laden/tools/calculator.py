"""Arithmetic from a model's text, evaluated safely: the expression is parsed (`ast`) and only numbers,
`+ - * / // % **`, unary signs and parentheses are evaluated; names, calls, attributes and every other node are
refused, so no code runs. Exponents and results are bounded so that `9**9**9` cannot exhaust the machine."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_EXPRESSION_CHARS = 256
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e18

_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip
_UNARY: dict[type, Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says why (it is shown to the model)."""


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of `expression` (`CalculatorError` for anything but bounded arithmetic on numbers).

    Integers stay integers (`7 // 2` is 3, `2 ** 10` is 1024); `/` gives a float. `^` is read as a power, as
    people write it."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("expected a non-empty arithmetic expression, such as '3 + 4 * 2'")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip().replace("^", "**"), mode="eval")
    except SyntaxError as err:
        raise CalculatorError(f"not an arithmetic expression: {err.msg}") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int | float:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except (OverflowError, TypeError, ValueError) as err:  # complex powers and the like
            raise CalculatorError(f"cannot evaluate: {err}") from None
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise CalculatorError(f"only numbers, + - * / // % ** and parentheses are allowed, not {what}")


def _checked(value: int | float) -> int | float:
    if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"result out of range (magnitude above {MAX_MAGNITUDE:g} or not finite)")
    return value


def format_number(value: int | float) -> str:
    """`value` as the calculator reports it: an integer-valued float without its `.0`, others to 12 digits."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"
