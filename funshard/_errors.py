"""Builders for user-facing error messages: each names the leaf and says how to fix it."""

from __future__ import annotations

from typing import Any, Sequence

from jax.tree_util import keystr


def where(fn: str, path: Sequence[Any] | None) -> str:
    """`fn: leaf <path>` prefix of a message (or just `fn:` at the root)."""
    if path is None:
        return f"{fn}:"
    return f"{fn}: leaf {keystr(tuple(path)) or '<root>'}"


def policy_dtype(field: str, value: Any, problem: str) -> str:
    return (
        f"MixedPrecisionPolicy: {field}={value!r} {problem}; use a floating dtype such as "
        "jnp.bfloat16, jnp.float16 or jnp.float32, or None to keep the parameter's dtype."
    )


def unknown_axis(fn: str, axis: str, mesh_axes: Sequence[str], role: str) -> str:
    return (
        f"{fn}: {role} {axis!r} is not an axis of the mesh (its axes are "
        f"{tuple(mesh_axes)}); pass one of those names, or build the mesh with "
        "fs.make_mesh()."
    )


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


def no_sharded(fn: str) -> str:
    return (
        f"{fn}: the tree has no fs.Sharded leaves, so there is nothing to gather. Pass the "
        "state returned by fs.shard(params, mesh), not the plain parameters."
    )


def mixed_meshes(fn: str, first, other) -> str:
    return (
        f"{where(fn, other[0])} lives on mesh {other[1]} but {keystr(tuple(first[0]))} "
        f"lives on mesh {first[1]}; states sharded on different meshes cannot be mixed in "
        "one call. Shard every tree with the same mesh (fs.shard(params, mesh))."
    )


def other_mesh_in_step(fn: str, path, mesh, step_mesh) -> str:
    return (
        f"{where(fn, path)} lives on mesh {mesh}, but the running step is on mesh "
        f"{step_mesh}; shard it with the step's mesh or pass it as part of the state."
    )


def batch_not_divisible(path, dim0: int, world: int, axes) -> str:
    return (
        f"{where('value_and_grad', path)} has leading (batch) dimension {dim0}, which the "
        f"data-parallel world size {world} (mesh axes {tuple(axes)}) does not divide. "
        f"Use a global batch that is a multiple of {world}, e.g. drop the last "
        "incomplete batch or pad it."
    )


def batch_empty(path) -> str:
    return (
        f"{where('value_and_grad', path)} has 0 rows: the mean loss of an empty batch is "
        "undefined. Skip empty batches."
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


def mixed_policies(fn: str, paths_and_policies) -> str:
    listing = "\n".join(f"  {keystr(tuple(p))}: {pol}" for p, pol in paths_and_policies)
    return (
        f"{fn}: the unit's parameters carry different mixed-precision policies:\n"
        f"{listing}\nShard all parameters of one unit with the same mp_policy."
    )


def bad_reshard_after_forward(fn: str, value) -> str:
    return (
        f"{fn}: reshard_after_forward must be True, False or a positive int (hpZ "
        f"group size), got {value!r}."
    )


def batch_ragged(rows) -> str:
    listing = "\n".join(f"  {keystr(tuple(p)) or '<root>'}: {n} rows" for p, n in rows)
    return (
        "value_and_grad: the batch leaves have different leading (batch) sizes:\n"
        f"{listing}\nEvery batch leaf must hold one row per example; give them all the "
        "same number of rows."
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
    listing = ", ".join(keystr(tuple(p)) or "<root>" for p in paths)
    return (
        f"value_and_grad: aux holds fs.Sharded leaves ({listing}): inside the step they "
        "are this device's local blocks. Return fs.unshard(...) of them, or read them from "
        "the state outside the step."
    )


def non_float_leaves(fn: str, bad) -> str:
    listing = "\n".join(f"  {keystr(tuple(p)) or '<root>'}: {d}" for p, d in bad)
    return (
        f"{fn}: the state has leaves that are not floating point, so they have no "
        f"gradient:\n{listing}\nAn optimizer would still change them (e.g. optax.adamw's "
        "weight decay, truncated to the integer dtype). Keep them out of the state "
        "(pass them as an extra argument), or mark them trainable=False (e.g. "
        "value_and_grad(..., trainable={'step': False})) and keep the optimizer off them "
        "with optax.masked(opt, mask); see docs/concepts.md."
    )


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


def coordinator_unresolvable(host: str, source: str, reason: str) -> str:
    return (
        f"initialize: the coordinator host {host!r} (from {source}) does not resolve "
        f"({reason}); set it to the host name or IP address of the machine that runs "
        "process 0, as every process can resolve it."
    )


def coordinator_bad_address(address: str, source: str) -> str:
    return (
        f"initialize: coordinator address {address!r} (from {source}) is not 'host:port' "
        "with a port in 1-65535; pass e.g. '10.0.0.1:29500' (MASTER_ADDR and MASTER_PORT "
        "under torchrun)."
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


def nested_units(how: str) -> str:
    return (
        f"fully_shard: units cannot be nested ({how}): the outer unit has already gathered "
        "every parameter it was given, so the inner one receives full arrays, not fs.Sharded "
        "leaves. Call each unit from the loss function, or pass the inner unit's sharded "
        "parameters to the outer unit as an argument (not inside its params) so that the "
        "outer unit gathers only the parameters it owns, as FSDP2 does."
    )


def sharded_in_user_code(shape, dtype) -> str:
    return (
        f"fs.Sharded leaf of shape {tuple(shape)} and dtype {dtype} is a sharded "
        "parameter (each device holds only its own rows); call fs.unshard(state) (or use "
        "an fs.fully_shard unit) to get the full array first."
    )


def no_state_mesh(fn: str) -> str:
    return (
        f"{fn}: the state has no fs.Sharded leaves, so there is no mesh to place the "
        "optimizer state on. Pass the state returned by fs.shard(params, mesh)."
    )


def save_in_flight(path: str) -> str:
    return (
        f"save: an asynchronous save to {path} is still in flight; call .wait() on the "
        "fs.PendingSave it returned before saving to that path again, or save each step "
        "to its own directory (e.g. f'{root}/step_{step}')."
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


def abstract_in_save(path) -> str:
    return (
        f"{where('save', path)} is abstract (a jax.ShapeDtypeStruct) and has no values "
        "to write; save the concrete state (materialise it first, e.g. with fs.restore "
        "or jax.jit of the initialiser)."
    )


def no_placement(fn: str, paths) -> str:
    listing = "\n".join(f"  {keystr(tuple(p)) or '<root>'}" for p in paths)
    return (
        f"{fn}: these leaves are jax.ShapeDtypeStruct without a sharding, and `like` has "
        f"no fs.Sharded leaves whose mesh they could be replicated on:\n{listing}\nGive "
        "each a sharding, e.g. jax.ShapeDtypeStruct(shape, dtype, "
        "sharding=NamedSharding(mesh, P()))."
    )


def mesh_no_devices() -> str:
    return (
        "make_mesh: devices is empty; pass at least one device, e.g. "
        "devices=jax.devices()[:4], or leave it out to use every device."
    )


def mesh_repeated_devices(positions) -> str:
    listing = "; ".join(f"{d} at positions {where}" for d, where in positions.items())
    return (
        f"make_mesh: devices lists the same device more than once ({listing}); each device "
        "holds exactly one shard. Pass distinct devices, e.g. devices=jax.devices()[:n]."
    )


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


def bad_unit_name(name) -> str:
    return (
        f"fully_shard: name must be a non-empty string (the unit's label in profiles and "
        f"HLO metadata), got {name!r}."
    )
