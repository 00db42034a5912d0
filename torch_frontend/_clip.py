"""`clip_grad_norm_` over the global gradient norm of sharded parameters."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from funshard import errors
from torch_frontend import _bridge
from torch_frontend._param import managed

logger = logging.getLogger("torch_frontend")  # silent unless configured (see _group.py)


def _local(grad: torch.Tensor) -> torch.Tensor:
    # A managed shard's gradient is a DTensor: its local rows are this rank's part.
    return grad._local_tensor if isinstance(grad, DTensor) else grad


def _local_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The `norm_type` norm of all of `grads` together (0 without elements), in float32."""
    norms = [
        torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32)
        for g in grads
        if g.numel()
    ]
    if not norms:
        return torch.zeros((), dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def _split_dims(param: torch.Tensor) -> tuple[DeviceMesh, tuple[int, ...]]:
    """A tensor-parallel shard's mesh and the dims whose ranks hold distinct blocks of it
    (Shard placements; Replicate dims hold copies, counted once)."""
    assert isinstance(param, DTensor), "a managed tensor-parallel parameter is a DTensor"
    dims = tuple(i for i, p in enumerate(param.placements) if isinstance(p, (Shard, _StridedShard)))
    return param.device_mesh, dims


def _split_norms(
    split: dict[tuple[DeviceMesh, tuple[int, ...]], list[torch.Tensor]], norm_type: float
) -> list[torch.Tensor]:
    """The norm of each set of tensor-parallel shards over all their blocks: this rank's
    norm reduced by torch over each dim that splits them (sum of powers, or max)."""
    norms = []
    for (mesh, dims), grads in split.items():
        norm = _local_norm(grads, norm_type).reshape(1).clone()
        power = not math.isinf(norm_type)
        if power:
            norm = norm.pow(norm_type)
        op = dist.ReduceOp.SUM if power else dist.ReduceOp.MAX
        for dim in dims:
            dist.all_reduce(norm, op=op, group=mesh.get_group(dim))
        norms.append((norm.pow(1.0 / norm_type) if power else norm).reshape(()))
    return norms


def _gathered_norms(
    partials: dict[_bridge.RankLayout, list[torch.Tensor]], norm_type: float
) -> list[torch.Tensor]:
    """Each layout's norm over every rank's shards: one row per rank, one all-gather."""
    pending = []
    for layout, grads in partials.items():
        row = _local_norm(grads, norm_type).reshape(1, 1).clone()  # own, aligned storage
        block = _bridge.global_block(layout, row)
        if logger.isEnabledFor(logging.DEBUG):
            _log_norm_gather(layout, grads, norm_type)
        pending.append(_bridge.start_all_gather(layout, [block], [layout.world]))
    return [
        torch.linalg.vector_norm(_bridge.finish_all_gather(f)[0].reshape(-1), norm_type)
        for f in pending
    ]


def _log_norm_gather(
    layout: _bridge.RankLayout, grads: list[torch.Tensor], norm_type: float
) -> None:
    logger.debug(
        "clip_grad_norm_: all-gather over %d ranks of this rank's norm (order %s) of %d "
        "gradient shard(s), %d elements: the global norm's reduction",
        layout.world,
        norm_type,
        len(grads),
        sum(g.numel() for g in grads),
    )


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clips gradients by their global norm across ranks, as torch's own on one model.

    `torch.nn.utils.clip_grad_norm_` on the unsharded model gives the same norm and
    the same clipped gradients.

    Each rank's local shards contribute their norm (padding is not part of a shard);
    one all-gather per mesh layout brings every rank's norm, over the shard axis only
    (on an HSDP mesh the replicas hold identical reduced gradients). A tensor-parallel
    parameter's norm is reduced by torch over the dims of its DTensor that split it
    (data-parallel and TP; replicated dims count once), as torch's own does on DTensors.
    Parameters that no `fully_shard` manages count once, as replicated. Every process
    must call it with the same parameters.

    Args:
      parameters: the local shards (e.g. `model.parameters()`) or one tensor.
      max_norm: the largest total norm the gradients keep.
      norm_type: the order of the norm, a positive number or `float("inf")`.
      error_if_nonfinite: raise if the total norm is nan or infinite.
      foreach: accepted for torch's signature; the scaling is elementwise either way.

    Returns:
      The total norm of the gradients before clipping, a 0-d tensor (float32).

    Raises:
      ValueError: `norm_type` is not positive.
      RuntimeError: `error_if_nonfinite` and the total norm is not finite.
    """
    del foreach
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise errors.ShardingValueError(_bad_norm_type(norm_type))
    partials: dict[_bridge.RankLayout, list[torch.Tensor]] = {}
    split: dict[tuple[DeviceMesh, tuple[int, ...]], list[torch.Tensor]] = {}
    replicated: list[torch.Tensor] = []
    for param in params:
        owner = managed(param)
        # Every managed layout gathers, with or without gradients: each process runs
        # the same collectives. A tensor-parallel shard's norm is reduced by torch over
        # the dims of its DTensor that split it (data-parallel and TP alike).
        if owner is None:
            grads = replicated
        elif owner.tensor_parallel:
            grads = split.setdefault(_split_dims(owner.sharded_param), [])
        else:
            grads = partials.setdefault(owner.layout, [])
        if param.grad is not None:
            grads.append(_local(param.grad))
    norms = _gathered_norms(partials, norm_type) + _split_norms(split, norm_type)
    if replicated:
        norms.append(_local_norm(replicated, norm_type))
    total = (
        torch.linalg.vector_norm(torch.stack(norms), norm_type)
        if norms
        else torch.zeros((), dtype=torch.float32)
    )
    if error_if_nonfinite and not math.isfinite(total.item()):
        raise RuntimeError(_nonfinite_norm(norm_type))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for grads in (*partials.values(), *split.values(), replicated):
            for grad in grads:
                grad.mul_(coef.to(grad.dtype))
    return total


def _bad_norm_type(norm_type) -> str:
    return (
        f"clip_grad_norm_: norm_type={norm_type!r} is not supported; pass a positive "
        "number (2.0 is the default) or float('inf')."
    )


def _nonfinite_norm(norm_type) -> str:
    return (
        f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
        "non-finite, so it cannot be clipped. To scale the gradients by the non-finite "
        "norm anyway, set error_if_nonfinite=False."
    )
