"""The root's options, each checked in one place.

`value_and_grad`, `fs.plan` and the units read the same options (`microbatches`,
`trainable`, `reshard_after_forward`, ...); each has one check here, with one message
that names the function it was passed to (`fn`) and says how to fix it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from funshard import comm, errors
from funshard.core._policy import MixedPrecisionPolicy
from funshard.core._sharded import is_sharded


@dataclasses.dataclass(frozen=True)
class RootOptions:
    """The root's static choices (see `funshard.value_and_grad`), checked.

    Attributes:
      microbatches: microbatches per step (1: no accumulation).
      sync_every_microbatch: reduce-scatter every microbatch's gradients (else
        accumulate them unreduced and reduce-scatter once after the last one).
      all_reduce_every_microbatch: HSDP: all-reduce over the replicate axes in every
        microbatch (else once after the last one).
      gradient_divide_factor: what the gradients' sum over the devices is divided by
        (None: the data-parallel world size).
      has_aux: the loss function returns `(loss, aux)`.
      per_device_keys: make each draw that scales with the batch this device's rows of
        the draw on the global batch (funshard/core/_random.py); False draws as written.
    """

    microbatches: int = 1
    sync_every_microbatch: bool = True
    all_reduce_every_microbatch: bool = True
    gradient_divide_factor: float | None = None
    has_aux: bool = False
    per_device_keys: bool = True


def root_options(
    fn: str,
    *,
    microbatches: int = 1,
    sync_every_microbatch: bool = True,
    all_reduce_every_microbatch: bool = True,
    gradient_divide_factor: float | None = None,
    has_aux: bool = False,
    per_device_keys: bool = True,
) -> RootOptions:
    """The root's options as `fn` received them, each checked (see `RootOptions`)."""
    check_microbatches(fn, microbatches)
    check_gradient_divide_factor(fn, gradient_divide_factor)
    check_flag(fn, "sync_every_microbatch", sync_every_microbatch)
    check_flag(fn, "all_reduce_every_microbatch", all_reduce_every_microbatch)
    check_flag(fn, "per_device_keys", per_device_keys)
    return RootOptions(
        microbatches,
        sync_every_microbatch,
        all_reduce_every_microbatch,
        gradient_divide_factor,
        has_aux,
        per_device_keys,
    )


def check_microbatches(fn: str, value: Any) -> None:
    """`microbatches`: an int >= 1, or a clear error."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise errors.ShardingValueError(_microbatches_invalid(fn, value))


def _microbatches_invalid(fn: str, value) -> str:
    return (
        f"{fn}: microbatches must be an int >= 1, got {value!r}; pass e.g. "
        "microbatches=4 (1: no accumulation)."
    )


def check_gradient_divide_factor(fn: str, value: Any) -> None:
    """`gradient_divide_factor`: None or a positive number, or a clear error."""
    if value is not None and not value > 0:
        raise errors.ShardingValueError(_gradient_divide_factor_invalid(fn, value))


def _gradient_divide_factor_invalid(fn: str, value) -> str:
    return (
        f"{fn}: gradient_divide_factor must be a positive number, got {value!r}; "
        "pass e.g. the data-parallel world size, or None for the default."
    )


def check_flag(fn: str, name: str, value: Any) -> None:
    """An option that must be a bool (`sync_every_microbatch`, ...), or a clear error."""
    if not isinstance(value, bool):
        raise errors.ShardingTypeError(_flag_not_bool(fn, name, value))


def _flag_not_bool(fn: str, name: str, value) -> str:
    return f"{fn}: {name} must be a bool, got {value!r}; pass True or False."


def check_mp_policy(fn: str, policy: Any) -> None:
    """`mp_policy`: an `fs.MixedPrecisionPolicy` or None, or a clear error."""
    if policy is not None and not isinstance(policy, MixedPrecisionPolicy):
        raise errors.ShardingTypeError(_bad_mp_policy(fn, policy))


def _bad_mp_policy(fn: str, policy) -> str:
    return (
        f"{fn}: mp_policy must be an fs.MixedPrecisionPolicy or None, got "
        f"{type(policy).__name__}; build one with fs.MixedPrecisionPolicy(param_dtype=...)."
    )


def check_reshard_after_forward(fn: str, value: Any, num_shards: int | None = None) -> None:
    """FSDP2's `reshard_after_forward: bool | int` (an int k >= 1), or a clear error.

    With `num_shards`, an int k must also divide it: hpZ keeps the parameters sharded
    over groups of k of the shards.
    """
    if not isinstance(value, int):
        raise errors.ShardingTypeError(_bad_reshard_after_forward(fn, value))
    if isinstance(value, bool):
        return
    if value < 1:
        raise errors.ShardingValueError(_bad_reshard_after_forward(fn, value))
    if num_shards is not None:
        comm.check_group_size(fn, value, num_shards)


def _bad_reshard_after_forward(fn: str, value) -> str:
    return (
        f"{fn}: reshard_after_forward must be True, False or a positive int (hpZ "
        f"group size), got {value!r}; pass True to free the gathered parameters after "
        "the forward, False to keep them, or k to keep them sharded over groups of k."
    )


def trainable_flags(fn: str, trainable: Any, state: Any) -> list[bool]:
    """`trainable` read as one flag per leaf of `state` (`Sharded` leaves whole).

    Raises:
      ShardingValueError: `trainable` is not a pytree prefix of `state`.
    """
    if trainable is None:
        return [True] * len(jax.tree.leaves(state, is_leaf=is_sharded))
    try:
        expanded = jax.tree.map(
            lambda flag, sub: jax.tree.map(lambda _: bool(flag), sub, is_leaf=is_sharded),
            trainable,
            state,
            is_leaf=lambda x: x is None,
        )
    except (ValueError, TypeError) as exc:
        raise errors.ShardingValueError(_trainable_mismatch(fn, exc)) from exc
    return jax.tree.leaves(expanded, is_leaf=is_sharded)


def _trainable_mismatch(fn: str, exc: BaseException) -> str:
    return (
        f"{fn}: `trainable` must be a pytree prefix of the state with a bool at each "
        f"leaf or subtree ({exc}). E.g. {{'encoder': False, 'head': True}}."
    )
