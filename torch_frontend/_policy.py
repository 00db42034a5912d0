"""FSDP2's mixed-precision policy, with torch dtypes."""

from __future__ import annotations

import dataclasses

import torch

from funshard import errors


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Module-level mixed precision, with `torch.distributed.fsdp.MixedPrecisionPolicy`'s fields.

    Attributes:
      param_dtype: dtype of the unsharded parameters, hence of the all-gather and of the
        forward / backward computation. None keeps each parameter's own dtype. The
        sharded parameters (what the optimizer updates) always keep their own dtype.
      reduce_dtype: dtype the gradients are reduce-scattered in. None means
        `param_dtype` (or the parameter's own dtype without one). Gradients
        accumulated without synchronisation are kept in this dtype too.
      output_dtype: dtype the module's floating-point outputs are cast to (None: no cast).
      cast_forward_inputs: cast the module's floating-point inputs to `param_dtype`.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise errors.ShardingTypeError(_bad_dtype(name, value))
        if not isinstance(self.cast_forward_inputs, bool):
            raise errors.ShardingTypeError(
                f"MixedPrecisionPolicy: cast_forward_inputs={self.cast_forward_inputs!r} must "
                "be True or False."
            )


def _bad_dtype(name: str, value) -> str:
    return (
        f"MixedPrecisionPolicy: {name}={value!r} must be None or a floating torch.dtype "
        "such as torch.bfloat16."
    )


def cast_floating(dtype: torch.dtype | None, x):
    """`x` cast to `dtype` when it is a floating tensor of another dtype, else `x` itself."""
    if dtype is None or not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return x
    return x if x.dtype == dtype else x.to(dtype)
