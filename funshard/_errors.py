"""Builders for user-facing error messages: each names the leaf and says how to fix it."""

from __future__ import annotations

from typing import Any, Sequence

from jax.tree_util import keystr


# ---- Shared: key paths, lists of processes, and messages several modules raise ----


def where(fn: str, path: Sequence[Any] | None) -> str:
    """`fn: leaf <path>` prefix of a message (or just `fn:` at the root)."""
    if path is None:
        return f"{fn}:"
    return f"{fn}: leaf {leaf_name(path)}"


def leaf_name(path: Sequence[Any]) -> str:
    """A leaf's key path as `keystr` writes it (`['a'][0]`), `<root>` for the tree itself."""
    return keystr(tuple(path)) or "<root>"


def joined(messages: Sequence[str]) -> str:
    """Several leaves' messages as one, a line each: every bad leaf is reported at once."""
    return "\n".join(messages)


def process_list(ranks) -> str:
    """"process 1" / "processes 0, 2-5": ranks with runs shortened to ranges."""
    ranks, parts = sorted(ranks), []
    for r in ranks:
        if parts and parts[-1][1] == r - 1:
            parts[-1][1] = r
        else:
            parts.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)
    return f"process{'es' if len(ranks) > 1 else ''} {text}"


def no_sharded(fn: str) -> str:
    return (
        f"{fn}: the tree has no fs.Sharded leaves, so there is nothing to gather. Pass the "
        "state returned by fs.shard(params, mesh), not the plain parameters."
    )


# ---- _policy ----


def policy_dtype(field: str, value: Any, problem: str) -> str:
    return (
        f"MixedPrecisionPolicy: {field}={value!r} {problem}; use a floating dtype such as "
        "jnp.bfloat16, jnp.float16 or jnp.float32, or None to keep the parameter's dtype."
    )


def policy_flag_not_bool(field: str, value) -> str:
    return f"MixedPrecisionPolicy: {field} must be a bool, got {value!r}; pass True or False."


# ---- _mesh ----


def mesh_no_devices() -> str:
    return (
        "make_mesh: devices is empty; pass at least one device, e.g. "
        "devices=jax.devices()[:4], or leave it out to use every device."
    )


def mesh_repeated_devices(positions) -> str:
    listing = "; ".join(f"{d} at positions {at}" for d, at in positions.items())
    return (
        f"make_mesh: devices lists the same device more than once ({listing}); each device "
        "holds exactly one shard. Pass distinct devices, e.g. devices=jax.devices()[:n]."
    )


def mesh_bad_replicate(replicate, n: int) -> str:
    return (
        f"make_mesh: replicate={replicate!r} must be a positive integer dividing the "
        f"number of devices ({n}); e.g. make_mesh(replicate=2) on 8 devices gives 2 "
        "replicas of a 4-way sharded model."
    )


def not_a_mesh(fn: str, mesh) -> str:
    return (
        f"{fn}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; build one "
        "with fs.make_mesh()."
    )


def unknown_axis(fn: str, axis: str, mesh_axes: Sequence[str], role: str) -> str:
    return (
        f"{fn}: {role} {axis!r} is not an axis of the mesh (its axes are "
        f"{tuple(mesh_axes)}); pass one of those names, or build the mesh with "
        "fs.make_mesh()."
    )


def axes_overlap(fn: str, shard_axes, replicate_axes) -> str:
    return (
        f"{fn}: shard_axis {shard_axes} and replicate_axis {replicate_axes} must be "
        "non-empty and disjoint; name different mesh axes, e.g. shard_axis='fsdp', "
        "replicate_axis='replicate'."
    )


# ---- _placement ----


def shard_dim_invalid(dim) -> str:
    return (
        f"Shard: dim must be a non-negative int, got {dim!r}; pass e.g. fs.Shard(0) "
        "(the default) or fs.Shard(1)."
    )


def placement_bad_return(path, chosen) -> str:
    return (
        f"{where('shard', path)}: placement returned {chosen!r}; return fs.Shard(dim), "
        "fs.Replicate() or None (the default, Shard(0))."
    )


def placement_dim_out_of_range(path, ndim: int, dim: int) -> str:
    return (
        f"{where('shard', path)} has {ndim} dimensions, so it cannot be sharded on dim "
        f"{dim}; return a dim below {ndim}."
    )


# ---- _shard: shard, unshard, reshard ----


def bad_dtype(fn: str, path, dtype: Any) -> str:
    return (
        f"{where(fn, path)} has dtype {dtype}; expected a numeric or bool array. Convert it "
        "with jnp.asarray(..., dtype=...) or keep it out of the params tree."
    )


def x64_dtype(fn: str, path, dtype: Any) -> str:
    return (
        f"{where(fn, path)} has dtype {dtype}, which JAX would silently narrow to 32 bits "
        "because jax_enable_x64 is off. Cast it first (e.g. .astype(np.float32)) or enable "
        "64-bit mode with jax.config.update('jax_enable_x64', True)."
    )


def already_sharded(path) -> str:
    return (
        f"{where('shard', path)} is already an fs.Sharded leaf; call fs.unshard(state) "
        "first to reshard onto another mesh."
    )


def dim_not_divisible(path, shape, dim: int, shards: int) -> str:
    return (
        f"{where('shard', path)} has size {shape[dim]} on dim {dim}, which the {shards} shards "
        "do not divide; only dim 0 is padded. Shard it on dim 0 or keep it replicated "
        "(fs.Replicate())."
    )


def stacked_and_placement() -> str:
    return "shard: pass either stacked=True or a placement, not both."


def bad_mp_policy(policy) -> str:
    return (
        f"shard: mp_policy must be an fs.MixedPrecisionPolicy or None, got "
        f"{type(policy).__name__}; build one with fs.MixedPrecisionPolicy(param_dtype=...)."
    )


def mixed_meshes(fn: str, first, other) -> str:
    return (
        f"{where(fn, other[0])} lives on mesh {other[1]} but {leaf_name(first[0])} "
        f"lives on mesh {first[1]}; states sharded on different meshes cannot be mixed in "
        "one call. Shard every tree with the same mesh (fs.shard(params, mesh))."
    )


def other_mesh_in_step(fn: str, path, mesh, step_mesh) -> str:
    return (
        f"{where(fn, path)} lives on mesh {mesh}, but the running step is on mesh "
        f"{step_mesh}; shard it with the step's mesh or pass it as part of the state."
    )


def structure_mismatch(fn: str, what: str, got, expected) -> str:
    return (
        f"{fn}: the {what} tree does not match the structure of `like`.\n  got:      "
        f"{got}\n  expected: {expected}\nPass a tree with exactly the structure of the "
        "state (e.g. the output of fs.unshard(state))."
    )


def shape_mismatch(fn: str, path, shape, expected) -> str:
    return (
        f"{where(fn, path)} has shape {tuple(shape)} but `like` expects "
        f"{tuple(expected)}; pass the full (unsharded) array of that leaf."
    )


def dtype_mismatch(fn: str, path, dtype, expected) -> str:
    return (
        f"{where(fn, path)} has dtype {dtype} but `like` expects {expected}; cast it with "
        f".astype({expected}) first."
    )


def reshard_not_array(path, full, shape) -> str:
    return (
        f"{where('reshard', path)} is {type(full).__name__}; expected the full array of "
        f"shape {shape}. Pass the full (unsharded) array of that leaf."
    )


# ---- _sharded ----


def sharded_in_user_code(shape, dtype) -> str:
    return (
        f"fs.Sharded leaf of shape {tuple(shape)} and dtype {dtype} is a sharded "
        "parameter (each device holds only its own rows); call fs.unshard(state) (or use "
        "an fs.fully_shard unit) to get the full array first."
    )


# ---- _fully_shard ----


def bad_unit_name(name) -> str:
    return (
        f"fully_shard: name must be a non-empty string (the unit's label in profiles and "
        f"HLO metadata), got {name!r}; pass e.g. name='block3', or leave it out to use "
        "the function's name."
    )


def nested_units(how: str) -> str:
    return (
        f"fully_shard: units cannot be nested ({how}): the outer unit has already gathered "
        "every parameter it was given, so the inner one receives full arrays, not fs.Sharded "
        "leaves. Call each unit from the loss function, or pass the inner unit's sharded "
        "parameters to the outer unit as an argument (not inside its params) so that the "
        "outer unit gathers only the parameters it owns, as FSDP2 does."
    )


def mixed_policies(fn: str, paths_and_policies) -> str:
    listing = "\n".join(f"  {leaf_name(p)}: {pol}" for p, pol in paths_and_policies)
    return (
        f"{fn}: the unit's parameters carry different mixed-precision policies:\n"
        f"{listing}\nShard all parameters of one unit with the same mp_policy."
    )


def bad_reshard_after_forward(fn: str, value) -> str:
    return (
        f"{fn}: reshard_after_forward must be True, False or a positive int (hpZ "
        f"group size), got {value!r}; pass True to free the gathered parameters after "
        "the forward, False to keep them, or k to keep them sharded over groups of k."
    )


def hpz_group_mismatch(k: int, axes, sizes) -> str:
    return (
        f"fully_shard: reshard_after_forward={k} needs the parameters' shard axes {axes} "
        f"(sizes {tuple(sizes)}) to end in axes spanning exactly {k} devices, e.g. shard "
        f"over ('fsdp_outer', 'fsdp_inner') with an inner axis of size {k}."
    )


def hpz_not_divisor(k: int, n: int) -> str:
    return (
        f"fully_shard: reshard_after_forward={k} must divide the number of shards "
        f"({n}); use True, False or a divisor of {n}."
    )


# ---- _scan ----


def scan_not_stacked(path, dim: int) -> str:
    return (
        f"{where('scan', path)} is sharded on dim {dim}, not as a stack of layers; shard "
        "the stacked parameters with fs.shard(..., stacked=True)."
    )


def scan_hpz_unsupported(k: int) -> str:
    return (
        f"scan: reshard_after_forward={k} (hpZ) is not supported for scanned stacks yet; "
        "use True or False."
    )


def scan_deferred_sync_unsupported() -> str:
    return (
        "scan: gradient accumulation without per-microbatch sync is not supported for "
        "scanned stacks yet; use sync_every_microbatch=True."
    )


# ---- _step: value_and_grad ----


def microbatches_invalid(value) -> str:
    return (
        f"value_and_grad: microbatches must be an int >= 1, got {value!r}; pass e.g. "
        "microbatches=4 (1: no accumulation)."
    )


def gradient_divide_factor_invalid(value) -> str:
    return (
        f"value_and_grad: gradient_divide_factor must be a positive number, got {value!r}; "
        "pass e.g. the data-parallel world size, or None for the default."
    )


def mixed_axes(path, these, axes) -> str:
    return (
        f"{where('value_and_grad', path)} is sharded over {these[1]} (replicated over "
        f"{these[0]}) but other leaves over {axes[1]} (replicated over {axes[0]}); shard "
        "the whole state with one shard_axis/replicate_axis."
    )


def trainable_mismatch(exc: BaseException) -> str:
    return (
        "value_and_grad: `trainable` must be a pytree prefix of the state with a bool "
        f"at each leaf or subtree ({exc}). E.g. {{'encoder': False, 'head': True}}."
    )


def non_float_leaves(fn: str, bad) -> str:
    listing = "\n".join(f"  {leaf_name(p)}: {d}" for p, d in bad)
    return (
        f"{fn}: the state has leaves that are not floating point, so they have no "
        f"gradient:\n{listing}\nAn optimizer would still change them (e.g. optax.adamw's "
        "weight decay, truncated to the integer dtype). Keep them out of the state "
        "(pass them as an extra argument), or mark them trainable=False (e.g. "
        "value_and_grad(..., trainable={'step': False})) and keep the optimizer off them "
        "with optax.masked(opt, mask); see docs/concepts.md."
    )


def batch_not_array(path, leaf) -> str:
    return (
        f"{where('value_and_grad', path)} is a {type(leaf).__name__}, not an array; the "
        "batch may only hold arrays (pass other values as extra *args or close over them)."
    )


def batch_scalar(path) -> str:
    return (
        f"{where('value_and_grad', path)} is a scalar; every batch leaf needs a leading "
        "batch dimension to split over the data-parallel devices. Pass scalars as extra "
        "*args instead."
    )


def batch_ragged(rows) -> str:
    listing = "\n".join(f"  {leaf_name(p)}: {n} rows" for p, n in rows)
    return (
        "value_and_grad: the batch leaves have different leading (batch) sizes:\n"
        f"{listing}\nEvery batch leaf must hold one row per example; give them all the "
        "same number of rows."
    )


def batch_empty(path) -> str:
    return (
        f"{where('value_and_grad', path)} has 0 rows: the mean loss of an empty batch is "
        "undefined. Skip empty batches."
    )


def batch_not_divisible(path, dim0: int, world: int, axes) -> str:
    return (
        f"{where('value_and_grad', path)} has leading (batch) dimension {dim0}, which the "
        f"data-parallel world size {world} (mesh axes {tuple(axes)}) does not divide. "
        f"Use a global batch that is a multiple of {world}, e.g. drop the last "
        "incomplete batch or pad it."
    )


def batch_not_microbatchable(path, rows: int, world: int, microbatches: int) -> str:
    return (
        f"{where('value_and_grad', path)} has {rows} rows, which do not split into "
        f"{microbatches} microbatches on each of {world} devices; use a global batch that "
        f"is a multiple of {world * microbatches}."
    )


def aux_expected(out) -> str:
    what = f"a {type(out).__name__}"
    if isinstance(out, (tuple, list)):
        what += f" of {len(out)} elements"
    return (
        f"value_and_grad: has_aux=True but the loss function returned {what}; with "
        "has_aux=True it must return a pair (loss, aux). Return (loss, aux), or pass "
        "has_aux=False."
    )


def aux_unexpected(count: int) -> str:
    return (
        f"value_and_grad: the loss function returned a tuple of {count} elements but "
        "has_aux=False; return the scalar loss alone, or return (loss, aux) and pass "
        "has_aux=True."
    )


def loss_not_scalar(loss) -> str:
    shape = getattr(loss, "shape", None)
    dtype = getattr(loss, "dtype", type(loss).__name__)
    return (
        f"value_and_grad: the loss must be a floating scalar, got shape {shape} dtype "
        f"{dtype}. Reduce it over the local batch (e.g. jnp.mean) and return a float; "
        "return other values as aux (has_aux=True)."
    )


def sharded_aux(paths) -> str:
    listing = ", ".join(leaf_name(p) for p in paths)
    return (
        f"value_and_grad: aux holds fs.Sharded leaves ({listing}): inside the step they "
        "are this device's local blocks. Return fs.unshard(...) of them, or read them from "
        "the state outside the step."
    )


# ---- _optim ----


def no_state_mesh(fn: str) -> str:
    return (
        f"{fn}: the state has no fs.Sharded leaves, so there is no mesh to place the "
        "optimizer state on. Pass the state returned by fs.shard(params, mesh)."
    )


# ---- _checkpoint: save, restore ----


def save_exists(path: str) -> str:
    return (
        f"save: {path} already exists; pass overwrite=True, or save each step to its "
        "own directory (e.g. f'{root}/step_{step}')."
    )


def save_overwrite_async() -> str:
    return "save: overwrite=True cannot be asynchronous; save to a new path."


def save_in_flight(path: str) -> str:
    return (
        f"save: an asynchronous save to {path} is still in flight; call .wait() on the "
        "fs.PendingSave it returned before saving to that path again, or save each step "
        "to its own directory (e.g. f'{root}/step_{step}')."
    )


def abstract_in_save(path) -> str:
    return (
        f"{where('save', path)} is abstract (a jax.ShapeDtypeStruct) and has no values "
        "to write; save the concrete state (materialise it first, e.g. with fs.restore "
        "or jax.jit of the initialiser)."
    )


def no_checkpoint(path: str) -> str:
    return (
        f"restore: no checkpoint at {path}. Pass a directory written by fs.save, e.g. "
        "f'{root}/step_{step}'."
    )


def restore_in_flight(path: str) -> str:
    return (
        f"restore: no checkpoint at {path} yet: an asynchronous save to it is still in "
        "flight. Call .wait() on the fs.PendingSave that fs.save returned first."
    )


def not_a_checkpoint(path: str, entries: Sequence[str]) -> str:
    held = ", ".join(sorted(entries)[:8]) + (", ..." if len(entries) > 8 else "")
    return (
        f"restore: {path} is not a funshard checkpoint: it has no 'funshard' metadata "
        f"item (it holds: {held or 'nothing'}). Pass a directory written by fs.save, "
        "e.g. f'{root}/step_{step}', not its parent or another tool's checkpoint."
    )


def checkpoint_bad_metadata(path: str) -> str:
    return (
        f"restore: {path} is not a funshard checkpoint (no funshard metadata). Pass a "
        "directory written by fs.save."
    )


def checkpoint_corrupt(path: str, what: str, exc: BaseException) -> str:
    return (
        f"restore: the checkpoint at {path} is incomplete or corrupt (reading its "
        f"{what} failed: {type(exc).__name__}: {exc}). Restore an earlier checkpoint."
    )


def checkpoint_missing_leaf(key: str) -> str:
    return f"  missing from the checkpoint: {key}"


def checkpoint_extra_leaf(key: str) -> str:
    return f"  not in `like`: {key}"


def checkpoint_shape(key: str, have, want) -> str:
    return f"  shape mismatch: {key} is {tuple(have)} in the checkpoint, {tuple(want)} in `like`"


def checkpoint_dtype(key: str, have, want) -> str:
    return f"  dtype mismatch: {key} is {have} in the checkpoint, {want} in `like`"


def checkpoint_mismatch(path: str, problems: Sequence[str]) -> str:
    return (
        f"restore: the checkpoint at {path} does not match `like`:\n" + "\n".join(problems)
        + "\nBuild `like` exactly as the saved tree was built (same model, optimizer "
        "and dtypes)."
    )


def no_placement(fn: str, paths) -> str:
    listing = "\n".join(f"  {leaf_name(p)}" for p in paths)
    return (
        f"{fn}: these leaves are jax.ShapeDtypeStruct without a sharding, and `like` has "
        f"no fs.Sharded leaves whose mesh they could be replicated on:\n{listing}\nGive "
        "each a sharding, e.g. jax.ShapeDtypeStruct(shape, dtype, "
        "sharding=NamedSharding(mesh, P()))."
    )


# ---- _state_dict ----


def state_dict_not_mapping(sd) -> str:
    return (
        f"load_state_dict: sd is a {type(sd).__name__}; expected a dict from path strings "
        "to full arrays, as fs.state_dict(tree) returns. To load a tree of full arrays "
        "use fs.reshard(full_tree, like); to load from disk use fs.restore(path, like)."
    )


def state_dict_bad_entries(entries) -> str:
    listing = "\n".join(
        f"  {k!r}: {type(v).__name__}" for k, v in entries
    )
    return (
        "load_state_dict: sd must map path strings (such as \"['layers'][0]['w']\") to "
        f"numpy or jax arrays; these entries do not:\n{listing}\nPass the flat dict "
        "fs.state_dict(tree) returns, not a nested tree (for a tree of full arrays use "
        "fs.reshard(full_tree, like)); wrap numbers with np.asarray(value, dtype)."
    )


def state_dict_missing(key: str) -> str:
    return f"  missing: {key}"


def state_dict_unexpected(key: str) -> str:
    return f"  unexpected: {key}"


def state_dict_shape(key: str, got, want) -> str:
    return f"  shape mismatch: {key} is {got}, expected {want}"


def state_dict_dtype(key: str, got, want) -> str:
    return f"  dtype mismatch: {key} is {got}, expected {want}"


def state_dict_mismatch(problems: Sequence[str]) -> str:
    return (
        "load_state_dict: the state dict does not match `like`:\n" + "\n".join(problems)
        + "\nExport it with fs.state_dict from a tree of the same structure, or fix "
        "the listed keys."
    )


# ---- _distributed: initialize, shard_batch ----


def env_not_int(name: str, value: str) -> str:
    return (
        f"initialize: environment variable {name}={value!r} is not an integer; it is "
        "set by the launcher (torchrun / srun), or pass the value as an argument."
    )


def launch_not_int(name: str, value) -> str:
    return (
        f"initialize: {name} must be an int, got {value!r}; pass an int, or leave it "
        "None to read it from the launcher's environment."
    )


def launch_bad_rank(rank: int, n: int) -> str:
    return (
        f"initialize: process_id={rank} and num_processes={n} must satisfy "
        "0 <= process_id < num_processes (check RANK / WORLD_SIZE or the arguments)."
    )


def launch_no_coordinator(n: int, launcher: str) -> str:
    return (
        f"initialize: {n} processes ({launcher}) but no coordinator address: pass "
        "coordinator_address='host:port' (process 0's host), or set MASTER_ADDR and "
        "MASTER_PORT (or JAX_COORDINATOR_ADDRESS) in every process's environment."
    )


def backend_already_started(launch) -> str:
    return (
        f"initialize: process {launch.process_id} of {launch.num_processes} already used "
        "JAX (jax.devices(), an array, a computation, ...) before this call, so its "
        "devices are fixed to this process alone. Call funshard.distributed.initialize() "
        "first, right after the imports."
    )


def shard_batch_not_mesh(mesh) -> str:
    return (
        f"shard_batch: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; "
        "use the mesh funshard.distributed.initialize() returned."
    )


def shard_batch_no_data_axes(mesh_axes, axes) -> str:
    return (
        f"shard_batch: mesh axes {tuple(mesh_axes)} lack the data-parallel axes "
        f"{axes or ('fsdp',)}; pass axes=... naming the axes the batch is split over."
    )


def shard_batch_no_local_device(rank: int) -> str:
    return (
        f"shard_batch: process {rank} has no device in the mesh; build the mesh over "
        "every process's devices (funshard.distributed.initialize())."
    )


def local_batch_not_array(path, leaf) -> str:
    return (
        f"{where('shard_batch', path)} is a {type(leaf).__name__}, not an array; pass a "
        "numpy or jax array of this process's rows."
    )


def local_batch_scalar(path) -> str:
    return (
        f"{where('shard_batch', path)} is a scalar; every batch leaf needs a leading row "
        "dimension (pass replicated values as extra arguments)."
    )


def local_batch_uneven(path, rows: int, local: int) -> str:
    return (
        f"{where('shard_batch', path)} has {rows} rows, which do not split over this "
        f"process's {local} data-parallel devices; give each process a multiple of "
        f"{local} rows."
    )


def batch_differs_across_processes(signatures) -> str:
    """`signatures`: rank -> [(keystr path, (shape, dtype) or a type name)] of its leaves."""
    by_path: dict = {}
    for rank, leaves in signatures.items():
        for path, described in leaves:
            by_path.setdefault(path, {})[rank] = described
    lines = []
    for path, per_rank in by_path.items():
        groups: dict = {}
        for rank in signatures:
            groups.setdefault(per_rank.get(rank, "absent"), []).append(rank)
        if len(groups) > 1:
            listing = "; ".join(
                f"{_leaf_text(d, groups)} on {process_list(r)}" for d, r in groups.items())
            lines.append(f"  local_batch{path}: {listing}")
    return (
        "shard_batch: the processes passed batches that do not fit together:\n"
        + "\n".join(lines)
        + "\nEvery process must pass the same tree with the same number of rows, trailing "
        "shape and dtype per leaf (drop or pad a last partial batch on every process alike)."
    )


def _leaf_text(described, groups) -> str:
    """"8 rows" where only the row counts differ, else "float32 (8, 3)"."""
    if described == "absent":
        return described
    if not isinstance(described, tuple):
        return f"a {described}, not an array,"
    arrays = [d for d in groups if isinstance(d, tuple)]
    if len(arrays) == len(groups) and all(
        len(d[0]) >= 1 and d[0][1:] == described[0][1:] and d[1] == described[1] for d in arrays
    ) and described[0]:
        return f"{described[0][0]} rows"
    return f"{described[1]} {tuple(described[0])}"


# ---- _rendezvous: the start-up meeting ----


def timeout_invalid(source: str, value) -> str:
    return (
        f"initialize: {source}={value!r} is not a positive number of seconds; pass e.g. "
        "initialization_timeout=60 (or FUNSHARD_INITIALIZATION_TIMEOUT=60)."
    )


def coordinator_bad_address(address: str, source: str) -> str:
    return (
        f"initialize: coordinator address {address!r} (from {source}) is not 'host:port' "
        "with a port in 1-65535; pass e.g. '10.0.0.1:29500' (MASTER_ADDR and MASTER_PORT "
        "under torchrun)."
    )


def coordinator_unresolvable(host: str, source: str, reason: str) -> str:
    return (
        f"initialize: the coordinator host {host!r} (from {source}) does not resolve "
        f"({reason}); set it to the host name or IP address of the machine that runs "
        "process 0, as every process can resolve it."
    )


def start_cannot_listen(port: int, reason) -> str:
    return (
        f"initialize: process 0 cannot listen on port {port} for the coordinator "
        f"({reason}); another program uses it. Choose a free port (MASTER_PORT, or the "
        "port in coordinator_address)."
    )


def hello_not_funshard() -> str:
    return "a program other than funshard connected to the coordinator's port"


def hello_world_size(rank: int, size: int, n: int) -> str:
    return (
        f"a process started as rank {rank} of {size} processes, but process 0 expects "
        f"{n} (WORLD_SIZE differs between processes)"
    )


def hello_rank_taken(rank: int) -> str:
    return f"two processes started as rank {rank} (RANK must be unique)"


def start_note_refused(problem: str) -> str:
    """A note for `start_missing_processes`: a connection process 0 turned away."""
    return f"Refused a connection: {problem}"


def start_note_disconnected(rank: int) -> str:
    """A note for `start_missing_processes`: a peer that arrived, then died."""
    return f"Process {rank} arrived but disconnected again (it exited)"


def start_rejected(n: int, problem: str) -> str:
    return (
        f"initialize: process 0 of {n} rejected this process: {problem}. Start every "
        "process with the same WORLD_SIZE and its own RANK, and keep other programs off "
        "the coordinator's port."
    )


def start_missing_processes(me: str, missing, address: str, timeout: float, notes) -> str:
    extra = "".join(f" {note}." for note in notes)
    return (
        f"initialize: {me} gave up after {timeout:g} s: {process_list(missing)} never "
        f"reached the coordinator at {address}.{extra} Check that the launcher started "
        "every process with the same WORLD_SIZE and MASTER_ADDR/MASTER_PORT, or raise the "
        "timeout (initialization_timeout= or FUNSHARD_INITIALIZATION_TIMEOUT)."
    )


def start_no_coordinator(me: str, address: str, timeout: float, reason: str) -> str:
    return (
        f"initialize: {me} could not reach the coordinator (process 0) at {address} "
        f"within {timeout:g} s ({reason}). Start process 0, check that MASTER_ADDR / "
        "MASTER_PORT (or coordinator_address) name its host and a port it can listen on, "
        "or raise the timeout (initialization_timeout= or FUNSHARD_INITIALIZATION_TIMEOUT)."
    )


def start_no_answer(me: str, address: str, timeout: float) -> str:
    return (
        f"initialize: {me} reached the coordinator at {address}, but process 0 did not "
        f"answer within {timeout:g} s (is it stopped?). Check process 0's log, or raise "
        "the timeout (initialization_timeout= or FUNSHARD_INITIALIZATION_TIMEOUT)."
    )


def start_gave_up_elsewhere(me: str, missing) -> str:
    return (
        f"initialize: {me}: process 0 gave up waiting: {process_list(missing)} never "
        "reached the coordinator (see process 0's error). Start the missing processes, "
        "or raise the timeout (initialization_timeout= or FUNSHARD_INITIALIZATION_TIMEOUT)."
    )


def start_unexpected_answer(reply: str) -> str:
    return (
        f"initialize: unexpected answer {reply!r} from the coordinator's port; run the "
        "same funshard version in every process and keep other programs off that port."
    )


# ---- _plan ----


def plan_no_mesh() -> str:
    return (
        "plan: params are not sharded, so the mesh to shard them on is needed; pass it "
        "as fs.plan(params, mesh, ...) (e.g. mesh = fs.make_mesh())."
    )


def plan_other_mesh(state_mesh, mesh) -> str:
    return (
        f"plan: the state is sharded on mesh {state_mesh} but mesh={mesh} was passed; "
        "leave mesh out to plan the state as it is, or pass the unsharded params to plan "
        "another mesh."
    )


def plan_option_on_sharded(name: str) -> str:
    return (
        f"plan: the state is already sharded, so its {name} is read from its fs.Sharded "
        f"leaves; drop {name}=..., or pass the unsharded params (arrays or "
        "jax.ShapeDtypeStruct) to plan another layout."
    )


def plan_bad_mp_policy(policy) -> str:
    return (
        f"plan: mp_policy must be an fs.MixedPrecisionPolicy or None, got "
        f"{type(policy).__name__}; build one with fs.MixedPrecisionPolicy(param_dtype=...)."
    )


def plan_microbatches_invalid(value) -> str:
    return (
        f"plan: microbatches must be an int >= 1, got {value!r}; pass the value given "
        "to fs.value_and_grad (1: no accumulation)."
    )


def plan_flag_not_bool(name: str, value) -> str:
    return f"plan: {name} must be a bool, got {value!r}; pass True or False."


def plan_units_type(units) -> str:
    return (
        f"plan: units must be a mapping from unit name to key-path prefix, or a list of "
        f"prefixes, got {type(units).__name__}; e.g. units={{'block0': ('blocks', 0)}} "
        "or units=['blocks.0', 'blocks.1']."
    )


def plan_unit_name(name) -> str:
    return (
        f"plan: unit names must be non-empty strings other than 'root' (the name of the "
        f"parameters in no unit), got {name!r}; name the unit e.g. 'block0'."
    )


def plan_duplicate_unit(name: str) -> str:
    return (
        f"plan: units lists {name!r} twice; list each unit once (a list of prefixes, "
        "given as a mapping's value, makes one unit of several subtrees)."
    )


def plan_bad_prefix(unit, spec) -> str:
    return (
        f"plan: unit {unit!r} selects {spec!r}, which is not a key-path prefix; give a "
        "tuple of keys such as ('layers', 0), a string such as 'layers.0' or "
        "\"['layers'][0]\", or a non-empty list of those."
    )


def plan_prefix_not_found(unit: str, prefix: str, at: str, below) -> str:
    found = ", ".join(repr(k) for k in below[:12]) + (", ..." if len(below) > 12 else "")
    return (
        f"plan: unit {unit!r} selects {prefix!r}, which matches no array leaf of params; "
        f"{at} holds {found or 'no array leaves'}. Give the prefix of the subtree the "
        "unit is called on."
    )


def plan_leaf_in_two_units(path, first: str, second: str) -> str:
    return (
        f"{where('plan', path)} is selected by units {first!r} and {second!r} through "
        "the same prefix; a parameter belongs to one unit (the one with the longest "
        "prefix above it). Give each unit its own prefix."
    )


def plan_unit_not_sharded(unit: str, paths) -> str:
    listing = ", ".join(leaf_name(p) for p in paths[:6]) + (", ..." if len(paths) > 6 else "")
    return (
        f"plan: unit {unit!r} holds no sharded parameter ({listing}: "
        "0-d or replicated leaves only), and fs.fully_shard refuses such a unit. Leave "
        "these leaves to the root, or widen the unit's prefix."
    )


def plan_nothing_sharded() -> str:
    return (
        "plan: params has no array leaf that fs.shard would shard (only 0-d or "
        "replicated leaves, or none at all); pass the model's parameter tree."
    )


def plan_mixed_axes(path, these, axes) -> str:
    return (
        f"{where('plan', path)} is sharded over {these[1]} (replicated over {these[0]}) "
        f"but other leaves over {axes[1]} (replicated over {axes[0]}); fs.value_and_grad "
        "needs one shard_axis/replicate_axis for the whole state."
    )


def plan_reshard_unknown_units(unknown, names) -> str:
    return (
        f"plan: reshard_after_forward names {sorted(unknown)}, which are not units "
        f"(the units are {list(names)}); use the names given in units=."
    )


def plan_hpz_not_divisor(unit: str, k: int, n: int) -> str:
    return (
        f"plan: unit {unit!r} has reshard_after_forward={k}, which must divide the "
        f"number of shards ({n}); use True, False or a divisor of {n}."
    )


def plan_trainable_mismatch(exc: BaseException) -> str:
    return (
        "plan: `trainable` must be a pytree prefix of params with a bool at each leaf "
        f"or subtree ({exc}). E.g. {{'encoder': False, 'head': True}}."
    )


def plan_not_optimizer(optimizer) -> str:
    return (
        f"plan: optimizer must be an optax GradientTransformation (with an init "
        f"method), got {type(optimizer).__name__}; pass e.g. optax.adamw(1e-3)."
    )


# ---- hardening: donated state, departed peers, empty stacks, callbacks ----


def sharded_deleted(shape, dtype) -> str:
    return (
        f"Array has been deleted: fs.Sharded leaf of shape {tuple(shape)} and dtype "
        f"{dtype} was donated to a jitted call (donate_argnums) or deleted, so its "
        "buffers are gone. Use the state that call returned (state, ... = step(state, "
        "...)), or do not donate a state you still need."
    )


def _layer_axes(counts) -> str:
    return ", ".join(f"{leaf_name(path)} {shape}" for path, shape in counts)


def scan_no_layers(fn_name: str, counts) -> str:
    return (
        f"scan: the stack given to fs.scan({fn_name}, ...) holds no layers: its layer axis "
        f"(dim 0) has size 0 ({_layer_axes(counts)}). Stack at least one layer, or skip "
        "the fs.scan call for a model without such layers."
    )


def scan_layer_counts(fn_name: str, counts) -> str:
    return (
        f"scan: the leaves of the stack given to fs.scan({fn_name}, ...) disagree on the "
        f"number of layers (dim 0): {_layer_axes(counts)}. Stack every leaf over the same "
        "layers."
    )


def callbacks_outside_root(fn: str, places) -> str:
    listed = "; ".join(places)
    return (
        f"{fn}: the jitted step runs jax.debug.callback before {fn}, outside the loss "
        f"function (at {listed}). If such a callback raises on some devices only (a NaN "
        "check of one device's rows), the other devices wait for them at the step's first "
        "collective and XLA CPU aborts the process (rendezvous termination timeout, 40 s "
        "by default), losing the training state. Inside the loss function funshard raises "
        "a callback's exception cleanly at the end of the step: move the callback there "
        "(or run the check outside the jitted step). A callback that never raises is safe; "
        "silence this with warnings.filterwarnings('ignore', message='.*before "
        f"{fn}, outside the loss function')."
    )


def departure_timeout_invalid(source: str, value) -> str:
    return (
        f"initialize: {source}={value!r} is not a positive number of seconds; pass e.g. "
        "departure_timeout=30 (or FUNSHARD_DEPARTURE_TIMEOUT=30), or inf to wait forever."
    )


def departure(note) -> str:
    """ "process 1 returned normally and left the job after 2 steps (shard_batch calls)"."""
    text = f"process {note.rank} {note.how} and left the job"
    return text if note.kind == "step" else f"{text} after {_steps(note.step, note.kind)}"


def _steps(count: int, kind: str) -> str:
    """ "3 steps (shard_batch calls)": a step count and what funshard counted as a step."""
    return f"{count} step{'' if count == 1 else 's'} ({kind}{'es' if kind.endswith('s') else 's'})"


def _last_common_step(step: int, kind: str, notes) -> str:
    counted = [n.step for n in notes if n.kind != "step"] + ([step] if kind != "step" else [])
    if not counted:
        return (
            "funshard names steps by counting calls of fs.distributed.shard_batch (or a "
            "torch_frontend model's backward passes); this job made none, so it cannot "
            "name the last step both reached."
        )
    return f"The last step both reached is step {min(counted)}."


def _same_steps_hint(timeout: float | None) -> str:
    text = (
        "Every process must run the same steps, with the same collectives in the same "
        "order; one that stops early (fewer steps, or an exception it caught before "
        "returning) leaves the others waiting."
    )
    if timeout is not None:
        text += (f" Gave up after departure_timeout={timeout:g} s (an argument of "
                 "funshard.distributed.initialize, or FUNSHARD_DEPARTURE_TIMEOUT).")
    return text


def _at_step(step: int, kind: str) -> str:
    return "" if kind == "step" else f", at step {step},"


def peer_left(rank: int, count: int, notes, step: int, kind: str, waited_s: float,
              what: str, timeout: float) -> str:
    who = ", ".join(str(n.rank) for n in notes)
    return (
        f"funshard.distributed: process {rank} of {count} gives up: "
        f"{'; '.join(departure(n) for n in notes)}, and {what} of this "
        f"process{_at_step(step, kind)} has made no progress for {waited_s:.0f} s since: "
        f"it is waiting in a collective that process{'es' if len(notes) > 1 else ''} "
        f"{who} will never join. {_last_common_step(step, kind, notes)} "
        f"{_same_steps_hint(timeout)}"
    )


def batch_peer_left(rank: int, count: int, notes, step: int, kind: str) -> str:
    return (
        f"shard_batch: process {rank} of {count}, at step {step}: "
        f"{'; '.join(departure(n) for n in notes)}, so this step's batch (and its "
        f"collectives) will never be complete. {_last_common_step(step, kind, notes)} "
        f"{_same_steps_hint(None)}"
    )


def local_block_read(shape, local_shape) -> str:
    return (
        f"`.data` of a sharded parameter of shape {tuple(shape)} read inside a funshard "
        f"step: there it is only this device's local block, of shape {tuple(local_shape)} "
        "(its rows of the padded array), not the parameter. Call fs.unshard(state) (or use "
        "an fs.fully_shard unit) for the full array. To compute on the local block on "
        "purpose (e.g. a sum of squares followed by jax.lax.psum), take it as the leaf's "
        "pytree child: jax.tree.leaves(leaf)[0]."
    )


def other_mesh_set(fn: str, context, mesh) -> str:
    def text(m) -> str:
        return ", ".join(f"{name}={size}" for name, size in m.shape.items()) or "no axes"

    return (
        f"{fn}: a mesh is set with jax.set_mesh ({text(context)}, axis types "
        f"{tuple(t.name for t in context.axis_types)}) that is not the mesh of the sharded "
        f"state ({text(mesh)}), and JAX would refuse the step's shard_map. funshard places "
        "every array itself: remove the jax.set_mesh call (Flax's tutorials set one for "
        "automatic sharding), or set the state's own mesh (`with jax.set_mesh(mesh):`)."
    )
