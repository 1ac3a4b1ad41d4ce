"""Tiny, safe evaluator for the integer expressions of kernel.toml (shapes and the bytes model)."""

from __future__ import annotations

import ast
import operator

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}


class ExprError(ValueError):
    pass


def names(expr: str) -> set[str]:
    """Symbols an expression refers to."""
    tree = _parse(expr)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def evaluate(expr: str, env: dict[str, float]) -> float:
    """Evaluate `expr` over `env` (numbers, names, + - * / // **, parentheses only)."""
    return _eval(_parse(expr).body, env, expr)


def _parse(expr: str) -> ast.Expression:
    try:
        return ast.parse(str(expr), mode="eval")
    except SyntaxError as exc:
        raise ExprError(f"cannot parse expression {expr!r}: {exc.msg}") from None


def _eval(node: ast.AST, env: dict[str, float], src: str) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise ExprError(f"unknown symbol {node.id!r} in {src!r}")
        return env[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_eval(node.left, env, src), _eval(node.right, env, src))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand, env, src)
    raise ExprError(f"unsupported syntax in {src!r}")
