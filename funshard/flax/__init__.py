"""funshard.flax: FSDP units for Flax nnx and linen models (flax is an optional extra).

```python
import funshard as fs
from flax import nnx

for blk in model.blocks:
    fs.flax.fully_shard(blk)           # units bottom-up, as in FSDP2
fs.flax.fully_shard(model)
graphdef, state = fs.flax.shard(model, mesh)
mask = fs.flax.trainable(state)        # parameters only: RNG state, statistics frozen

def loss_fn(state, batch):
    model = nnx.merge(graphdef, state)  # marked modules gather on call
    loss = mean_loss(model(batch["x"]), batch["y"])
    return loss, nnx.state(model, nnx.Not(nnx.Param))   # RNG counts, batch statistics

(loss, written), grads = fs.value_and_grad(loss_fn, has_aux=True, trainable=mask)(state, batch)
updates, opt_state = optax.masked(opt, mask).update(grads, opt_state, state)
state = fs.flax.apply_updates(state, updates, written)
```

Inside a step, units compute BatchNorm statistics over the global batch (SyncBatchNorm)
and draw RNG keys per device. See docs/flax.md for what is sharded, what stays
replicated, the linen form and `fs.flax.plan`. The `TypeError`s and `ValueError`s named
below are `funshard.errors.ShardingTypeError` / `ShardingValueError`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax.sharding import Mesh

try:
    from flax import nnx
except ModuleNotFoundError as error:
    if error.name != "flax":
        raise
    # A subclass of ImportError with the missing module's name, as pytest.importorskip
    # and `except ModuleNotFoundError` expect; the message names the extra to install.
    raise ModuleNotFoundError(
        'funshard.flax needs Flax, an optional extra of funshard: pip install "funshard[flax]" '
        '(or "funshard[examples]" for examples/train_lm.py).',
        name="flax",
    ) from error

import funshard as fs
from funshard.flax import _linen_guard, _nnx

# A linen module applied to sharded parameters it does not gather gets funshard's error,
# not linen's shape mismatch (see _linen_guard).
_linen_guard.install()


def fully_shard(
    module: Any,
    *,
    reshard_after_forward: bool | int | None = None,
    mp_policy: fs.MixedPrecisionPolicy | None = None,
    all_gather: fs.AllGather | None = None,
    reduce_scatter: fs.ReduceScatter | None = None,
) -> Any:
    """Makes a Flax module an FSDP unit, as FSDP2's `fully_shard(module)`.

    nnx: marks the module instance in place (its class becomes `FSDP<Cls>`, a subclass
    whose `__call__` runs the original one as an `fs.fully_shard` unit) and returns it.
    Mark bottom-up: the blocks, then the model. A unit owns the `nnx.Param`s below it
    that no marked descendant owns; called with sharded parameters (inside
    `fs.value_and_grad`, after `nnx.merge(graphdef, state)`) it all-gathers only those,
    in ONE collective, and reduce-scatters their gradients in the backward pass.

    linen: takes a `flax.linen.Module` subclass (or a `functools.partial` of one) and
    returns the unit class (or the same partial of it), whose parameters are sharded in
    the variables tree and gathered when it is applied (see docs/flax.md).

    Arguments of the call that are not arrays (`train: bool`, strings, None) reach the
    module unchanged, as static values; arrays are traced. Inside `fs.value_and_grad` a
    unit's BatchNorms average their statistics over the data-parallel axes (equal to
    the unsharded model on the global batch), and its dropout masks are the unsharded
    model's (the root draws each device's rows of the global batch's draw).

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
      all_gather: the unit's own all-gather, as for `fs.fully_shard`.
      reduce_scatter: the unit's own reduce-scatter, as for `fs.fully_shard`.

    Returns:
      The same nnx module object, now a unit; or the linen unit class.

    Raises:
      ValueError: the module (or linen class) is already a unit, or
        `reshard_after_forward` is an int below 1.
      TypeError: `module` is neither an nnx module nor a linen module class (a linen
        instance included), `reshard_after_forward` is not a bool or int, `mp_policy`
        is not an `fs.MixedPrecisionPolicy`, or `all_gather` / `reduce_scatter` is not
        an `fs.AllGather` / `fs.ReduceScatter`.
    """
    options = _nnx.check_options(reshard_after_forward, mp_policy, all_gather, reduce_scatter)
    if isinstance(module, nnx.Module):
        return _nnx.fully_shard_module(module, options)
    from funshard.flax import _linen

    return _linen.fully_shard_class(module, options)


def shard(
    model: nnx.Module,
    mesh: Mesh,
    *filters: nnx.filterlib.Filter,
    mp_policy: fs.MixedPrecisionPolicy | None = None,
    shard_axis: str | tuple[str, ...] | None = None,
    model_spec: Callable[[Any, Any], Any] | None = None,
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
      shard_axis: as in `fs.shard` (default: its "fsdp").
      model_spec: tensor or expert parallelism, as in `fs.shard`: a function
        `(path, array)` returning the `PartitionSpec` of a unit's parameter over the
        mesh's model axes (or None), `path` being the parameter's key path in the nnx
        state (e.g. `jax.tree_util.keystr(path)` ends in `['up']['kernel'].value`). The
        modules then compute on model blocks and write their model axes' collectives
        (`fs.row_parallel`, ...); see docs/parallelism.md.

    Returns:
      `(graphdef, state)`, or `(graphdef, *states)` with filters. `nnx.merge(graphdef,
      state)` rebuilds the model: its units gather when called.

    Raises:
      TypeError: `model` is not an nnx module, or `mp_policy` is not a policy.
      ValueError: no module of `model` is marked; a BatchNorm that computes statistics
        is in no unit (so nothing would average them over the devices); a mesh other
        than `mesh` is set with `jax.set_mesh` (the step would fail on it); or
        `fs.shard` rejects a value (e.g. parameters that are already sharded).
    """
    return _nnx.shard(
        model, mesh, *filters, mp_policy=mp_policy, shard_axis=shard_axis, model_spec=model_spec
    )


def merge(graphdef: nnx.GraphDef, *states: nnx.State) -> nnx.Module:
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


def trainable(state: nnx.State, wrt: nnx.filterlib.Filter = nnx.Param) -> nnx.State:
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


def apply_updates(
    state: nnx.State,
    updates: nnx.State,
    written: nnx.State | None = None,
    wrt: nnx.filterlib.Filter = nnx.Param,
) -> nnx.State:
    """Applies optimizer updates to the trainable variables of an nnx state.

    The single-state loop's last line. `optax.apply_updates` adds an update to every
    leaf, which a typed RNG key cannot take (and an RNG count or a batch statistic must
    not); this adds the updates of the variables `wrt` selects, as
    `optax.apply_updates` does, and takes every other variable from `written` (what the
    loss returned as `nnx.state(model, nnx.Not(nnx.Param))`: advanced RNG counts, new
    batch statistics), or keeps it as it was.

    Args:
      state: the state (e.g. from `fs.flax.shard(model, mesh)`).
      updates: the optimizer's updates, with the structure of `state` (e.g. from
        `optax.masked(opt, fs.flax.trainable(state)).update(grads, opt_state, state)`).
      written: an nnx state of variables of `state` that the step wrote, or None.
      wrt: the nnx filter of the trainable variables (default `nnx.Param`).

    Returns:
      The new state: trainable variables plus their updates (in their own dtype),
      written variables replaced, the rest unchanged.

    Raises:
      ValueError: `written` holds a variable that `state` does not.
    """
    return _nnx.apply_updates(state, updates, written, wrt)


def plan(
    model: Any,
    mesh: Mesh | None = None,
    *,
    variables: Any = None,
    args: tuple = (),
    kwargs: dict | None = None,
    mp_policy: fs.MixedPrecisionPolicy | None = None,
    wrt: nnx.filterlib.Filter = nnx.Param,
    **options: Any,
) -> fs.Plan:
    """Works out what one training step of a marked Flax model holds and moves per device.

    `fs.plan` with the units read from the model itself: one unit per module marked by
    `fs.flax.fully_shard` (named by its module path, the model's own unit by its class
    name), each owning the parameters below it that no nested unit owns, and each with
    the `reshard_after_forward` it runs with: its own, or for None (FSDP2's default)
    False for a unit inside no other unit and True for the others. Parameters in no
    unit are replicated, as `fs.flax.shard` places them. Nothing is computed: the
    model's arrays are only read for their shapes.

    Args:
      model: an nnx model marked with `fs.flax.fully_shard`, or a linen model instance
        built from unit classes.
      mesh: the mesh the model will be sharded on (not needed for linen variables
        already sharded with `fs.shard`).
      variables: linen only: the model's variables (`model.init(...)`, or its
        'params' collection; abstract, full or already sharded).
      args: linen only: the positional arguments of one call of the model, as for
        `model.init` (arrays or `jax.ShapeDtypeStruct`s); the units are found by
        tracing this call abstractly.
      kwargs: linen only: its keyword arguments (e.g. `{"train": False}`).
      mp_policy: the policy of units marked without one, as for `fs.flax.shard`.
      wrt: nnx only: the filter of the variables the step differentiates (default
        `nnx.Param`; the other variables are not parameters and are not planned).
      **options: the step's options, as for `fs.plan`: `optimizer`, `microbatches`,
        `sync_every_microbatch`, `all_reduce_every_microbatch`, `trainable`.

    Returns:
      The `fs.Plan` of the step.

    Raises:
      TypeError: `model` is not an nnx or linen module, `mesh` is missing, or a linen
        model comes without `variables`.
      ValueError: no module of the model is marked, a mesh other than `mesh` is set
        with `jax.set_mesh`, or `fs.plan` rejects an option.
    """
    from funshard.flax import _plan

    return _plan.plan(
        model,
        mesh,
        variables=variables,
        args=args,
        kwargs=kwargs,
        wrt=wrt,
        mp_policy=mp_policy,
        options=options,
    )


__all__ = ["apply_updates", "fully_shard", "merge", "plan", "shard", "trainable"]
