"""`filter_custom_vjp`: `jax.custom_vjp` over pytrees whose leaves need not all be arrays.

`jax.custom_vjp` differentiates arrays, and takes other values only as hashable
`nondiff_argnums`. funshard's rules take the pytrees a unit works with: parameters with
`None` placeholders, Python numbers and strings among them, `fs.Sharded` leaves whose
layout is static. Like `equinox.filter_custom_vjp`, this helper differentiates the array
leaves and holds every other leaf in a closure, handing the rule back whole trees.

It adds no communication: a rule's cotangents must already have their primals' shard_map
types (JAX checks). In particular the HSDP sum over the replicate axes is the rule's own
all-reduce (`funshard.comm`'s reduce-scatter, in the policy's `reduce_dtype`), not an
implicit sum here.

Like `_jax_compat`, this module sits at the root floor: the comm layer and the core may
both use it; it imports nothing of funshard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def is_array(x: Any) -> bool:
    """Whether `x` is an array leaf funshard moves to devices (jax, numpy or tracer).

    Also what `filter_custom_vjp` differentiates; `funshard.core` re-exports it.
    """
    if isinstance(x, (str, bytes)):  # np.str_ / np.bytes_ are np.generic too
        return False
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


class filter_custom_vjp:
    """`fn` with the derivative rule given by `defvjp(fwd, bwd)`, over pytrees.

    Calling it with `fn`'s arguments differentiates their array leaves (`jax.Array`s,
    numpy arrays, tracers); every other leaf is static, held in a closure and put back
    before `fn`, `fwd` and `bwd` see the arguments. `fn` and `fwd` return a pytree of
    arrays (None allowed); residuals are a pytree of arrays (None allowed).

    `bwd(residuals, ct)` returns one cotangent per argument, each in that argument's
    structure: arrays at its array leaves (None: zero), anything at its static leaves
    (ignored). Each array cotangent must vary over exactly its primal's mesh axes:
    JAX rejects one that varies over more (nothing here sums it).
    """

    def __init__(self, fn: Callable):
        self.fn = fn
        self.fwd: Callable | None = None
        self.bwd: Callable | None = None

    def defvjp(self, fwd: Callable, bwd: Callable) -> None:
        """Sets the rule: `fwd(*args) -> (out, residuals)`, `bwd(residuals, ct)`."""
        self.fwd, self.bwd = fwd, bwd

    def __call__(self, *args):
        leaves, treedef = jax.tree_util.tree_flatten(args)
        positions = [i for i, x in enumerate(leaves) if is_array(x)]

        def rebuild(arrays) -> tuple:
            full = list(leaves)
            for i, a in zip(positions, arrays, strict=True):
                full[i] = a
            return jax.tree_util.tree_unflatten(treedef, full)

        @jax.custom_vjp
        def call(arrays):
            return self.fn(*rebuild(arrays))

        def call_fwd(arrays):
            assert self.fwd is not None, "filter_custom_vjp: differentiated before defvjp"
            return self.fwd(*rebuild(arrays))

        def call_bwd(residuals, ct):
            assert self.bwd is not None, "filter_custom_vjp: differentiated before defvjp"
            # jaxlib ships no stub for PyTreeDef: its public flatten_up_to is unknown to mypy.
            flat = treedef.flatten_up_to(tuple(self.bwd(residuals, ct)))  # type: ignore[attr-defined]
            return ([flat[i] for i in positions],)

        call.defvjp(call_fwd, call_bwd)
        return call([leaves[i] for i in positions])
