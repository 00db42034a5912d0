"""funshard.flax: FSDP units for Flax nnx and linen models (flax is an optional extra).

```python
import funshard as fs
from flax import nnx

for blk in model.blocks:
    fs.flax.fully_shard(blk)           # units bottom-up, as in FSDP2
fs.flax.fully_shard(model)
graphdef, state = fs.flax.shard(model, mesh)

def loss_fn(state, batch):
    model = nnx.merge(graphdef, state)  # marked modules gather on call
    return mean_loss(model(batch["x"]), batch["y"])

loss, grads = jax.jit(fs.value_and_grad(loss_fn))(state, batch)
```

See docs/flax.md for what is sharded, what stays replicated, and the linen form.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

import funshard as fs
from funshard.flax import _nnx


def fully_shard(
    module: Any,
    *,
    reshard_after_forward: bool | int | None = None,
    mp_policy: fs.MixedPrecisionPolicy | None = None,
) -> Any:
    """Makes a Flax module an FSDP unit, as FSDP2's `fully_shard(module)`.

    nnx: marks the module instance in place (its class becomes `FSDP<Cls>`, a subclass
    whose `__call__` runs the original one as an `fs.fully_shard` unit) and returns it.
    Mark bottom-up: the blocks, then the model. A unit owns the `nnx.Param`s below it
    that no marked descendant owns; called with sharded parameters (inside
    `fs.value_and_grad`, after `nnx.merge(graphdef, state)`) it all-gathers only those,
    in ONE collective, and reduce-scatters their gradients in the backward pass.

    linen: takes a `flax.linen.Module` subclass and returns the unit class `FSDP<Cls>`,
    whose parameters are sharded in the variables tree and gathered when it is applied
    (see docs/flax.md).

    Args:
      module: an `nnx.Module` instance, or a `flax.linen.Module` subclass.
      reshard_after_forward: True frees the gathered parameters after the unit's forward
        and gathers them again for its backward (no recomputation); False keeps them;
        an int k keeps 1/k of them (hpZ), as for `fs.fully_shard`. None (the default,
        as in FSDP2): True for units called inside another unit, False for the
        outermost one (the root, whose backward follows its forward at once).
      mp_policy: this unit's mixed-precision policy. nnx: its parameters are sharded with
        it by `fs.flax.shard` (None: the policy given there). linen: its parameters'
        floating inputs and outputs are cast as `fs.fully_shard` casts them; the gather
        dtype is that of the policy the variables were sharded with.

    Returns:
      The same nnx module object, now a unit; or the linen unit class.

    Raises:
      ValueError: the module (or linen class) is already a unit, or
        `reshard_after_forward` is an int below 1.
      TypeError: `module` is neither an nnx module nor a linen module class (a linen
        instance included), `reshard_after_forward` is not a bool or int, or `mp_policy`
        is not an `fs.MixedPrecisionPolicy`.
    """
    options = _nnx.check_options(reshard_after_forward, mp_policy)
    if isinstance(module, nnx.Module):
        return _nnx.fully_shard_module(module, options)
    from funshard.flax import _linen

    return _linen.fully_shard_class(module, options)


def shard(
    model: nnx.Module,
    mesh,
    *filters,
    mp_policy: fs.MixedPrecisionPolicy | None = None,
) -> tuple:
    """Splits a marked nnx model into a graphdef and a state whose parameters are sharded.

    Each `nnx.Param` owned by a unit (below a marked module) becomes an `fs.Sharded`
    leaf exactly as `fs.shard` makes it (dim 0 split over the mesh's shard axis, padded;
    HSDP on a mesh with a "replicate" axis), with its unit's `mp_policy`, or `mp_policy`
    here if the unit has none. Every other variable (RNG keys and counts, batch
    statistics, parameters no unit owns) is replicated on every device of `mesh`.

    Args:
      model: the nnx model, with `fs.flax.fully_shard` applied to it or its submodules.
      mesh: the mesh (see `fs.make_mesh`).
      *filters: optional nnx filters, as for `nnx.split`: the state is split by them
        (e.g. `nnx.Param, ...` gives `graphdef, params, rest`).
      mp_policy: the mixed-precision policy of units marked without one.

    Returns:
      `(graphdef, state)`, or `(graphdef, *states)` with filters. `nnx.merge(graphdef,
      state)` rebuilds the model: its units gather when called.

    Raises:
      TypeError: `model` is not an nnx module, or `mp_policy` is not a policy.
      ValueError: no module of `model` is marked, or `fs.shard` rejects a value (e.g.
        parameters that are already sharded).
    """
    return _nnx.shard(model, mesh, *filters, mp_policy=mp_policy)


def merge(graphdef, *states) -> nnx.Module:
    """`nnx.merge(graphdef, *states)` with fresh variables, safe to write inside a step.

    nnx refuses to write a variable created in another JAX trace. Inside
    `fs.value_and_grad`, state passed as an extra argument (e.g. the `rest` of
    `fs.flax.shard(model, mesh, nnx.Param, ...)`) was created outside the loss's
    trace, so a model that writes it (RNG counts, BatchNorm statistics) needs this
    copying merge. For the state being differentiated, `nnx.merge` is enough.

    Args:
      graphdef: the graphdef from `fs.flax.shard` (or `nnx.split`).
      *states: the states to merge.

    Returns:
      The model, its units marked as they were when it was sharded.
    """
    return _nnx.merge(graphdef, *states)


def trainable(state, wrt: Any = nnx.Param):
    """Which leaves of an nnx state `fs.value_and_grad` should differentiate.

    For `fs.value_and_grad(loss_fn, trainable=fs.flax.trainable(state))` (and as an
    `optax.masked` mask) when the state holds more than parameters: RNG keys and counts
    (not floating, so the root refuses them unless frozen) or batch statistics (which
    must not be updated by the optimizer).

    Args:
      state: an nnx state (e.g. from `fs.flax.shard`).
      wrt: the nnx filter of the trainable variables (default `nnx.Param`).

    Returns:
      An `nnx.State` with the structure of `state` and a bool in place of each variable.
    """
    return _nnx.trainable(state, wrt)


__all__ = ["fully_shard", "merge", "shard", "trainable"]
