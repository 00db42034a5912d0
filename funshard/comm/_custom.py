"""A unit's own collectives: user functions in place of the default all-gather and
reduce-scatter (FSDP2's `set_custom_all_gather` / `set_custom_reduce_scatter`).

The user writes the collective as JAX code over this device's flat buffer, inside the
step's `jax.shard_map`, exactly as the default is written (`jax.lax.all_gather`,
`jax.lax.psum_scatter`): a gather in a narrower dtype, a quantized or compressed
gradient reduction. Everything around it stays funshard's: which leaves share the
buffer, padding, the policy's dtypes, the HSDP all-reduce over the replicate axes, the
division into a mean, and the backward pass. Both objects are frozen and hashable, so a
layout that carries them stays a jit cache key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from funshard import errors


@dataclasses.dataclass(frozen=True)
class AllGather:
    """A unit's own all-gather of its parameters.

    The functional form of FSDP2's `set_custom_all_gather`: `fn` replaces
    `jax.lax.all_gather(block, axes, tiled=True)` for one unit's parameters.

    Attributes:
      fn: `fn(block, axes) -> gathered`, run per device inside the step's
        `jax.shard_map`. `block` is this device's flat 1-D buffer of the unit's
        parameter blocks (`n` elements): in the unit's gather dtype (the policy's
        `param_dtype`) when all its leaves share one, else unsigned integers holding
        the leaves' bits, which the function must deliver unchanged. `axes` is the tuple
        of mesh axes to gather over (`N` devices together). It returns every device's
        block in device order, shape `(N * n,)`, in `block`'s dtype: what
        `jax.lax.all_gather(block, axes, tiled=True)` returns.
      bytes_per_element: what one element of the gathered buffer costs in transfer,
        as `fs.plan` reports it (e.g. 1 for a gather that moves float8 values of a
        bf16 buffer); None: the buffer's own itemsize.
      label: the dtype `fs.plan` shows for it (e.g. "float8_e4m3fn"); None: the
        buffer's dtype.
    """

    fn: Callable[[jax.Array, tuple[str, ...]], jax.Array]
    bytes_per_element: float | None = None
    label: str | None = None

    def __post_init__(self) -> None:
        _check_fields("AllGather", self.fn, self.bytes_per_element, self.label)


@dataclasses.dataclass(frozen=True)
class ReduceScatter:
    """A unit's own reduce-scatter of its gradients.

    The functional form of FSDP2's `set_custom_reduce_scatter`: `fn` replaces
    `jax.lax.psum_scatter(buffer, axes, tiled=True)` for one unit's gradients, once per
    reduce dtype of its leaves.

    Attributes:
      fn: `fn(buffer, axes) -> reduced`, run per device inside the step's
        `jax.shard_map`. `buffer` is this device's flat 1-D gradient buffer in the
        policy's `reduce_dtype`, `N * n` elements for `N` devices over `axes`: its
        `i`-th stretch of `n` is what it contributes to device `i`'s shard. It returns
        this device's shard, shape `(n,)`, in `buffer`'s dtype: the SUM over devices
        of their stretch for this device, what `jax.lax.psum_scatter(buffer, axes,
        tiled=True)` returns. funshard divides it into a mean afterwards and, for
        HSDP, all-reduces it over the replicate axes, as it does the default's.
      bytes_per_element: what one element of `buffer` costs in transfer, as
        `fs.plan` reports it (e.g. 2 for a bf16 reduction of an f32 buffer); None:
        the buffer's own itemsize.
      label: the dtype `fs.plan` shows for it (e.g. "int8"); None: the buffer's
        dtype.
    """

    fn: Callable[[jax.Array, tuple[str, ...]], jax.Array]
    bytes_per_element: float | None = None
    label: str | None = None

    def __post_init__(self) -> None:
        _check_fields("ReduceScatter", self.fn, self.bytes_per_element, self.label)


def _check_fields(kind: str, fn, bytes_per_element, label) -> None:
    if not callable(fn):
        raise errors.ShardingTypeError(
            f"{kind}: fn must be a function fn(buffer, axes) -> array, got "
            f"{type(fn).__name__} {fn!r}."
        )
    if bytes_per_element is not None and (
        isinstance(bytes_per_element, bool)
        or not isinstance(bytes_per_element, (int, float))
        or not bytes_per_element > 0
    ):
        raise errors.ShardingValueError(
            f"{kind}: bytes_per_element must be a positive number (what one element of "
            f"the buffer costs in transfer) or None, got {bytes_per_element!r}."
        )
    if label is not None and not isinstance(label, str):
        raise errors.ShardingTypeError(f"{kind}: label must be a string or None, got {label!r}.")


def check_unit_collectives(api: str, all_gather, reduce_scatter) -> None:
    """Raises if a unit's `all_gather=` / `reduce_scatter=` is not what it should be."""
    for arg, value, cls in (
        ("all_gather", all_gather, AllGather),
        ("reduce_scatter", reduce_scatter, ReduceScatter),
    ):
        if value is not None and not isinstance(value, cls):
            raise errors.ShardingTypeError(
                f"{api}: {arg} must be a funshard.{cls.__name__} (or None for the "
                f"default), got {type(value).__name__}; wrap the function: "
                f"{arg}=fs.{cls.__name__}(fn)."
            )


def wire_label(custom: AllGather | ReduceScatter | None, label: str) -> str:
    """The dtype label of a collective as `custom` declares it."""
    return custom.label if custom is not None and custom.label is not None else label


def run(
    kind: str,
    custom: AllGather | ReduceScatter,
    buffer: jax.Array,
    axes: tuple[str, ...],
    expected: tuple[int, ...],
    unit: str,
) -> jax.Array:
    """`custom.fn(buffer, axes)`, its result checked against the default's shape and dtype."""
    out = custom.fn(buffer, axes)
    shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
    if shape is None or tuple(shape) != expected or dtype != buffer.dtype:
        got = (
            f"{type(out).__name__}"
            if shape is None
            else f"shape {tuple(shape)} {np.dtype(dtype).name if dtype is not None else ''}"
        )
        raise errors.ShardingValueError(
            f"unit {unit!r}: its custom {kind} returned {got}, but the default returns shape "
            f"{expected} {buffer.dtype.name} for this buffer of shape {tuple(buffer.shape)} "
            f"over mesh axes {axes}; return "
            + (
                "every device's block in device order (what jax.lax.all_gather(block, "
                "axes, tiled=True) returns)."
                if kind == "all-gather"
                else "this device's summed shard (what jax.lax.psum_scatter(buffer, axes, "
                "tiled=True) returns)."
            )
        )
    return out
