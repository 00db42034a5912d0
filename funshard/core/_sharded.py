"""The `Sharded` leaf: a dim-0 sharded, zero-padded array with static logical metadata."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from funshard import _py_compat, comm, errors
from funshard._custom_vjp import is_array as is_array
from funshard.core import _misuse
from funshard.core._policy import MixedPrecisionPolicy


def _refusal(method: str):
    """A special method that refuses a `Sharded` leaf used as an array, naming where."""

    def refuse(self, *args, **kwargs):
        frame = _py_compat.calling_frame()
        raise errors.ShardingTypeError(_misuse.message(method, self, frame))

    refuse.__name__ = method
    return refuse


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sharded(comm.LayoutFacts):
    """One parameter, sharded on dim 0 across the data-parallel devices.

    A registered pytree node: its only child is `data`, the padded global array, so
    `jax.jit`, `jax.grad`, `jax.tree.map` and optax see one array leaf. Everything
    else is static metadata (so `jit` caches per layout).

    Device i of the shard axes holds rows `[i * r, (i + 1) * r)` of `data`, where
    `r = ceil(shape[0] / N)`: the rows `torch.chunk(x, N)[i]` would give, followed by
    zero rows up to `r`. Padding rows are zeros and stay zero through training (their
    gradient is exactly zero).

    Attributes:
      data: the padded global array of shape `(N * r, *shape[1:])`, sharded
        `P(shard_axis)` (replicated over `replicate_axis`). Inside a
        `funshard.value_and_grad` step the leaf holds this device's local
        `(r, *shape[1:])` block; reading `.data` in the loss function there is a
        TypeError (it is easily mistaken for the parameter), `jax.tree.leaves(leaf)[0]`
        takes the block on purpose. Reading `.data` of a leaf whose buffers a jitted call
        donated raises RuntimeError.
      shape: the logical (unpadded) shape.
      dtype: the logical dtype (that of `data`).
      mesh: the mesh the data lives on.
      shard_axis: mesh axes dim 0 is split over.
      replicate_axis: mesh axes the shards are replicated over (HSDP); may be empty.
      mp_policy: the mixed-precision policy for gathers and gradient reductions.
      dim: the sharded dimension: 0, another dim a placement chose (which must then
        divide evenly), or 1 for stacked layers (`shard(..., stacked=True)`, padded
        per layer like dim 0).
      model_axes: per dim, the model axes (tensor, expert, ...) that split it before
        FSDP shards it (`shard(..., model_spec=...)`); `()` for a plain FSDP leaf. Inside
        a step the leaf holds, gathers and reduces only this device's model block
        (`block_shape`).
    """

    data: Any
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    dtype: np.dtype = dataclasses.field(metadata=dict(static=True))
    mesh: Mesh = dataclasses.field(metadata=dict(static=True))
    shard_axis: tuple[str, ...] = dataclasses.field(metadata=dict(static=True))
    replicate_axis: tuple[str, ...] = dataclasses.field(metadata=dict(static=True), default=())
    mp_policy: MixedPrecisionPolicy | None = dataclasses.field(
        metadata=dict(static=True), default=None
    )
    dim: int = dataclasses.field(metadata=dict(static=True), default=0)
    model_axes: tuple[tuple[str, ...], ...] = dataclasses.field(
        metadata=dict(static=True), default=()
    )

    def __post_init__(self):
        # `jax.eval_shape` drops the sharding of outputs on a mesh with Auto axes; the
        # layout fixes where a global abstract `data` lives, so an abstract state says
        # it (as `jax.jit(..., out_shardings=...)` and `fs.restore` need).
        data = self.data
        if (
            isinstance(data, jax.ShapeDtypeStruct)
            and data.sharding is None
            and tuple(data.shape) == self.padded_shape
        ):
            abstract = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=self.sharding)
            object.__setattr__(self, "data", abstract)

    @property
    def layout(self) -> comm.Layout:
        """This leaf's `funshard.comm.Layout` (its static fields)."""
        return comm.Layout(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(comm.Layout)}
        )

    @classmethod
    def from_layout(cls, layout: comm.Layout, data: Any) -> Sharded:
        """The leaf holding `data` (the padded global array) in `layout`."""
        return cls(data, **{f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)})

    def __repr__(self) -> str:
        # One line of layout: a model's state holds hundreds of these, and printing
        # `data` would dump every parameter (tens of KB for a small model).
        fields = [
            f"shape={self.shape}",
            f"dtype={np.dtype(self.dtype).name}",
            f"rows_per_shard={self.rows_per_shard}",
            f"shard_axis={self.shard_axis}",
        ]
        if self.dim:
            fields.append(f"dim={self.dim}")
        if self.replicate_axis:
            fields.append(f"replicate_axis={self.replicate_axis}")
        if self.model_axes:
            fields.append(f"model_spec={self.model_spec}")
        fields.append(f"mesh={dict(self.mesh.shape)}")
        if self.mp_policy is not None:
            fields.append(f"mp_policy={self.mp_policy}")
        return f"Sharded({', '.join(fields)})"

    # numpy defers binary operators to the reflected methods (`_REFUSED`, below) instead
    # of converting this object through __array__.
    __array_ufunc__ = None


# A Sharded leaf in user math is a forgotten fs.unshard; refuse instead of letting jnp /
# numpy compute on the padded local rows or an object array.
_REFUSED = (
    "__jax_array__", "__array__", "__getitem__", "__iter__",
    "__neg__", "__pos__", "__abs__", "__invert__",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
    "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__",
    "__mod__", "__rmod__", "__pow__", "__rpow__", "__matmul__", "__rmatmul__",
)  # fmt: skip
for _method in _REFUSED:
    setattr(Sharded, _method, _refusal(_method))


def _sharded_deleted(shape, dtype) -> str:
    return (
        f"Array has been deleted: fs.Sharded leaf of shape {tuple(shape)} and dtype "
        f"{dtype} was donated to a jitted call (donate_argnums) or deleted, so its "
        "buffers are gone. Use the state that call returned (state, ... = step(state, "
        "...)), or do not donate a state you still need."
    )


def _live_data(self) -> Any:
    # Reached by every read of `.data`, jax's own flattening included (jit's argument
    # handling reads the field through getattr): a jitted call given a state whose
    # buffers it donated before would segfault in XLA on a multi-device mesh (jax 0.10:
    # one device's "Buffer has been deleted or donated" error, the others crash).
    data = self.__dict__["data"]
    concrete = _CONCRETE.get(type(data))  # inline: `is_concrete` is a call per read
    if concrete is None:
        concrete = is_concrete(data)
    if concrete and data.is_deleted():
        raise RuntimeError(_sharded_deleted(self.shape, self.dtype))
    return data


def is_concrete(data: Any) -> bool:
    """Whether `data` is a concrete `jax.Array` (one with buffers), not a tracer or a
    stand-in. Called on every read of a leaf's `.data`: cached per type."""
    kind = type(data)
    concrete = _CONCRETE.get(kind)
    if concrete is None:  # once per type: tracers are jax.Arrays too, without buffers
        concrete = _CONCRETE[kind] = isinstance(data, jax.Array) and not isinstance(
            data, jax.core.Tracer
        )
    return concrete


# Type of a `data` value -> whether it is a concrete jax.Array (whose buffers a donation
# deletes). Looked up per read: a dict hit is far cheaper than two isinstance checks.
_CONCRETE: dict[type, bool] = {}


def _set_data(self, value: Any) -> None:
    self.__dict__["data"] = value  # the dataclass __init__ (object.__setattr__) lands here


# After the dataclass is made, so that `data` stays a required field: a data descriptor
# on the class wins over the instance's __dict__ in attribute lookup.
Sharded.data = property(
    _live_data,
    _set_data,
    doc="The padded global array. Reading it raises RuntimeError once a jitted call has "
    "donated it (and, on a step's leaf, TypeError in a loss function: see the class).",
)


def is_sharded(x: Any) -> bool:
    """Whether `x` is a `Sharded` leaf (used as `is_leaf` in tree walks)."""
    return isinstance(x, Sharded)


def is_key(x: Any) -> bool:
    """Whether `x` is an array of typed PRNG keys (`jax.random.key`), concrete or abstract."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
