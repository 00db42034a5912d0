"""Tensor- and expert-parallel building blocks for a loss that runs per device.

Inside `fs.value_and_grad` the loss sees each leaf's model block (`Sharded.block_shape`):
a column-parallel kernel's columns of this `tensor` rank, a stack of this `expert` rank's
experts. These helpers write the model axes' collectives explicitly, as everything in
funshard is, with `jax.lax`: what a Megatron block or a GShard MoE layer needs and no
more. The backward collectives follow from JAX's own typing of values inside
`jax.shard_map`: an activation replicated over `tensor` that meets a column-split kernel
gets its cotangent summed over `tensor` (Megatron's "f"), a `psum` transposes to
nothing more (Megatron's "g"). With `sequence_axis=`, the two linears are Megatron's
sequence parallelism: the activations between them (residual stream, norms) are split
over `tensor` along the sequence, `column_parallel` all-gathers them and `row_parallel`
reduce-scatters (`jax.lax.psum_scatter`) instead of summing, each the other's transpose.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from funshard import comm, errors
from funshard._jax_compat import varying_axes

TENSOR_AXIS = "tensor"
EXPERT_AXIS = "expert"


def _sequence_dim_error(fn: str, sequence_axis: object, ndim: int) -> str:
    return (
        f"{fn}: sequence_axis={sequence_axis!r} is not a dim of the activations' leading "
        f"dims (x has {ndim} dims; the last is the features the kernel contracts); pass the "
        "index of the sequence dim, e.g. sequence_axis=1 for (batch, seq, features)."
    )


def _check_sequence_axis(fn: str, x: jax.Array, sequence_axis: int) -> int:
    """`sequence_axis` as a non-negative dim of `x`'s leading (non-feature) dims."""
    ndim = x.ndim
    if isinstance(sequence_axis, bool) or not isinstance(sequence_axis, int):
        raise errors.ShardingTypeError(_sequence_dim_error(fn, sequence_axis, ndim))
    if not -ndim <= sequence_axis < ndim - 1 or sequence_axis == -1:
        raise errors.ShardingValueError(_sequence_dim_error(fn, sequence_axis, ndim))
    return sequence_axis % ndim


def _replicated_input_error(axis: str, dim: int) -> str:
    return (
        f"column_parallel: with sequence_axis={dim}, x must be this device's part of the "
        f"sequence, split over {axis!r} (a row_parallel(..., sequence_axis={dim}) output, "
        f"or a slice of an activation replicated over {axis!r}); this x is the same on "
        f"every device of {axis!r}. Drop sequence_axis, or slice x first."
    )


def _gather_sequence(x: jax.Array, axis: str, dim: int) -> jax.Array:
    return jax.lax.all_gather(x, axis, axis=dim, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _gathered_matmul(x: jax.Array, kernel: jax.Array, axis: str, dim: int) -> jax.Array:
    return _gather_sequence(x, axis, dim) @ kernel


def _gathered_matmul_fwd(x, kernel, axis, dim):
    # Megatron-SP keeps the sequence-split input for the backward pass, not its
    # all-gathered copy (t times larger), and gathers it again there.
    return _gathered_matmul(x, kernel, axis, dim), (x, kernel)


def _gathered_matmul_bwd(axis, dim, residuals, ct):
    x, kernel = residuals
    # Tied to the cotangent, so that XLA cannot merge the re-gather with the forward one.
    full = _gather_sequence(comm.tie_to(x, ct), axis, dim)
    ct_x = jax.lax.psum_scatter(ct @ kernel.T, axis, scatter_dimension=dim, tiled=True)
    lead = "".join(chr(ord("a") + i) for i in range(x.ndim - 1))
    ct_kernel = jnp.einsum(f"{lead}i,{lead}o->io", full, ct)
    return ct_x.astype(x.dtype), ct_kernel.astype(kernel.dtype)


_gathered_matmul.defvjp(_gathered_matmul_fwd, _gathered_matmul_bwd)


def column_parallel(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    sequence_axis: int | None = None,
    axis: str = TENSOR_AXIS,
) -> jax.Array:
    """`x @ kernel + bias` with `kernel` split over a model axis on its last dim.

    Args:
      x: activations replicated over the model axis, `(..., d_in)`; with
        `sequence_axis`, this device's part of the sequence, split over `axis` along
        that dim (Megatron's sequence parallelism).
      kernel: this device's columns, `(d_in, d_out / t)` (a leaf sharded with
        `model_spec=P(None, "tensor")`, gathered by `fs.unshard` or a unit).
      bias: this device's part of the bias, `(d_out / t,)`, or None.
      sequence_axis: None (the default): `x` is whole on every device of `axis`. An
        int: the dim of `x` split over `axis`; `x` is all-gathered along it over `axis`
        before the matmul (its gradient a reduce-scatter), and the backward pass
        gathers it again instead of keeping the gathered copy.
      axis: the model axis `kernel` (and, with `sequence_axis`, `x`) is split over;
        used only with `sequence_axis`.

    Returns:
      This device's columns of the output, `(..., d_out / t)`, over the whole sequence,
      split over the model axis as the kernel is. Without `sequence_axis` no
      communication forward; backward, the gradient of `x` is summed over the model
      axis by JAX itself.

    Raises:
      TypeError: `sequence_axis` is not an int.
      ValueError: `sequence_axis` is not one of `x`'s leading dims, or `x` does not
        vary over `axis` (it is not split).
    """
    if sequence_axis is not None:
        dim = _check_sequence_axis("column_parallel", x, sequence_axis)
        if axis not in varying_axes(x):
            raise errors.ShardingValueError(_replicated_input_error(axis, dim))
        # One type for both, so that the backward rule's gradients have their inputs'.
        both = sorted(varying_axes(x) | varying_axes(kernel))
        y = _gathered_matmul(comm.vary(x, both), comm.vary(kernel, both), axis, dim)
    else:
        y = x @ kernel
    return y if bias is None else y + bias


def _sequence_length_error(length: int, size: int, axis: str, dim: int) -> str:
    return (
        f"row_parallel: sequence_axis={dim} has length {length}, which the {size} devices "
        f"of {axis!r} cannot split evenly; use a sequence length that {size} divides "
        "(pad the sequence), or drop sequence_axis."
    )


def row_parallel(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    axis: str = TENSOR_AXIS,
    sequence_axis: int | None = None,
) -> jax.Array:
    """`x @ kernel + bias` with `kernel` split over `axis` on its first dim.

    Args:
      x: this device's columns of the input, `(..., d_in / t)` (a `column_parallel`
        output).
      kernel: this device's rows, `(d_in / t, d_out)` (`model_spec=P("tensor", None)`).
      bias: the whole bias, `(d_out,)` (replicated over `axis`), or None.
      axis: the model axis (or axes) `kernel` is split over.
      sequence_axis: None (the default): the partial products are summed with one
        `jax.lax.psum` over `axis`. An int: they are reduce-scattered along that dim
        (`jax.lax.psum_scatter`), so each device of `axis` gets its own part of the
        sequence, summed (Megatron's sequence parallelism; its gradient an all-gather).

    Returns:
      Without `sequence_axis`, the full output, `(..., d_out)`, equal on every device
      of `axis`. With it, this device's `1/t` of the sequence dim of that output, split
      over `axis` (device `i` holds the `i`-th block).

    Raises:
      TypeError: `sequence_axis` is not an int.
      ValueError: `sequence_axis` is not one of `x`'s leading dims, or the size of
        `axis` does not divide its length.
    """
    y = x @ kernel
    if sequence_axis is None:
        y = jax.lax.psum(y, axis)
    else:
        dim = _check_sequence_axis("row_parallel", x, sequence_axis)
        size = jax.lax.axis_size(axis)
        if y.shape[dim] % size:
            raise errors.ShardingValueError(_sequence_length_error(y.shape[dim], size, axis, dim))
        y = jax.lax.psum_scatter(y, axis, scatter_dimension=dim, tiled=True)
    return y if bias is None else y + bias


def gather_columns(x: jax.Array, *, axis: str = TENSOR_AXIS) -> jax.Array:
    """The full last dim of `x` split over `axis` (e.g. vocabulary-parallel logits).

    An all-gather over `axis` whose result is the same on every device of `axis` (typed
    so: a loss computed from it needs no further combining). Its gradient is this
    device's columns of the cotangent, which every device of `axis` computes whole.
    """
    return jax.lax.all_gather(x, axis, axis=x.ndim - 1, tiled=True, to="invarying")


def _bad_top_k(k: int, experts: int) -> str:
    return (
        f"route_top_k: k={k} must be between 1 and the number of experts ({experts}); "
        "pick how many experts each token goes to."
    )


def route_top_k(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Top-k routing: each token's `k` experts and their softmax weights.

    Args:
      logits: router logits `(tokens, experts)`.
      k: experts per token.

    Returns:
      `(experts, weights)`, both `(tokens, k)`: expert indices (int32) and the
      softmax probabilities of those experts, renormalised over the `k` chosen.

    Raises:
      ValueError: `k` is not between 1 and the number of experts.
    """
    experts = logits.shape[-1]
    if not 1 <= k <= experts:
        raise errors.ShardingValueError(_bad_top_k(k, experts))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, index = jax.lax.top_k(probs, k)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return index.astype(jnp.int32), weights.astype(logits.dtype)


def _dispatch_mask(index: jax.Array, experts: int, capacity: int) -> jax.Array:
    """One-hot `(tokens, k, experts, capacity)`: where each routed copy of a token goes.

    Slots are given in token order, first choices before second ones (GShard); a copy
    past an expert's `capacity` is dropped (all zeros).
    """
    tokens, k = index.shape
    # First choices of every token, then second choices, ...: (k * tokens, experts).
    onehot = jax.nn.one_hot(index.T.reshape(-1), experts, dtype=jnp.int32)
    slot = jnp.cumsum(onehot, axis=0) * onehot - 1
    kept = jax.nn.one_hot(jnp.max(slot, axis=-1), capacity, dtype=jnp.float32)
    kept = kept[:, None, :] * onehot[:, :, None]  # (k * tokens, experts, capacity)
    return kept.reshape(k, tokens, experts, capacity).transpose(1, 0, 2, 3)


def _bad_experts(experts: int, size: int, axis: str) -> str:
    return (
        f"expert_dispatch: {experts} experts cannot be split over the {size} devices of "
        f"{axis!r}; use a number of experts that {size} divides."
    )


def expert_dispatch(
    x: jax.Array,
    index: jax.Array,
    experts: int,
    *,
    capacity: int | None = None,
    axis: str = EXPERT_AXIS,
) -> tuple[jax.Array, jax.Array]:
    """Sends each token to the devices that hold its experts (one `all_to_all`).

    Args:
      x: this device's tokens, `(tokens, d)`.
      index: each token's experts, `(tokens, k)` (from `route_top_k`).
      experts: the number of experts in all.
      capacity: slots per expert for this device's tokens; copies past it are dropped.
        The default, `tokens * k`, drops none (exact, as a dense computation).
      axis: the model axis the expert stack is split over.

    Returns:
      `(inputs, mask)`: `inputs` is `(experts / e, e * capacity, d)`, the tokens each of
      this device's experts receives from every device of `axis`, and `mask` the
      dispatch mask `expert_combine` needs.

    Raises:
      ValueError: the axis size does not divide `experts`.
    """
    size = jax.lax.axis_size(axis)
    if experts % size:
        raise errors.ShardingValueError(_bad_experts(experts, size, axis))
    tokens, k = index.shape
    capacity = tokens * k if capacity is None else capacity
    mask = _dispatch_mask(index, experts, capacity)
    routed = jnp.einsum("tkec,td->ecd", mask.astype(x.dtype), x)
    return jax.lax.all_to_all(routed, axis, 0, 1, tiled=True), mask


def expert_combine(
    outputs: jax.Array, mask: jax.Array, weights: jax.Array, *, axis: str = EXPERT_AXIS
) -> jax.Array:
    """Brings the experts' outputs back to their tokens and mixes them by `weights`.

    Args:
      outputs: what this device's experts computed, `(experts / e, e * capacity, d)`.
      mask: the dispatch mask `expert_dispatch` returned.
      weights: each token's routing weights, `(tokens, k)`.
      axis: the model axis the expert stack is split over.

    Returns:
      `(tokens, d)`: each token's weighted sum of its experts' outputs (dropped copies
      count zero).
    """
    back = jax.lax.all_to_all(outputs, axis, 1, 0, tiled=True)  # (experts, capacity, d)
    combine = mask.astype(outputs.dtype) * weights[:, :, None, None].astype(outputs.dtype)
    return jnp.einsum("tkec,ecd->td", combine, back)
