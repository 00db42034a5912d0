"""Randomness inside the root: independent draws per example, as on the global batch.

The loss runs on every device with the step's replicated arguments, so a key passed to
the step is the same on every device, and `jax.random.bernoulli(key, p, (rows,))` would
draw the same mask for every device's slice of the batch: plain JAX on the global batch
draws one mask for all of its rows, never the same one for each slice. So the root folds
each device's index over the data axes (and, with microbatches, the microbatch's index)
into every typed key among the step's arguments, for that call only: the numbers are
still a function of the user's key, and differ between examples as on the global batch.
`funshard.flax` does the same for the keys of its modules.

Keys that the root cannot see are checked instead: a draw whose key is the same on every
device (a raw `uint32` key passed as an argument, a key made inside the loss from a
constant, a key held in the state) is refused at trace time with the ways out. Both are
switched off by `value_and_grad(..., per_device_keys=False)`, for steps whose draws are
meant to be shared by every example (noise added to the parameters).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax

from funshard import _jax_compat, errors
from funshard.core._control_flow import sub_jaxprs
from funshard.core._sharded import is_key


def fold_in(key: jax.Array, index: jax.Array) -> jax.Array:
    """`jax.random.fold_in` of every key of a (possibly shaped) typed key array."""
    if key.ndim == 0:
        return jax.random.fold_in(key, index)
    flat = key.reshape(-1)
    return jax.vmap(lambda k: jax.random.fold_in(k, index))(flat).reshape(key.shape)


def fold_in_keys(tree: Any, index: jax.Array) -> Any:
    """`tree` with `index` folded into each of its typed key arrays; other leaves kept."""
    return jax.tree.map(lambda x: fold_in(x, index) if is_key(x) else x, tree)


def restore_keys(tree: Any, folded: Any, originals: Any) -> Any:
    """`tree` with each key of `folded` that it holds unchanged replaced by the original.

    A loss function that returns the keys it was given (Flax's RNG streams, written
    back through aux) gets the caller's keys back, not this device's folded ones, as
    Flax's units restore the keys they fold. Matched by identity: only a key the loss
    returned untouched is replaced.
    """
    pairs = {
        id(f): o
        for f, o in zip(jax.tree.leaves(folded), jax.tree.leaves(originals), strict=True)
        if f is not o
    }
    if not pairs:
        return tree
    return jax.tree.map(lambda x: pairs.get(id(x), x), tree)


def _draws(jaxpr: Any, where: str = "") -> Iterator[tuple[Any, str]]:
    """The `random_bits` equations of `jaxpr` (every sampler draws through it), nested
    ones included, each with the user's source line that leads to it.

    jax.random's samplers are jitted, so the draw itself sits in a nested jaxpr whose
    equations know only JAX's own frames: the outermost equation's line is the user's.
    """
    for eqn in jaxpr.eqns:
        line = where or _jax_compat.source_line(eqn)
        if eqn.primitive.name == "random_bits":
            yield eqn, line
        for sub in sub_jaxprs(eqn):
            yield from _draws(sub, line)


def _same_key_everywhere(fn: str, where: str, dp_axes: tuple[str, ...]) -> str:
    axes = tuple(dp_axes)
    return (
        f"{fn}: a random draw (at {where}) uses a key that is the "
        f"same on several devices (it does not vary over every data axis of {axes}), so "
        "those devices would draw the same numbers for their own rows of the batch (the same "
        "dropout mask on every slice), unlike plain JAX on the global batch. Pass the key "
        "to the step as an argument, as a typed key (jax.random.key(seed), or "
        "jax.random.wrap_key_data(raw_key) for a jax.random.PRNGKey): the step folds "
        "each device's index into typed keys among its arguments. Or fold it in yourself: "
        f"jax.random.fold_in(key, jax.lax.axis_index({axes})). If the same numbers on "
        "every device are what you want (noise shared by the whole batch), pass "
        f"{fn}(..., per_device_keys=False)."
    )


def check_draws(jaxpr: Any, dp_axes: tuple[str, ...], fn: str = "value_and_grad") -> None:
    """Raises if a draw in `jaxpr` (a step's microbatch) uses a key that is the same on
    every device.

    Args:
      jaxpr: the microbatch's jaxpr, traced inside the root's `shard_map`.
      dp_axes: the step's data-parallel axes.
      fn: the public function to name in the message.

    Raises:
      ShardingValueError: naming the draw's source line and the ways to fix it.
    """
    for eqn, where in _draws(jaxpr):
        if not set(dp_axes) <= _jax_compat.aval_varying_axes(eqn.invars[0].aval):
            raise errors.ShardingValueError(_same_key_everywhere(fn, where, dp_axes))
