"""`plan`: what a training step will hold and move per device, worked out before it runs.

The figures come from the same layout code the step runs (`Sharded` layouts, the units'
one-buffer packing, the reduce dtypes), applied to abstract values: nothing is compiled
and nothing is allocated. `docs/planning.md` explains each figure and how it matches the
compiled program.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from funshard import _text, comm, core, errors
from funshard.core import (
    MixedPrecisionPolicy,
    RootOptions,
    Sharded,
    dtype_problem,
    is_array,
    is_key,
    is_sharded,
    shard,
)
from funshard.planning import _units
from funshard.planning._render import render_rich, render_text


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Bytes of one kind of state: on each device, and as one unsharded copy.

    Attributes:
      per_device: bytes each device holds (sharded leaves: its padded block; replicated
        leaves: the whole array).
      replicated: bytes of the same state unsharded on one device (no padding).
    """

    per_device: int
    replicated: int


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective the step issues, with how often it runs.

    Attributes:
      kind: "all-gather", "reduce-scatter" or "all-reduce".
      unit: the unit it belongs to, "root" (the parameters in no unit), "step" (the
        deferred or postponed reductions after the microbatch loop) or "loss".
      role: "forward", "backward" (the re-gather of `reshard_after_forward`),
        "gradients" (reduce-scatter), "replicas" (HSDP all-reduce over the replicate
        axes), "replicated leaves" (gradients of leaves kept whole) or "loss".
      dtype: the element type(s) of the values it carries ("+"-joined when mixed).
      group: devices in each collective group.
      bytes: one execution's buffer: the gathered output of an all-gather, the full
        input of a reduce-scatter, the buffer of an all-reduce (as XLA's HLO types them);
        for a unit's own collective (`fs.AllGather`, `fs.ReduceScatter`) with a
        `bytes_per_element`, the buffer's elements times that, as the user declares.
      times: executions per step.
      axes: the mesh axes it runs over, where known (the shard axes of a gather or
        reduce-scatter, the replicate axes of an HSDP all-reduce); a model-split leaf's
        run over its own data axes only.
    """

    kind: str
    unit: str
    role: str
    dtype: str
    group: int
    bytes: int
    times: int
    axes: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        """`bytes` times `times`: the buffer bytes of this collective per step."""
        return self.bytes * self.times

    @property
    def sent_bytes(self) -> float:
        """Bytes one device sends per step in a ring implementation.

        (G-1)/G of the buffer for all-gather and reduce-scatter, 2(G-1)/G for all-reduce.
        """
        g = self.group
        factor = 2 * (g - 1) / g if self.kind == "all-reduce" else (g - 1) / g
        return factor * self.total_bytes


@dataclasses.dataclass(frozen=True)
class UnitPlan:
    """One unit's parameters and its collectives' buffers.

    Attributes:
      name: the unit's name ("root" for the parameters in no unit).
      leaves: key paths (`jax.tree_util.keystr`) of its leaves.
      reshard_after_forward: as passed to `fs.fully_shard` (the root: False).
      param_bytes: bytes of its parameters on each device.
      replicated_bytes: bytes of its parameters unsharded.
      gathered_bytes: the buffer of its one all-gather (all devices' blocks in
        `param_dtype`, padding included); 0 when it has no sharded leaf.
      reduce_scatter_bytes: the input of its reduce-scatter(s) per microbatch (padded,
        in `reduce_dtype`); 0 when nothing in it is trained.
      layers: for a stack of layers run by `fs.scan` / `fs.lax_scan` (its sharded leaves
        `stacked=True`), the number of layers, and then `gathered_bytes` and
        `reduce_scatter_bytes` are those of ONE layer (the loop gathers and reduces
        each layer in turn); None for a unit called once.
    """

    name: str
    leaves: tuple[str, ...]
    reshard_after_forward: bool | int
    param_bytes: int
    replicated_bytes: int
    gathered_bytes: int
    reduce_scatter_bytes: int
    layers: int | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one training step holds and moves per device (see `funshard.plan`).

    Printing it (`print(plan)`) gives a table; with `rich` installed,
    `rich.print(plan)` gives the same tables in colour.

    Attributes:
      mesh_shape: the mesh's axes and sizes, in mesh order.
      num_shards: devices each parameter is split over.
      num_replicas: copies of each shard (HSDP; 1 for plain FSDP).
      microbatches: microbatches per step.
      params: parameter bytes.
      grads: gradient bytes (the gradients `fs.value_and_grad` returns: shaped and
        sharded like the parameters, in their dtype).
      optimizer: optimizer-state bytes, or None without `optimizer`.
      accumulators: with `sync_every_microbatch=False`, the full-size unreduced
        gradients (in `reduce_dtype`) each device accumulates; else None.
      units: each unit in the order given, then the root if it holds parameters.
      collectives: every collective of one step.
    """

    mesh_shape: tuple[tuple[str, int], ...]
    num_shards: int
    num_replicas: int
    microbatches: int
    params: Footprint
    grads: Footprint
    optimizer: Footprint | None
    accumulators: Footprint | None
    units: tuple[UnitPlan, ...]
    collectives: tuple[Collective, ...]

    def _select(self, kind: str | None, unit: str | None) -> list[Collective]:
        return [
            c
            for c in self.collectives
            if (kind is None or c.kind == kind) and (unit is None or c.unit == unit)
        ]

    def count(self, kind: str | None = None, unit: str | None = None) -> int:
        """Collective executions per step (of one `kind`, of one `unit`, or all)."""
        return sum(c.times for c in self._select(kind, unit))

    def bytes(self, kind: str | None = None, unit: str | None = None) -> int:
        """Collective buffer bytes per step (see `Collective.bytes`)."""
        return sum(c.total_bytes for c in self._select(kind, unit))

    def sent_bytes(self, kind: str | None = None, unit: str | None = None) -> float:
        """Bytes each device sends per step in a ring implementation."""
        return sum(c.sent_bytes for c in self._select(kind, unit))

    def unit(self, name: str) -> UnitPlan:
        """The plan of the unit called `name` (KeyError if there is none)."""
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(name)

    def __str__(self) -> str:
        return render_text(self)

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        # IPython / Jupyter show the tables, not the dataclass's field-by-field repr.
        printer.text(str(self))

    def __rich__(self):
        return render_rich(self)


# ---- the state's layout -----------------------------------------------------------------


def _abstract_array(x):
    """`x` (a concrete or abstract array) as a shape/dtype struct, nothing allocated."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=getattr(x, "weak_type", False))


def _check_plain(params) -> None:
    problems = [
        problem
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
        if (is_array(x) or isinstance(x, jax.ShapeDtypeStruct))
        and not is_key(x)
        and (problem := dtype_problem("plan", path, x))
    ]
    if problems:
        raise errors.ShardingTypeError(_text.joined(problems))


def _laid_out(params, mesh, mp_policy, shard_options: dict) -> tuple[Any, Mesh]:
    """The sharded state `params` is or would become (abstract when planned here)."""
    paths, items, _ = core.sharded_leaves(params)
    state_mesh = core.common_mesh("plan", paths, items)
    if state_mesh is not None:
        given = {"mp_policy": mp_policy, **shard_options}
        for name, value in given.items():
            if value is not None:
                raise errors.ShardingValueError(_option_on_sharded(name))
        if mesh is not None and mesh != state_mesh:
            raise errors.ShardingValueError(_other_mesh(state_mesh, mesh))
        return params, state_mesh
    if mesh is None:
        raise errors.ShardingTypeError(_no_mesh())
    options = {k: v for k, v in shard_options.items() if v is not None}
    comm.resolve_axes(
        "plan", mesh, options.get("shard_axis", comm.SHARD_AXIS), options.get("replicate_axis")
    )
    core.check_mp_policy("plan", mp_policy)
    _check_plain(params)
    abstract = jax.tree.map(lambda x: _abstract_array(x) if is_array(x) else x, params)
    return shard(abstract, mesh, mp_policy=mp_policy, **options), mesh


def _no_mesh() -> str:
    return (
        "plan: params are not sharded, so the mesh to shard them on is needed; pass it "
        "as fs.plan(params, mesh, ...) (e.g. mesh = fs.make_mesh())."
    )


def _other_mesh(state_mesh, mesh) -> str:
    return (
        f"plan: the state is sharded on mesh {state_mesh} but mesh={mesh} was passed; "
        "leave mesh out to plan the state as it is, or pass the unsharded params to plan "
        "another mesh."
    )


def _option_on_sharded(name: str) -> str:
    return (
        f"plan: the state is already sharded, so its {name} is read from its fs.Sharded "
        f"leaves; drop {name}=..., or pass the unsharded params (arrays or "
        "jax.ShapeDtypeStruct) to plan another layout."
    )


def _itemsize(dtype) -> int:
    # Typed PRNG key dtypes are not numpy dtypes, but know their size in bytes.
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return dtype.itemsize
    return np.dtype(dtype).itemsize


def _device_bytes(x) -> int:
    """Bytes one device holds of a state leaf (0 for non-array leaves)."""
    if isinstance(x, Sharded):
        return math.prod(x.local_shape) * _itemsize(x.dtype)
    if not (is_array(x) or isinstance(x, jax.ShapeDtypeStruct)):
        return 0
    sharding = getattr(x, "sharding", None)
    shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
    return math.prod(shape) * _itemsize(x.dtype)


def _full_bytes(x) -> int:
    """Bytes of a state leaf unsharded (0 for non-array leaves)."""
    if isinstance(x, Sharded) or is_array(x) or isinstance(x, jax.ShapeDtypeStruct):
        return math.prod(x.shape) * _itemsize(x.dtype)
    return 0


def _footprint(tree) -> Footprint:
    leaves = jax.tree.leaves(tree, is_leaf=is_sharded)
    return Footprint(sum(map(_device_bytes, leaves)), sum(map(_full_bytes, leaves)))


def _optimizer_footprint(optimizer, state, mesh) -> Footprint | None:
    if optimizer is None:
        return None
    if not callable(getattr(optimizer, "init", None)):
        raise errors.ShardingTypeError(_not_optimizer(optimizer))

    def abstract(x):
        if isinstance(x, Sharded):
            data = jax.ShapeDtypeStruct(x.padded_shape, x.dtype, sharding=x.sharding)
            return dataclasses.replace(x, data=data)
        if is_array(x) or isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=core.sharding_on(mesh, x))
        return x

    def unsharded(x):
        if isinstance(x, Sharded) or is_array(x) or isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        return x

    sharded_state = core.init_optimizer(
        optimizer, jax.tree.map(abstract, state, is_leaf=is_sharded)
    )
    full_state = jax.eval_shape(optimizer.init, jax.tree.map(unsharded, state, is_leaf=is_sharded))
    return Footprint(_footprint(sharded_state).per_device, _footprint(full_state).replicated)


def _not_optimizer(optimizer) -> str:
    return (
        f"plan: optimizer must be an optax GradientTransformation (with an init "
        f"method), got {type(optimizer).__name__}; pass e.g. optax.adamw(1e-3)."
    )


# ---- collectives ------------------------------------------------------------------------


def _dtype_name(dtypes) -> str:
    return "+".join(sorted({np.dtype(d).name for d in dtypes}))


def _gathered_bytes(leaves: tuple[comm.LeafLayout, ...], n: int) -> int:
    """The all-gather output of a unit, exactly as `_lowering` packs it."""
    if not leaves:
        return 0
    elements, itemsize = _gather_buffer(leaves)
    return n * elements * itemsize


def _gather_buffer(leaves: tuple[comm.LeafLayout, ...]) -> tuple[int, int]:
    """(elements, bytes per element) of one device's packed gather buffer, as `_lowering`
    packs it (and as a custom all-gather sees it)."""
    structs = [jax.ShapeDtypeStruct(leaf.local_shape, leaf.gather_dtype) for leaf in leaves]
    packing = comm.packing_of(structs, [leaf.dim for leaf in leaves])
    word = np.dtype(packing.carrier).itemsize if packing.carrier is not None else packing.width
    return packing.total, word


def _declared(custom, buffer_bytes: int, itemsize: int) -> int:
    """A buffer's bytes as a unit's own collective declares them (else the buffer's)."""
    if custom is None or custom.bytes_per_element is None:
        return buffer_bytes
    return math.ceil(buffer_bytes // itemsize * custom.bytes_per_element)


def _reduced_by_dtype(leaves, n: int) -> dict[np.dtype, int]:
    """Reduce-scatter input bytes per reduce dtype (one collective per dtype)."""
    out: dict[np.dtype, int] = {}
    for leaf in leaves:
        if leaf.reduced:
            size = n * math.prod(leaf.local_shape) * leaf.reduce_dtype.itemsize
            out[leaf.reduce_dtype] = out.get(leaf.reduce_dtype, 0) + size
    return out


def _unit_collectives(unit, layout, opts: RootOptions, dims) -> list[Collective]:
    """The collectives of one unit (or the root) inside the microbatch loop.

    A scanned stack's collectives are one layer's, run once per layer: `k` counts
    layers times microbatches.
    """
    if layout and layout.subgroups:
        # Leaves on different axes (model-split beside others): one set of collectives
        # per set of axes, each over its own data axes.
        return [
            dataclasses.replace(c, axes=c.axes or sub.shard_axes)
            for _, sub in layout.subgroups
            for c in _unit_collectives(
                unit, sub, opts, (sub.num_shards, dims[1] if sub.replicate_axes else 1)
            )
        ]
    n, replicas = dims
    if layout:  # a unit of model-split leaves only runs over its own data axes
        n, replicas = layout.num_shards, replicas if layout.replicate_axes else 1
    k = opts.microbatches * (unit.layers or 1)
    if layout and unit.layers:
        layout = layout.layer()
    shards = layout.shard_axes if layout else ()
    out = []
    elements, word = _gather_buffer(layout.leaves) if layout and layout.leaves else (0, 0)
    gathered = n * elements * word
    if gathered:
        gather_dtype = _dtype_name(leaf.gather_dtype for leaf in layout.leaves)
        sent = _declared(layout.all_gather, gathered, word)
        sent_dtype = comm.wire_label(layout.all_gather, gather_dtype)
        keep = unit.reshard_after_forward
        # A gather tied to the unit's input runs in every microbatch; an untied one (the
        # root's unshard, a unit that keeps its parameters) is loop-invariant, and XLA
        # hoists it out of the microbatch loop: it runs once per step. A scan ties each
        # layer's gather to that layer's input, whether it keeps the layers or not.
        tied = keep is not False or unit.layers is not None
        times = k if tied else 1
        out.append(
            Collective("all-gather", unit.name, "forward", sent_dtype, n, sent, times, shards)
        )
        if keep is not False:
            group = n if keep is True else keep
            # hpZ's re-gather runs within the trailing shard axes that span its groups.
            axes = shards if keep is True else ()
            out.append(
                Collective("all-gather", unit.name, "backward", sent_dtype, group, sent, k, axes)
            )
    if layout and opts.sync_every_microbatch:
        custom = layout.reduce_scatter
        for dtype, size in _reduced_by_dtype(layout.leaves, n).items():
            sent = _declared(custom, size, dtype.itemsize)
            label = comm.wire_label(custom, dtype.name)
            out.append(
                Collective("reduce-scatter", unit.name, "gradients", label, n, sent, k, shards)
            )
            if replicas > 1 and opts.all_reduce_every_microbatch:
                out.append(
                    Collective(
                        "all-reduce",
                        unit.name,
                        "replicas",
                        dtype.name,
                        replicas,
                        size // n,
                        k,
                        layout.replicate_axes,
                    )
                )
    return out


def _step_collectives(layouts, opts: RootOptions, dims) -> list[Collective]:
    """The reductions after the microbatch loop: deferred reduce-scatters (no sync per
    microbatch) and postponed HSDP all-reduces (no all-reduce per microbatch)."""
    n, replicas = dims
    leaves = [leaf for layout in layouts if layout for leaf in layout.leaves]
    out = []
    if not opts.sync_every_microbatch:
        for dtype, size in _reduced_by_dtype(leaves, n).items():
            out.append(Collective("reduce-scatter", "step", "gradients", dtype.name, n, size, 1))
            if replicas > 1 and opts.all_reduce_every_microbatch:
                out.append(
                    Collective("all-reduce", "step", "replicas", dtype.name, replicas, size // n, 1)
                )
    if replicas > 1 and not opts.all_reduce_every_microbatch:
        # Postponed gradients are back in the sharded parameters' own dtype.
        by_dtype: dict[np.dtype, int] = {}
        for leaf in leaves:
            if leaf.reduced:
                size = math.prod(leaf.local_shape) * leaf.dtype.itemsize
                by_dtype[leaf.dtype] = by_dtype.get(leaf.dtype, 0) + size
        for dtype, size in by_dtype.items():
            out.append(Collective("all-reduce", "step", "replicas", dtype.name, replicas, size, 1))
    return out


def _replicated_collectives(groups, opts: RootOptions, world: int) -> list[Collective]:
    """All-reduces of the trained leaves kept whole: autodiff sums their gradients over
    every device, in the dtype the unit computes with (a policy's `param_dtype`). A
    scanned stack's (one value per layer) are all-reduced a layer at a time."""
    out = []
    for group in groups:
        by_dtype: dict[np.dtype, int] = {}
        for x, route in group.replicated:
            if route.wanted:
                dtype = core.param_dtype_for(group.policy, np.dtype(x.dtype))
                shape = x.shape[1:] if group.layers else x.shape
                by_dtype[dtype] = by_dtype.get(dtype, 0) + math.prod(shape) * dtype.itemsize
        out += [
            Collective(
                "all-reduce",
                group.name,
                "replicated leaves",
                dtype.name,
                world,
                size,
                opts.microbatches * (group.layers or 1),
            )
            for dtype, size in by_dtype.items()
        ]
    return out


def _accumulators(groups, opts: RootOptions) -> Footprint | None:
    if opts.sync_every_microbatch:
        return None
    size = sum(
        math.prod(leaf.shape) * leaf.reduce_dtype.itemsize
        for group in groups
        if group.layout
        for leaf in group.layout.leaves
        if leaf.reduced
    )
    return Footprint(size, size)


def _resharding(name: str, value: bool | int, n: int) -> bool | int:
    """`reshard_after_forward` with FSDP2's int forms normalised: 1 is False, n is True."""
    core.check_reshard_after_forward(f"plan: unit {name!r}", value, n)
    if isinstance(value, bool):
        return value
    return True if value == n else (False if value == 1 else value)


def _unit_plan(group: _units.LeafGroup, n: int, opts: RootOptions) -> UnitPlan:
    layout = group.layout
    if layout and group.layers:
        _check_scannable(group, opts)
        layout = layout.layer()
    # Model-split leaves beside others: each set of axes is its own collective.
    parts = [(sub, sub.num_shards) for _, sub in layout.subgroups] if layout else []
    if layout and not parts:
        parts = [(layout, layout.num_shards)]
    footprint = _footprint(list(group.sharded) + [x for x, _ in group.replicated])
    return UnitPlan(
        name=group.name,
        leaves=tuple(jax.tree_util.keystr(tuple(p)) for p in group.paths),
        reshard_after_forward=_resharding(group.name, group.reshard_after_forward, n),
        param_bytes=footprint.per_device,
        replicated_bytes=footprint.replicated,
        gathered_bytes=sum(_gathered_bytes(sub.leaves, m) for sub, m in parts),
        reduce_scatter_bytes=sum(
            sum(_reduced_by_dtype(sub.leaves, m).values()) for sub, m in parts
        ),
        layers=group.layers,
    )


def _check_scannable(group: _units.LeafGroup, opts: RootOptions) -> None:
    """What `fs.scan` / `fs.lax_scan` refuse, refused for the stack they would run."""
    value = group.reshard_after_forward
    if not isinstance(value, bool):
        raise errors.UnsupportedError(_scan_option(group.name, f"reshard_after_forward={value}"))
    if not opts.sync_every_microbatch:
        raise errors.UnsupportedError(_scan_option(group.name, "sync_every_microbatch=False"))


def _scan_option(name: str, option: str) -> str:
    return (
        f"plan: unit {name!r} is a stack of layers (stacked=True), run by fs.scan / "
        f"fs.lax_scan, which do not support {option} yet; plan (and run) it with "
        "reshard_after_forward True or False and sync_every_microbatch=True."
    )


# ---- the public function ----------------------------------------------------------------


def plan(
    params: Any,
    mesh: Mesh | None = None,
    *,
    units: Mapping[str, Any] | Any = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    optimizer: Any = None,
    reshard_after_forward: bool | int | Mapping[str, bool | int] = True,
    microbatches: int = 1,
    sync_every_microbatch: bool = True,
    all_reduce_every_microbatch: bool = True,
    trainable: Any = None,
    shard_axis: str | tuple[str, ...] | None = None,
    replicate_axis: str | tuple[str, ...] | None = None,
    placement: Any = None,
    min_shard_size: int | None = None,
    model_spec: Any = None,
    all_gather: comm.AllGather | Mapping[str, comm.AllGather] | None = None,
    reduce_scatter: comm.ReduceScatter | Mapping[str, comm.ReduceScatter] | None = None,
) -> Plan:
    """Works out what one training step will hold and move per device, without running it.

    Describes the step `fs.value_and_grad(loss_fn, microbatches=...)` compiles when
    `loss_fn` calls one `fs.fully_shard` unit per entry of `units` on that part of the
    state, and gathers everything else (the root) with one `fs.unshard`. Nothing is
    compiled and nothing is allocated: the figures follow from the layouts alone (the
    optimizer state from `jax.eval_shape`).

    Args:
      params: the parameters (arrays or `jax.ShapeDtypeStruct`s), or a state already
        sharded by `fs.shard` (concrete or abstract), whose layout is then used as is.
      mesh: the mesh to shard on; for a sharded state, None (or the state's mesh).
      units: the `fs.fully_shard` units, as a mapping from a unit's name to the part of
        `params` it is called on: a key-path prefix given as a tuple of keys
        (`("layers", 0)`), a dotted string (`"layers.0"`), a `keystr` string
        (`"['layers'][0]"`), or a list of such prefixes for a unit holding several
        subtrees (FSDP2's `fully_shard([emb, head])`); `""` is the whole tree. Prefixes
        may nest: a leaf belongs to the unit with the longest prefix above it (FSDP2's
        rule, and `fs.flax.fully_shard`'s). A plain list of prefixes names each unit
        after its prefix. Leaves in no unit belong to the root. A unit whose sharded
        leaves are stacked (`fs.shard(..., stacked=True)`) is a stack of layers, planned
        as `fs.scan` / `fs.lax_scan` run it: one layer's collectives, once per layer.
      mp_policy: the policy `fs.shard` would attach (not for a sharded state).
      optimizer: an optax `GradientTransformation`, to count its state.
      reshard_after_forward: as in `fs.fully_shard`, for every unit, or a mapping from
        unit name to its value (units not named: True).
      microbatches: as in `fs.value_and_grad`.
      sync_every_microbatch: as in `fs.value_and_grad`.
      all_reduce_every_microbatch: as in `fs.value_and_grad`.
      trainable: as in `fs.value_and_grad` (frozen leaves get no gradient collectives).
      shard_axis: as in `fs.shard` (not for a sharded state).
      replicate_axis: as in `fs.shard` (not for a sharded state).
      placement: as in `fs.shard` (not for a sharded state).
      min_shard_size: as in `fs.shard` (not for a sharded state).
      model_spec: as in `fs.shard`: the model axes (tensor, expert) splitting each leaf
        (not for a sharded state, which carries them).
      all_gather: the units' own all-gather (`fs.AllGather`, as given to
        `fs.fully_shard`), for every unit or as a mapping from unit name to one (units
        not named: the default). Its collectives show its `label` and the bytes its
        `bytes_per_element` declares.
      reduce_scatter: the units' own reduce-scatter (`fs.ReduceScatter`), likewise.

    Returns:
      A `Plan`: per-device bytes of parameters, gradients and optimizer state next to
      an unsharded copy, each unit's gathered bytes, and every collective of one step
      with its bytes and how often it runs. `print(plan)` shows it as tables.

    Raises:
      TypeError: `mesh` is missing for unsharded params, a leaf has a dtype that cannot
        be sharded, a unit is given by something that is not a key-path prefix, or
        `optimizer` has no `init`.
      ValueError: a unit's prefix matches no leaf, two units give the same prefix, a
        unit holds no shardable parameter, an option does not fit (e.g. `mp_policy` for
        a state that is already sharded), `trainable` does not fit `params`, stacked
        leaves are in no unit, or a unit mixes them with other sharded leaves.
      NotImplementedError: a stack of layers with an int `reshard_after_forward` or
        `sync_every_microbatch=False`, which `fs.scan` does not support yet; a custom
        all-gather with an int `reshard_after_forward`, or a custom reduce-scatter with
        `sync_every_microbatch=False`, which units do not support yet.
    """
    opts = core.root_options(
        "plan",
        microbatches=microbatches,
        sync_every_microbatch=sync_every_microbatch,
        all_reduce_every_microbatch=all_reduce_every_microbatch,
    )
    shard_options = dict(
        shard_axis=shard_axis,
        replicate_axis=replicate_axis,
        placement=placement,
        min_shard_size=min_shard_size,
        model_spec=model_spec,
    )
    state, mesh = _laid_out(params, mesh, mp_policy, shard_options)
    specs = _units.unit_specs(units)
    rf = _units.reshard_by_unit(reshard_after_forward, [name for name, _ in specs])
    groups = _units.group_leaves(state, specs, rf, _routes(state, trainable, opts))
    groups = _with_custom(groups, all_gather, reduce_scatter, opts)
    # The state's own shard count: that of its widest leaves (model-split ones have fewer).
    first = max((x for g in groups for x in g.sharded), key=lambda x: x.num_shards)
    n, replicas = first.num_shards, comm.axes_size(mesh, first.replicate_axis)
    unit_plans, collectives = [], []
    for group in groups:
        unit_plans.append(_unit_plan(group, n, opts))
        collectives += _unit_collectives(unit_plans[-1], group.layout, opts, (n, replicas))
    collectives += _step_collectives([g.layout for g in groups], opts, (n, replicas))
    collectives += _replicated_collectives(groups, opts, n * replicas)
    # The root averages the loss over every device once per step (one f32 scalar).
    collectives.append(Collective("all-reduce", "loss", "loss", "float32", n * replicas, 4, 1))
    params_fp = _footprint(state)
    return Plan(
        mesh_shape=tuple((str(a), int(s)) for a, s in mesh.shape.items()),
        num_shards=n,
        num_replicas=replicas,
        microbatches=microbatches,
        params=params_fp,
        grads=params_fp,
        optimizer=_optimizer_footprint(optimizer, state, mesh),
        accumulators=_accumulators(groups, opts),
        units=tuple(unit_plans),
        collectives=tuple(c for c in collectives if c.bytes),
    )


def _with_custom(groups, all_gather, reduce_scatter, opts: RootOptions) -> list:
    """`groups` with each unit's own collectives attached to its layout."""
    names = [g.name for g in groups if g.name != "root"]
    gathers = _units.collectives_by_unit(all_gather, names, "all_gather", comm.AllGather)
    reductions = _units.collectives_by_unit(
        reduce_scatter, names, "reduce_scatter", comm.ReduceScatter
    )
    out = []
    for group in groups:
        ag, rs = gathers.get(group.name), reductions.get(group.name)
        if group.layout is None or (ag is None and rs is None):
            out.append(group)
            continue
        keep = group.reshard_after_forward
        if (
            ag is not None
            and not isinstance(keep, bool)
            and keep not in (1, group.layout.num_shards)
        ):
            raise errors.UnsupportedError(
                _custom_option(group.name, "all-gather", f"reshard_after_forward={keep}")
            )
        if rs is not None and not opts.sync_every_microbatch:
            raise errors.UnsupportedError(
                _custom_option(group.name, "reduce-scatter", "sync_every_microbatch=False")
            )
        layout = comm.with_collectives(group.layout, ag, rs)
        out.append(dataclasses.replace(group, layout=layout))
    return out


def _custom_option(name: str, kind: str, option: str) -> str:
    return (
        f"plan: unit {name!r} has a custom {kind}, which units do not support with "
        f"{option} yet; plan (and run) it without that option, or with the default {kind}."
    )


def _routes(state, trainable, opts: RootOptions) -> tuple[core.LeafRoute, ...]:
    """Each leaf of `state` as `fs.value_and_grad` will route it (the same records)."""
    paths, items, _ = core.sharded_leaves(state)
    flags = core.trainable_flags("plan", trainable, state)
    return core.leaf_routes(paths, items, flags, sync_every_microbatch=opts.sync_every_microbatch)
