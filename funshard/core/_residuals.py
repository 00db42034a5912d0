"""What a unit or scanned layer saves for its backward pass: every value but elementwise ones.

In plain JAX, a whole step is one XLA computation, and XLA's fusion recomputes cheap
elementwise values (GELU's tanh, a ReLU mask, a cast or transpose of a gathered weight)
inside the backward kernels that read them, keeping only their inputs alive. A unit's
custom_vjp and a `lax.scan` hide that from XLA: each residual of the layer's `jax.vjp`
leaves the unit's forward (or, stacked, the loop body) as an output, so every
intermediate is stored (six hidden-sized arrays for a GELU MLP). `recompute_elementwise`
makes the unit save what the fused program keeps: the outputs of matmuls, convolutions,
reductions, collectives and any other op that is not a cheap elementwise or layout op;
those are recomputed from the saved values in the backward pass, as XLA's fusion would.
A function that calls `jax.checkpoint` itself keeps the user's choice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.extend as jex

from funshard.core._control_flow import sub_jaxprs

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


# `jax.checkpoint`'s primitive, under the names JAX has given it.
_CHECKPOINT = frozenset({"checkpoint", "remat", "remat2"})


def _checkpoints(jaxpr) -> bool:
    """Whether `jaxpr`, or any jaxpr inside it, calls `jax.checkpoint`."""
    return any(
        eqn.primitive.name in _CHECKPOINT or any(_checkpoints(sub) for sub in sub_jaxprs(eqn))
        for eqn in jaxpr.eqns
    )


def recompute_elementwise(fn: Callable) -> Callable:
    """`fn` under `jax.checkpoint`, saving every value but elementwise and layout ones.

    Where `fn` calls `jax.checkpoint` itself, `fn` runs as it is: an outer policy would
    override the user's (JAX lets the outer `jax.checkpoint` save values the inner one
    recomputes), and the user's choice of what to recompute comes first.
    """

    @functools.wraps(fn)
    def saving(*args):
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        if _checkpoints(closed.jaxpr):
            return fn(*args)
        # prevent_cse=False: inside a scan body CSE cannot merge the recomputation with
        # the forward (they run in different loops), and the barriers would only cost
        # time. The traced jaxpr is evaluated, not `fn` traced again.
        out = jax.checkpoint(jex.core.jaxpr_as_fun(closed), policy=_saveable, prevent_cse=False)(
            *jax.tree.leaves(args)
        )
        return jax.tree.unflatten(jax.tree.structure(shapes), out)

    return saving
