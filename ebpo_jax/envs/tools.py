"""Built-in tools: plain functions with type hints and a docstring (`config.env.tools`)."""

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calc(expression: str) -> str:
  """Evaluates an integer expression of +, - and * (e.g. "123*456") and returns its value."""
  return str(_evaluate(ast.parse(expression.strip(), mode="eval").body))


def _evaluate(node: ast.AST) -> int:
  if isinstance(node, ast.Constant) and type(node.value) is int:
    return node.value
  if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
    return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
    return -_evaluate(node.operand)
  raise ValueError("only integers with + - * are allowed")
