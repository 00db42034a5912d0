"""Mixed-precision policy: which dtypes the collectives and the unit's compute use."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from funshard import errors


def _policy_dtype(field: str, value: Any, problem: str) -> str:
    return (
        f"MixedPrecisionPolicy: {field}={value!r} {problem}; use a floating dtype such as "
        "jnp.bfloat16, jnp.float16 or jnp.float32, or None to keep the parameter's dtype."
    )


def _as_float_dtype(field: str, value: Any) -> np.dtype | None:
    if value is None:
        return None
    try:
        dtype = np.dtype(value)
    except TypeError as exc:
        raise errors.ShardingTypeError(_policy_dtype(field, value, "is not a dtype")) from exc
    if not jnp.issubdtype(dtype, jnp.floating):
        raise errors.ShardingValueError(_policy_dtype(field, value, "is not a floating dtype"))
    if dtype.itemsize < 2:
        raise errors.ShardingValueError(_policy_narrow_float(field, dtype))
    return dtype


def _policy_narrow_float(field: str, dtype: np.dtype) -> str:
    finfo = jnp.finfo(dtype)
    return (
        f"MixedPrecisionPolicy: {field}={dtype.name} is an {finfo.bits}-bit float (largest "
        f"value {float(finfo.max):g}, {finfo.nmant} mantissa bits). The policy casts without "
        "scaling: parameters beyond that range would become NaN or saturate, small ones "
        "flush to zero, and gradients summed over the devices in 8 bits keep almost no "
        "precision, so the step would not train what the unsharded model does. FSDP2 "
        "gathers float8 only with per-tensor scales (torchao's Float8Linear). Use "
        "jnp.bfloat16 or jnp.float16 here, and run float8 matmuls with their own scales "
        "inside the model (e.g. jax.nn.scaled_matmul)."
    )


def _policy_flag_not_bool(field: str, value) -> str:
    return f"MixedPrecisionPolicy: {field} must be a bool, got {value!r}; pass True or False."


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed-precision policy, with the same field names and meanings.

    Attached to the state by `funshard.shard`; every collective and `fully_shard` unit
    reads it from the `Sharded` leaves it works on. The sharded parameters (and so the
    optimizer) always keep their original dtype: these are fp32 master weights.

    Attributes:
      param_dtype: dtype the parameters are all-gathered in and the unit computes with.
        `None` keeps each parameter's own dtype.
      reduce_dtype: dtype gradients are reduce-scattered (and all-reduced for HSDP) in.
        `None` means `param_dtype`.
      output_dtype: dtype the floating outputs of a `fully_shard` unit are cast to.
        `None` leaves outputs alone.
      cast_forward_inputs: whether a `fully_shard` unit casts its floating inputs to
        `param_dtype` before running.

    Raises:
      TypeError: a field is not a dtype.
      ValueError: a field is a dtype that is not floating (e.g. int32), or an 8-bit (or
        narrower) float such as `jnp.float8_e4m3fn`, which an unscaled cast would
        overflow (NaN beyond 448) and reduce without precision.
    """

    param_dtype: Any = None
    reduce_dtype: Any = None
    output_dtype: Any = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            object.__setattr__(self, field, _as_float_dtype(field, getattr(self, field)))
        if not isinstance(self.cast_forward_inputs, bool):
            flag = self.cast_forward_inputs
            raise errors.ShardingTypeError(_policy_flag_not_bool("cast_forward_inputs", flag))


def param_dtype_for(policy: MixedPrecisionPolicy | None, dtype: np.dtype) -> np.dtype:
    """The dtype a leaf of `dtype` is gathered in (non-floating leaves are never cast)."""
    if policy is None or policy.param_dtype is None:
        return dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        return dtype
    return policy.param_dtype


def reduce_dtype_for(policy: MixedPrecisionPolicy | None, dtype: np.dtype) -> np.dtype:
    """The dtype a floating leaf's gradient is reduced in."""
    if policy is not None and policy.reduce_dtype is not None:
        return policy.reduce_dtype
    return param_dtype_for(policy, dtype)
