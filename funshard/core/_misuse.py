"""The error for an `fs.Sharded` leaf used as an array: which expression, where, the fix.

A `Sharded` leaf is a value, with no key path of its own (a path would be static
metadata and would make equal layouts at different paths different pytrees). What names
it is the user's own code: the expression being executed when the leaf refused
(`state["embed"][tokens]`), read from the caller's source through PEP 657's positions,
with the operand that is the leaf (`state["embed"]`) picked out of it by its syntax, so
the message can name the leaf as the user wrote it and show the fixed expression.
"""

from __future__ import annotations

import ast
import types
from typing import Any

import numpy as np

from funshard import _py_compat

# Top-level packages whose frames sit between the user's code and the refusal (jnp
# converting its arguments, numpy's asarray): the user's frame is the first outside them.
_LIBRARIES = frozenset({"funshard", "jax", "jaxlib", "numpy"})

_OPERATORS = {
    "add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%",
    "pow": "**", "matmul": "@",
}  # fmt: skip
_UNARY = {"neg": "-", "pos": "+", "abs": "abs()", "invert": "~"}


def operation(method: str) -> str:
    """What the special method `method` (`"__getitem__"`) does to a leaf, as a template
    with `{leaf}` where the leaf goes."""
    name = method.strip("_")
    if name == "getitem":
        return "indexing {leaf}"
    if name == "iter":
        return "iterating over {leaf}"
    if name in ("array", "jax_array"):
        return "converting {leaf} to an array"
    symbol = _UNARY.get(name) or _OPERATORS[name.removeprefix("r")]
    return f"operator {symbol} on {{leaf}}"


def _operand(node: ast.expr, method: str) -> ast.expr | None:
    """The sub-expression of `node` that is the leaf, when the syntax says which."""
    name = method.strip("_")
    if name == "getitem" and isinstance(node, ast.Subscript):
        return node.value
    if name in _UNARY and isinstance(node, ast.UnaryOp):
        return node.operand
    if isinstance(node, ast.BinOp) and name.removeprefix("r") in _OPERATORS:
        return node.right if name.startswith("r") else node.left
    if name == "iter":
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            return node.generators[0].iter
        if isinstance(node, ast.Call):  # list(leaf), tuple(leaf)
            return node.args[0] if len(node.args) == 1 and not node.keywords else None
        return node  # `for x in <leaf>:` spans the iterable itself
    return None


def _value(node: ast.expr, frame: types.FrameType) -> Any:
    """What `node` evaluates to in `frame`, for names and constant subscripts of plain
    containers only (reading them runs no user code); LookupError for anything else."""
    if isinstance(node, ast.Name):
        for scope in (frame.f_locals, frame.f_globals, frame.f_builtins):
            if node.id in scope:
                return scope[node.id]
    elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        container = _value(node.value, frame)
        if type(container) in (dict, list, tuple):
            return container[node.slice.value]
    raise LookupError(ast.unparse(node))


def _holding(node: ast.expr, leaf: Any, frame: types.FrameType) -> ast.expr | None:
    """The operand or argument of `node` that evaluates to `leaf` (a conversion inside
    jax's own operator or function: `x @ p["w"]`, `jnp.take(p["embed"], ids)`)."""
    if isinstance(node, ast.BinOp):
        candidates = [node.left, node.right]
    elif isinstance(node, ast.Call):
        candidates = [*node.args, *(k.value for k in node.keywords)]
    else:
        return None
    found = []
    for candidate in candidates:
        try:
            value = _value(candidate, frame)
        except (LookupError, IndexError, TypeError):
            continue
        # jax may have rebuilt the leaf from its pytree (a jitted jnp function): the
        # same kind of leaf of the same shape and dtype is it, when only one is.
        if value is leaf or (
            type(value) is type(leaf) and (value.shape, value.dtype) == (leaf.shape, leaf.dtype)
        ):
            found.append(candidate)
    return found[0] if len(found) == 1 else None


def _parsed(text: str) -> ast.expr | None:
    try:  # in parentheses: a span over several lines parses as one expression
        return ast.parse(f"({text})", mode="eval").body
    except SyntaxError:
        return None


def _gathered(node: ast.expr, operand: ast.expr) -> str:
    """`node` with `operand` replaced by `fs.unshard(operand)`."""

    class Gather(ast.NodeTransformer):
        def visit(self, child):
            if child is operand:
                call = ast.Name("fs.unshard", ast.Load())
                return ast.Call(call, [operand], [])
            return super().visit(child)

    return ast.unparse(Gather().visit(node))


def _where(frame: types.FrameType) -> str:
    code = frame.f_code
    name = getattr(code, "co_qualname", code.co_name)
    return f"{name} ({code.co_filename}:{frame.f_lineno})"


_TAIL = (
    "each device holds only its own rows of it. Gather it first: {fix} (or "
    "fs.unshard(state) once for the whole state, or an fs.fully_shard unit, which "
    "gathers its own parameters)."
)
# A stacked leaf (`fs.shard(..., stacked=True)`) is most often met in the body of a
# `jax.lax.scan` over the stack, which slices its data but keeps its stack metadata: the
# leaf-level fix (`fs.unshard` of the slice) cannot work there, so none is shown, and
# `fs.unshard` of the stack before the scan gathers every layer at once.
_STACK_TAIL = (
    "it is a stack of layers (fs.shard(..., stacked=True)), and each device holds only "
    "its own rows of every layer. To run the layers, scan the stack with "
    "fs.lax_scan(f, init, xs), which takes jax.lax.scan's arguments, or with "
    "fs.scan(fn, stacked, carry): they gather one layer at a time (the next one "
    "prefetched) and reduce-scatter each layer's gradient. jax.lax.scan slices the stack "
    "but cannot gather a slice of it; fs.unshard(state) before the scan runs, but "
    "gathers the whole stack at once."
)


def message(method: str, sharded: Any, frame: types.FrameType | None) -> str:
    """The refusal of `method` on the leaf `sharded`, called from `frame` outward."""
    shape, dtype = tuple(sharded.shape), np.dtype(sharded.dtype).name
    leaf = f"an fs.Sharded leaf of shape {shape} and dtype {dtype}"
    what = operation(method).format(leaf=leaf)
    tail = _STACK_TAIL if getattr(sharded, "dim", 0) == 1 else _TAIL
    user = _py_compat.user_frame(frame, _LIBRARIES) if frame is not None else None
    text = _py_compat.executing_source(user) if user is not None else None
    node = _parsed(text) if text else None
    operand = _operand(node, method) if node is not None else None
    if node is not None and operand is None and user is not None:
        operand = _holding(node, sharded, user)
    if user is None:
        return f"{what}: " + tail.format(fix="fs.unshard(leaf)")
    if node is None:
        return f"{what} in {_where(user)}: " + tail.format(fix="fs.unshard(leaf)")
    if operand is None:
        return f"{what}: `{ast.unparse(node)}` in {_where(user)} uses it; " + tail.format(
            fix="pass fs.unshard(leaf) instead"
        )
    return (
        f"{what}: `{ast.unparse(node)}` in {_where(user)} reads `{ast.unparse(operand)}`, "
        f"a sharded parameter; " + tail.format(fix=f"`{_gathered(node, operand)}`")
    )
