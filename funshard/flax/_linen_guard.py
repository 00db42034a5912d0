"""A clear error for a linen module applied to sharded parameters that nothing gathers.

`nn.Dense(3).apply({"params": fs.shard(params, mesh)}, x)` reads its kernel through
`flax.core.scope.Scope.param`, which compares the stored value's shape with the one its
initializer would make. The stored value is an `fs.Sharded` leaf, whose pytree child is
the padded array (or, inside a step, this device's block), so linen raised
`ScopeParamShapeError: ... expected (4, 3) but received (1, 3)`, which names neither
funshard nor the fix. `install` wraps `Scope.param` once, when `funshard.flax` is
imported, to raise a `ShardingTypeError` instead when the mismatched value is a
`Sharded` leaf, and also when the shapes match (an even leaf outside a step, any
leaf on a one-device mesh), where the module's math would refuse the leaf without
naming the module. Every other path (other values, other errors) is linen's own,
unchanged; the wrapper adds one Python call per parameter read at trace
time, nothing to the compiled program.
"""

from __future__ import annotations

import functools

import jax
from flax import errors as flax_errors
from flax.core import meta, scope

import funshard as fs
from funshard import errors

_WRAPPED = "_funshard_guarded"


def _unmarked_module_error(path_text: str, name: str, leaf: fs.Sharded) -> str:
    return (
        f"linen: the module at scope {path_text!r} read its parameter {name!r} as an "
        f"fs.Sharded leaf of shape {leaf.shape} (each device holds only its own rows), "
        "and nothing gathered it: the module's class is not a funshard unit. Mark the "
        "class, e.g. `Dense = fs.flax.fully_shard(nn.Dense)` (or the model class that "
        "holds it), so that it gathers its parameters when applied (docs/flax.md, "
        "'linen'); or apply it to fs.unshard(params)."
    )


def _sharded_in(value) -> fs.Sharded | None:
    """The first `fs.Sharded` leaf in a stored parameter (boxed in linen metadata or not)."""
    leaves = jax.tree.leaves(
        value, is_leaf=lambda x: isinstance(x, (fs.Sharded, meta.AxisMetadata))
    )
    for x in leaves:
        boxed = getattr(x, "value", None) if isinstance(x, meta.AxisMetadata) else x
        if isinstance(boxed, fs.Sharded):
            return boxed
    return None


def _guarded(param):
    @functools.wraps(param)
    def guarded(self, name, init_fn, *init_args, **init_kwargs):
        try:
            value = param(self, name, init_fn, *init_args, **init_kwargs)
        except flax_errors.ScopeParamShapeError as exc:
            stored = (
                self.get_variable("params", name) if self.has_variable("params", name) else None
            )
            found = _sharded_in(stored)
            if found is None:
                raise
            raise errors.ShardingTypeError(
                _unmarked_module_error(self.path_text, name, found)
            ) from exc
        # A leaf whose padded (or, inside a step, local) shape equals its logical one
        # passes linen's shape check; the module's math would then refuse it without
        # naming the module (every even leaf outside a step, any leaf on one device).
        found = _sharded_in(value)
        if found is not None:
            raise errors.ShardingTypeError(_unmarked_module_error(self.path_text, name, found))
        return value

    setattr(guarded, _WRAPPED, True)
    return guarded


def install() -> None:
    """Wraps linen's `Scope.param` (once per process) with the error above."""
    if not getattr(scope.Scope.param, _WRAPPED, False):
        # Replacing linen's method is the point: the guard wraps every module's params.
        scope.Scope.param = _guarded(scope.Scope.param)  # type: ignore[method-assign]
