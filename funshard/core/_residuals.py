"""What a scanned layer saves for its backward pass: every value but elementwise ones.

In a Python loop of units, the whole step is one XLA computation, and XLA's fusion
recomputes cheap elementwise values (GELU's tanh, a ReLU mask, a cast or transpose of a
gathered weight) inside the backward kernels that read them, keeping only their inputs
alive. A `lax.scan` hides that from XLA: each residual of the layer's `jax.vjp` leaves
the loop body as a stacked output, so every intermediate of every layer is stored (six
hidden-sized stacks for a GELU MLP). `recompute_elementwise` makes the scanned layer
save what the loop's fused program keeps: the outputs of matmuls, convolutions,
reductions, collectives and any other op that is not a cheap elementwise or layout op;
those are recomputed from the saved values in the backward pass, as XLA's fusion would.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

# Primitives whose outputs are recomputed rather than saved: one read of their inputs,
# no reduction, no contraction. `custom_jvp_call` is how jax.nn's activations (relu,
# relu6, hard_tanh, ...) reach the policy. Names, not objects: no jax internal imported.
_ELEMENTWISE = frozenset(
    {
        "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh",
        "broadcast_in_dim", "cbrt", "ceil", "clamp", "concatenate", "convert_element_type",
        "copy", "copy_p", "cos", "cosh", "custom_jvp_call", "div", "dynamic_slice", "eq",
        "erf", "erf_inv", "erfc", "exp", "exp2", "expand_dims", "expm1", "floor", "ge",
        "gt", "integer_pow", "iota", "is_finite", "le", "log", "log1p", "logistic", "lt",
        "max", "min", "mul", "ne", "neg", "nextafter", "not", "or", "pad", "pow",
        "reduce_precision", "rem", "reshape", "rev", "round", "rsqrt", "select_n", "sign",
        "sin", "sinh", "slice", "split", "sqrt", "square", "squeeze", "stop_gradient",
        "sub", "tan", "tanh", "transpose", "xor",
    }
)  # fmt: skip


def _saveable(prim, *_, **__) -> bool:
    return prim.name not in _ELEMENTWISE


def recompute_elementwise(fn: Callable) -> Callable:
    """`fn` under `jax.checkpoint`, saving every value but elementwise and layout ones."""
    # prevent_cse=False: inside a scan body CSE cannot merge the recomputation with the
    # forward (they run in different loops), and the barriers would only cost time.
    return jax.checkpoint(fn, policy=_saveable, prevent_cse=False)
