"""`shard`, `unshard`, `reshard`: moving a pytree between full and sharded form."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.tree_util import tree_unflatten

from funshard import _text, comm, errors
from funshard.core import _context, _model, _options, _placement, _tree
from funshard.core._placement import Replicate
from funshard.core._policy import MixedPrecisionPolicy
from funshard.core._sharded import Sharded, is_array, is_key, is_sharded
from funshard.core._tree import common_mesh, sharded_leaves


def _bad_dtype(fn: str, path, dtype: Any) -> str:
    return (
        f"{_text.where(fn, path)} has dtype {dtype}; expected a numeric or bool array. "
        "Convert it with jnp.asarray(..., dtype=...) or keep it out of the params tree."
    )


def _x64_dtype(fn: str, path, dtype: Any) -> str:
    return (
        f"{_text.where(fn, path)} has dtype {dtype}, which JAX would silently narrow to 32 bits "
        "because jax_enable_x64 is off. Cast it first (e.g. .astype(np.float32)) or enable "
        "64-bit mode with jax.config.update('jax_enable_x64', True)."
    )


def dtype_problem(fn: str, path, x) -> str | None:
    """Why `x` (concrete, traced or abstract) cannot be a parameter, or None."""
    dtype = np.dtype(x.dtype)
    if not (dtype == np.bool_ or jnp.issubdtype(dtype, jnp.number)):
        return _bad_dtype(fn, path, dtype)
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        return _x64_dtype(fn, path, dtype)
    return None


def _check_numeric(fn: str, path, x) -> np.dtype:
    """The numpy dtype of `x`; TypeError if it is not numeric."""
    problem = dtype_problem(fn, path, x)
    if problem:
        raise errors.ShardingTypeError(problem)
    return np.dtype(x.dtype)


def _already_sharded(path) -> str:
    return (
        f"{_text.where('shard', path)} is already an fs.Sharded leaf; call fs.unshard(state) "
        "first to reshard onto another mesh."
    )


def _check_leaves(params: Any) -> None:
    """Every leaf `shard` cannot take, reported at once (as jax.shard_map reports specs)."""
    sharded, bad_dtypes = [], []
    for path, x in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_sharded)[0]:
        if isinstance(x, Sharded):
            sharded.append(_already_sharded(path))
        elif (is_array(x) or isinstance(x, jax.ShapeDtypeStruct)) and not is_key(x):
            problem = dtype_problem("shard", path, x)
            if problem:
                bad_dtypes.append(problem)
    if sharded:
        raise errors.ShardingValueError(_text.joined(sharded + bad_dtypes))
    if bad_dtypes:
        raise errors.ShardingTypeError(_text.joined(bad_dtypes))


def _pad(x, dim: int, size: int, exact_bits: bool = True):
    """`x` zero-padded at the end of `dim` to `size`.

    With `exact_bits`, floating arrays are padded as raw bits (not differentiable).
    """
    pad = size - x.shape[dim]
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[dim] = (0, pad)
    if isinstance(x, (np.ndarray, np.generic)):
        return np.pad(x, widths)
    if exact_bits and jnp.issubdtype(x.dtype, jnp.floating):
        # Padded as raw bits: XLA CPU computes 16-bit floats in f32, which would quiet a
        # signalling NaN's payload; the padding rows are zero bits either way.
        bits = jax.lax.bitcast_convert_type(x, comm.UINT[x.dtype.itemsize])
        return jax.lax.bitcast_convert_type(jnp.pad(bits, widths), x.dtype)
    return jnp.pad(x, widths)


def _strong(x):
    """`x` without JAX's weak type (e.g. `jnp.full(n, 0.1)` is weakly typed).

    `jnp.zeros_like` ignores the sharding of a weakly typed array, so `opt.init(state)`
    would put that leaf's optimizer state on one device, at full size.
    """
    if not getattr(x, "weak_type", False):
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x.astype(x.dtype)


def _is_traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _replicate(x, mesh: Mesh, traced: bool):
    """`x` (concrete, traced or abstract) replicated over every device of `mesh`."""
    sharding = NamedSharding(mesh, PartitionSpec())
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    if traced:
        # Under jit / eval_shape device_put would place a value the caller has not
        # computed yet; a constraint tells the partitioner where the output lives.
        return comm.constrain(x, sharding)
    return jax.device_put(x, sharding)


def _stacked_placement(path, x):
    # Each layer's dim 0 is the array's dim 1; a leaf with one value per layer stays whole.
    return _placement.Shard(1) if x.ndim >= 2 else _placement.Replicate()


def _dim_not_divisible(path, shape, dim: int, shards: int) -> str:
    return (
        f"{_text.where('shard', path)} has size {shape[dim]} on dim {dim}, which the "
        f"{shards} shards do not divide; only dim 0 is padded. Shard it on dim 0 or keep it "
        "replicated (fs.Replicate())."
    )


def _shard_leaf(path, x, mesh, axes: _model.LeafAxes, mp_policy, placement, min_size, traced):
    if isinstance(x, Sharded):
        raise errors.ShardingValueError(_already_sharded(path))
    if not (is_array(x) or isinstance(x, jax.ShapeDtypeStruct)):
        return x
    if is_key(x):
        # Typed PRNG keys (e.g. held by flax nnx Rngs) are not parameters: every
        # device draws from the same key, so they stay whole.
        return _replicate(x, mesh, traced)
    dtype = _check_numeric("shard", path, x)
    if axes.model_axes:
        # A model-split leaf is always FSDP-sharded: replicated, it would hold the whole
        # parameter on every device of its model axes' groups.
        min_size = 0
    where = _placement.resolve(path, x, placement, min_size) if x.ndim else Replicate()
    if isinstance(where, Replicate):
        if axes.model_axes:
            raise errors.ShardingValueError(_model.replicated_model_leaf(path, axes))
        return _replicate(_strong(x), mesh, traced)
    layout = comm.Layout(
        tuple(x.shape),
        dtype,
        mesh,
        axes.shard_axes,
        axes.replicate_axes,
        mp_policy,
        where.dim,
        axes.model_axes,
    )
    stacked = placement is _stacked_placement
    if where.dim and not stacked and layout.block_shape[where.dim] % layout.num_shards:
        raise errors.ShardingValueError(
            _dim_not_divisible(path, layout.block_shape, where.dim, layout.num_shards)
        )
    return Sharded.from_layout(layout, _place(x, layout, traced))


def _place(x, layout: comm.Layout, traced: bool) -> jax.Array | jax.ShapeDtypeStruct:
    """`x` padded and laid out as `layout.data`, each process slicing its own shards.

    Under a trace (`shard` under `jax.jit` / `jax.eval_shape`) the padded value gets a
    sharding constraint, so the compiled init computes only each device's block; an
    abstract `x` (`jax.ShapeDtypeStruct`) becomes the abstract `layout.data`.
    """
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(layout.padded_shape, layout.dtype, sharding=layout.sharding)
    if traced:
        # Host arrays too: placed eagerly they would be constants of the program,
        # which the compiler returns replicated.
        padded = comm.to_padded(_strong(jnp.asarray(x)), layout, _pad)
        return comm.constrain(padded, layout.sharding)
    if (
        isinstance(x, jax.Array)
        and x.is_fully_addressable
        and jax.process_count() == 1
        and not _in_host_memory(x)
    ):
        if layout.model_axes:
            # Padded per model block by one program that keeps the input's split.
            return _pad_to_layout(x, layout)
        return jax.device_put(comm.to_padded(_strong(x), layout, _pad), layout.sharding)
    # Host arrays (and any array in a multi-process job, where device_put would compare
    # the value across processes): every process holds the full value and copies out
    # only the blocks of its own devices.
    return _from_host(x, layout)


def _in_host_memory(x: jax.Array) -> bool:
    """Whether `x` lives on CPU devices, whose buffers numpy reads in place.

    Padded and sliced by numpy, such an array is placed without compiling anything;
    on the device, the padding and device_put's slicing compile a program per leaf
    shape and layout.
    """
    return all(getattr(d, "platform", None) == "cpu" for d in x.sharding.device_set)


def _from_host(x, layout: comm.Layout) -> jax.Array:
    """`x` padded and laid out as `layout.data` from a host copy, bit for bit."""
    # A copy: the placed blocks must not alias the caller's buffers (XLA CPU may keep
    # a numpy array's memory as the device buffer).
    padded = comm.to_padded(np.array(x, copy=True), layout, _pad)
    return jax.make_array_from_callback(padded.shape, layout.sharding, lambda idx: padded[idx])


def _stacked_and_placement() -> str:
    return "shard: pass either stacked=True or a placement, not both."


def _shard_in_step() -> str:
    return (
        "shard: called inside a funshard step (the loss function, or a unit, runs on each "
        "device under the step's jax.shard_map, where arrays are per-device blocks and "
        "cannot be placed on the mesh). Shard the parameters once, outside the step "
        "(state = fs.shard(params, mesh)), and pass the state to the step; inside it, "
        "fs.unshard gives full arrays and fs.reshard(full, like) this device's rows of them."
    )


def shard(
    params: Any,
    mesh: Mesh,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    shard_axis: str | tuple[str, ...] = comm.SHARD_AXIS,
    replicate_axis: str | tuple[str, ...] | None = None,
    placement: _placement.PlacementFn | None = None,
    min_shard_size: int = 0,
    stacked: bool = False,
    model_spec: Any = None,
) -> Any:
    """Shards every array leaf of `params` on dim 0 across the data-parallel devices.

    Args:
      params: a pytree of parameters (jax or numpy arrays, and any other leaves).
      mesh: the mesh to place the state on (see `make_mesh`).
      mp_policy: mixed-precision policy for this state's gathers and reductions.
      shard_axis: mesh axis (or axes) dim 0 is split over.
      replicate_axis: mesh axis (or axes) the shards are replicated over (HSDP).
        `None` means the mesh's "replicate" axis if it has one, else none.
      placement: optional `placement(path, array)` returning `fs.Shard(dim)`,
        `fs.Replicate()` or None (= `Shard(0)`) per leaf: FSDP2's
        `shard_placement_fn`, plus `ignored_params` as `Replicate()`.
      min_shard_size: leaves with fewer elements are replicated instead of sharded
        (their gradients are all-reduced).
      stacked: the leaves hold a stack of identical layers on a leading layer axis
        (for `funshard.scan`): each layer is sharded on its own dim 0 (the array's dim
        1, zero-padded per layer); leaves with one value per layer are replicated.
      model_spec: model parallelism (tensor, expert, ...) per leaf, in JAX's own
        vocabulary: a `jax.sharding.PartitionSpec` naming, per dim, the mesh axes that
        split it (e.g. `P(None, "tensor")` for a column-parallel kernel), as a pytree
        prefix of `params` (None: no model axes) or a function `(path, array)` returning
        one. Arrays that already carry a `NamedSharding` on the mesh's model axes keep
        it without being named here. Each leaf is FSDP-sharded over the data axes
        (`shard_axis`, `replicate_axis`) minus its own model axes, and a step gathers and
        reduces only its model block (see docs/parallelism.md).

    Returns:
      The same tree where each array with ndim >= 1 is a `Sharded` leaf holding
      `ceil(shape[0] / N)` rows per device (zero-padded), each 0-d array is replicated
      over the mesh, and other leaves (None, Python numbers, strings) are unchanged.

    Raises:
      ValueError: called inside a step (the loss function of `value_and_grad`); an
        axis is not in the mesh (or is both a shard and a replicate axis); a model axis
        is not in the mesh, does not divide its dim, is named twice, leaves a leaf no
        data axis, or would drop the sharding an array already has; a leaf is
        already `Sharded`, `stacked` is combined with `placement`, a
        placement names a dim the leaf does not have, or it names a dim other than 0
        whose size the shard count does not divide.
      TypeError: `mesh` is not a `jax.sharding.Mesh`, a leaf has a non-numeric dtype,
        `mp_policy` is not a policy, or `placement` returns something other than
        `Shard`, `Replicate` or None.
    """
    if _context.current() is not None:
        raise errors.ShardingValueError(_shard_in_step())
    shard_axes, replicate_axes = comm.resolve_axes("shard", mesh, shard_axis, replicate_axis)
    if stacked:
        if placement is not None:
            raise errors.ShardingValueError(_stacked_and_placement())
        placement = _stacked_placement
    _options.check_mp_policy("shard", mp_policy)
    _check_leaves(params)
    traced = any(_is_traced(x) for x in jax.tree.leaves(params))
    axes_of = _model.leaf_axes(params, mesh, shard_axes, replicate_axes, model_spec)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: _shard_leaf(
            p, x, mesh, axes_of(p, x), mp_policy, placement, min_shard_size, traced
        ),
        params,
        is_leaf=is_sharded,
    )


def _groups(items) -> dict[tuple, list[int]]:
    # Leaves split over different model axes vary over different axes inside a step: one
    # buffer would mix those types (and sum a replicated leaf's gradient over them).
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(items):
        if isinstance(x, Sharded):
            key = (x.shard_axis, x.replicate_axis, tuple(sorted(x.model_axis_names)))
            groups.setdefault(key, []).append(i)
    return groups


def unshard(tree: Any) -> Any:
    """Replaces every `Sharded` leaf of `tree` with its full logical array.

    Outside a step this all-gathers into replicated arrays equal to the original
    parameters (same shapes, dtypes and values). Inside `funshard.value_and_grad` it is
    the step's all-gather, in the policy's `param_dtype`, and its gradient is the
    reduce-scatter (in `reduce_dtype`). All leaves of one layout travel in ONE
    collective.

    Args:
      tree: a pytree with at least one `Sharded` leaf; other leaves pass through.

    Returns:
      The tree with full arrays in place of the `Sharded` leaves. A leaf stacked by
      `jax.vmap` (the gradients of `jax.vmap(step, in_axes=(None, 0))`) gives the stack
      of full arrays, `(batches, *shape)`, as `jax.vmap(jax.grad(...))` would.

    Raises:
      ValueError: the tree has no `Sharded` leaves, has leaves from different meshes,
        or (inside a step) lives on a mesh other than the step's.
    """
    return unshard_as(tree, "unshard")


def _other_mesh_in_step(fn: str, path, mesh, step_mesh) -> str:
    return (
        f"{_text.where(fn, path)} lives on mesh {mesh}, but the running step is on mesh "
        f"{step_mesh}; shard it with the step's mesh or pass it as part of the state."
    )


def unshard_as(tree: Any, name: str, collectives: tuple = (None, None)) -> Any:
    """`unshard`, with its collectives labelled `funshard/<name>/...` inside a step.

    `collectives` is a unit's own `(all_gather, reduce_scatter)` (None: the default);
    outside a step its all-gather gathers too, so a unit evaluates as it trains.
    """
    paths, items, treedef = sharded_leaves(tree)
    mesh = common_mesh("unshard", paths, items)
    if mesh is None:
        raise errors.ShardingValueError(_text.no_sharded("unshard"))
    ctx = _context.current()
    if ctx is not None and mesh != ctx.mesh:
        path = next(p for p, x in zip(paths, items, strict=True) if isinstance(x, Sharded))
        raise errors.ShardingValueError(_other_mesh_in_step("unshard", path, mesh, ctx.mesh))
    # A state node that holds no array (the optax.MaskedNode a masked transform keeps for
    # a parameter it skips, as muon does for vectors) has nothing to gather: it becomes
    # what it holds, as in plain optax's state.
    items = [x.data if isinstance(x, Sharded) and not jax.tree.leaves(x.data) else x for x in items]
    gathered: dict[int, Any] = {}
    for (shard_axes, _, model_axes), idx in _groups(items).items():
        leaves = [items[i] for i in idx]
        if ctx is not None:
            fulls = _context.unshard_in_step(leaves, name, collectives)
        else:
            _same_on_every_process(name, mesh, leaves)
            stacked = [_stacked_dims(paths[i], x) for i, x in zip(idx, leaves, strict=True)]
            specs = None
            if model_axes:
                specs = [
                    (_stacked_spec(k, x.spec), _stacked_spec(k, x.model_spec))
                    for k, x in zip(stacked, leaves, strict=True)
                ]
            fulls = comm.eager_all_gather(
                [x.data for x in leaves],
                mesh,
                shard_axes,
                [x.block_shape[x.dim] for x in leaves],
                [k + x.dim for k, x in zip(stacked, leaves, strict=True)],
                specs,
                custom=collectives[0],
                unit=name,
            )
        gathered.update(zip(idx, fulls, strict=True))
    parts = _tree.Partition(tuple(items), treedef, tuple(sorted(gathered)))
    return parts.combine([gathered[i] for i in parts.positions])


def _stacked_spec(lead: int, spec: PartitionSpec) -> PartitionSpec:
    """`spec` with `lead` unsplit leading axes (a `jax.vmap` stack) in front."""
    return PartitionSpec(*([None] * lead), *spec)


def _stacked_dims(path, leaf: Sharded) -> int:
    """How many leading axes `jax.vmap` stacked onto `leaf.data` (0 for a plain leaf).

    A step mapped with `jax.vmap(step, in_axes=(None, 0))` returns gradients whose
    `data` carries one padded block per batch on new leading axes; their logical
    `shape` (static metadata) is that of one batch.
    """
    extra = leaf.data.ndim - len(leaf.padded_shape)
    if extra < 0 or tuple(leaf.data.shape[extra:]) != leaf.padded_shape:
        raise errors.ShardingValueError(_data_does_not_fit(path, leaf))
    return extra


def _data_does_not_fit(path, leaf: Sharded) -> str:
    return (
        f"{_text.where('unshard', path)} holds data of shape {tuple(leaf.data.shape)}, which "
        f"is not its padded layout {leaf.padded_shape} (logical shape {leaf.shape}), nor a "
        "stack of it from jax.vmap. Build Sharded leaves with fs.shard or fs.reshard, and "
        "change `data` only through functions that keep its shape (jax.tree.map, optax)."
    )


def _same_on_every_process(fn: str, mesh, leaves: list[Sharded]) -> None:
    """Checks that every process of a multi-process mesh issues this eager all-gather.

    Inside a user's `jax.jit` (traced leaves) the gather is part of a compiled program,
    which every process runs whole: nothing to check.
    """
    if any(isinstance(x.data, jax.core.Tracer) for x in leaves):
        return
    processes = {d.process_index for d in mesh.devices.flat}
    # A leaf stacked by jax.vmap gathers its stack: its leading axes count too.
    shapes = [(*x.data.shape[: x.data.ndim - x.ndim], *x.shape) for x in leaves]
    comm.same_collective(
        fn,
        [(shape, x.dim, x.data.dtype) for shape, x in zip(shapes, leaves, strict=True)],
        processes,
    )


def _shape_mismatch(fn: str, path, shape, expected) -> str:
    return (
        f"{_text.where(fn, path)} has shape {tuple(shape)} but `like` expects "
        f"{tuple(expected)}; pass the full (unsharded) array of that leaf."
    )


def _dtype_mismatch(fn: str, path, dtype, expected) -> str:
    return (
        f"{_text.where(fn, path)} has dtype {dtype} but `like` expects {expected}; cast it with "
        f".astype({expected}) first."
    )


def _reshard_not_array(path, full, shape) -> str:
    return (
        f"{_text.where('reshard', path)} is {type(full).__name__}; expected the full array of "
        f"shape {shape}. Pass the full (unsharded) array of that leaf."
    )


def _full_problem(path, full, like: Sharded, in_step: bool) -> tuple[type, str] | None:
    """(exception type, message) if `full` cannot be resharded like `like`, else None."""
    # Inside a step a model-split leaf's full value is its model block.
    shape = like.block_shape if in_step else like.shape
    if not is_array(full):
        return errors.ShardingTypeError, _reshard_not_array(path, full, shape)
    if tuple(full.shape) != shape:
        return errors.ShardingValueError, _shape_mismatch("reshard", path, full.shape, shape)
    if np.dtype(full.dtype) != like.dtype:
        return errors.ShardingValueError, _dtype_mismatch("reshard", path, full.dtype, like.dtype)
    return None


def _local_rows(full, like: Sharded):
    # Differentiable: the step's gradient flows through an in-step reshard. `full` is
    # this device's model block (what `unshard` gives inside a step).
    padded = _pad(full, like.dim, like.rows_per_shard * like.num_shards, exact_bits=False)
    start = jax.lax.axis_index(like.shard_axis) * like.rows_per_shard
    return jax.lax.dynamic_slice_in_dim(padded, start, like.rows_per_shard, axis=like.dim)


def reshard_leaf(full, like: Sharded, in_step: bool) -> Sharded:
    """`full` laid out exactly like `like` (a local slice: no communication)."""
    if in_step:
        data = _local_rows(full, like)
    elif not like.size:
        # jit's out_shardings gives every device the whole (empty) global block of a
        # size-0 array; device_put lays it out right.
        data = jax.device_put(np.zeros(like.padded_shape, like.dtype), like.sharding)
    elif _concrete_in_host_memory(full):
        data = _from_host(full, like.layout)
    else:
        data = _pad_to_layout(full, like)
    return dataclasses.replace(like, data=data)


def _concrete_in_host_memory(x) -> bool:
    if isinstance(x, (np.ndarray, np.generic)):
        return True
    return (
        isinstance(x, jax.Array)
        and not _is_traced(x)
        and x.is_fully_addressable
        and _in_host_memory(x)
    )


def _pad_to_layout(full, like: comm.Layout | Sharded) -> jax.Array:
    """`full` padded and laid out as `like.data`, bit for bit.

    Floating values enter the program as raw bits: the SPMD partitioner pads the
    replicated input in its own dtype, and XLA CPU computes 16-bit floats in f32, which
    would quiet a signalling NaN's payload.
    """
    dtype = np.dtype(like.dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        full = jax.lax.bitcast_convert_type(full, comm.UINT[dtype.itemsize])
    layout = like.layout if isinstance(like, Sharded) else like
    fn = jax.jit(_pad_as, static_argnums=(1, 2), out_shardings=like.sharding)
    return fn(full, layout, dtype)


def _pad_as(x, layout: comm.Layout, dtype: np.dtype):
    """`x` (raw bits for floating `dtype`) padded as `layout`, as `dtype`."""
    x = comm.to_padded(x, layout, _pad)
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def _structure_mismatch(fn: str, what: str, got, expected) -> str:
    return (
        f"{fn}: the {what} tree does not match the structure of `like`.\n  got:      "
        f"{got}\n  expected: {expected}\nPass a tree with exactly the structure of the "
        "state (e.g. the output of fs.unshard(state))."
    )


def reshard(full_tree: Any, like: Any) -> Any:
    """Shards `full_tree` exactly like `like`: the inverse of `unshard` (no communication).

    Each device keeps its own rows of the full arrays (a local slice). Inside a step
    this gives the local blocks of the running step.

    Args:
      full_tree: full arrays with the structure of `like` (e.g. `unshard(like)`).
      like: a sharded state, whose layout (mesh, axes, padding, policy) is copied.

    Returns:
      A tree of the same structure and sharding as `like`.

    Raises:
      ValueError: the structures differ, or a leaf's shape or dtype does not match.
      TypeError: a leaf that should be an array is not.
    """
    paths, items, treedef = sharded_leaves(like)
    try:
        fulls = treedef.flatten_up_to(full_tree)
    except (ValueError, TypeError) as exc:
        got = jax.tree_util.tree_structure(full_tree, is_leaf=is_sharded)
        raise errors.ShardingValueError(
            _structure_mismatch("reshard", "full", got, treedef)
        ) from exc
    in_step = _context.current() is not None
    problems = [
        found
        for path, full, item in zip(paths, fulls, items, strict=True)
        if isinstance(item, Sharded) and (found := _full_problem(path, full, item, in_step))
    ]
    if problems:  # every bad leaf at once, as jax.shard_map reports its specs
        only_types = all(k is errors.ShardingTypeError for k, _ in problems)
        kind = errors.ShardingTypeError if only_types else errors.ShardingValueError
        raise kind(_text.joined([message for _, message in problems]))
    out = [
        reshard_leaf(full, item, in_step) if isinstance(item, Sharded) else full
        for full, item in zip(fulls, items, strict=True)
    ]
    return tree_unflatten(treedef, out)
