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


def bad_reshard_after_forward(value) -> str:
    return (
        f"fully_shard: reshard_after_forward must be True, False or a positive int (hpZ "
        f"group size), got {value!r}."
    )
