"""`check`: one step of an FSDP module, its collectives beside those its policy declares.

The torch counterpart of `funshard.check`, with the same report (`funshard.StepReport`).
Nothing is compiled here, so the step runs: one forward and one backward of the model on
example inputs. What ran is read in `_check_ran` (the frontend's records and
torch.distributed's collectives); what the policy declares, and the comparison of the
two, are in `_check_policy`. This module holds the public function and what saves and
restores what the step changes: gradients, buffers and the random state are put back
as they were, so the check changes neither the model nor the training that follows.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

import funshard as fs
from funshard import errors
from funshard.planning import Mismatch, check_allow
from torch_frontend import _bridge
from torch_frontend._check_policy import compare, declared, gathered_at_once
from torch_frontend._check_ran import TorchCollectives, Units, ran, recorded
from torch_frontend._fully_shard import FSDPModule
from torch_frontend._group import FSDPParamGroup
from torch_frontend._tree import tensors

logger = logging.getLogger("torch_frontend")  # silent unless configured (see _group.py)

# ---- saving and restoring what the step changes -------------------------------------------


@contextlib.contextmanager
def _unchanged(model: FSDPModule, inputs: tuple, groups: list[FSDPParamGroup]) -> Iterator[None]:
    """Puts back every gradient (sharded, unsharded, accumulated without sync, HSDP
    partial), the buffers and the random state as they were before the block, and
    reshards the groups that were sharded; the block starts with no gradient."""
    grads = [(t, t.grad) for t in [*model.parameters(), *tensors(inputs)] if t.is_leaf]
    params = [p for g in groups for p in g.fsdp_params]
    held = [
        (
            p,
            p._unsharded_param,
            getattr(p._unsharded_param, "grad", None),
            p.unsharded_accumulated_grad,
            p.partial_grad,
        )
        for p in params
    ]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    sharded = [g for g in groups if g.is_sharded]
    for t, _ in grads:
        t.grad = None
    for p, unsharded, *_ in held:
        if unsharded is not None:
            unsharded.grad = None
        p.unsharded_accumulated_grad = p.partial_grad = None
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for group in sharded:
            if not group.is_sharded:
                group.reshard()
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
        for t, grad in grads:
            t.grad = grad
        for p, unsharded, grad, accumulated, partial in held:
            if unsharded is not None and p._unsharded_param is unsharded:
                unsharded.grad = grad
            p.unsharded_accumulated_grad, p.partial_grad = accumulated, partial


# ---- the public function ------------------------------------------------------------------


def check(
    model: FSDPModule,
    *example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    strict: bool = False,
    allow: Collection[str] = (),
) -> fs.StepReport:
    """Runs one forward and backward of `model` and checks its collectives against FSDP2's policy.

    Every collective of the step is recorded: the all-gathers and reduce-scatters the
    frontend issues, and torch.distributed's collectives called beside them (a
    `dist.all_reduce` in the loss). Each parameter group's policy declares an all-gather
    in forward, another in backward where `reshard_after_forward` frees the parameters,
    and one reduce-scatter of its gradients (plus an all-reduce over HSDP replicas), in
    the mixed-precision dtypes (`param_dtype`, `reduce_dtype`), none of the gradient
    collectives after `set_requires_gradient_sync(False)`. The gradients, buffers and
    random state are put back as they were and the module is left resharded, so the
    check changes neither the model nor the training that follows. Call it on every rank,
    as a training step: it runs collectives.

    Args:
      model: the root module `torch_frontend.fully_shard` was applied to (the outermost).
      *example_inputs: the positional arguments of one forward, as in training.
      loss_fn: turns the model's output into the scalar loss to differentiate (default:
        the output's sum; a scalar output is the loss itself).
      strict: raise `funshard.errors.PolicyMismatchError` listing every mismatch
        instead of returning a report that has some.
      allow: mismatch kinds to list as notes instead (e.g. `("unplanned",)` for a loss
        that sums a token count over the ranks on purpose).

    Returns:
      A `funshard.StepReport`: `.ok`, `.collectives` (each run beside planned),
      `.mismatches` and `.notes` (each with a one-line explanation), and `.table()`.
      `temp_bytes` is None: no program is compiled to measure it, so `.table()` leaves
      the temp memory out.

    Raises:
      TypeError: `model` is not an FSDP module, `loss_fn` is not callable or returns no
        tensor, or the forward fails on a type (`funshard.errors.ShardingTypeError`).
      ValueError: `model` is not the root, the forward fails on `example_inputs`, the
        loss is not a scalar that depends on the parameters, or `allow` names no
        mismatch kind (`funshard.errors.ShardingValueError`).
      PolicyMismatchError: with `strict=True`, when the step does not match its policy.
    """
    _check_arguments(model, loss_fn, allow)
    groups = model._fsdp_groups(recurse=True)
    gathered_before = {g for g in groups if g.is_unsharded}
    recorder = groups[0].comm_ctx.recorder
    with (
        _unchanged(model, example_inputs, groups),
        recorded(recorder) as (records, all_reduced),
        TorchCollectives() as torch_calls,
    ):
        _step(model, example_inputs, loss_fn)
    units = Units(model)
    without_grad: dict[str, set[str]] = {}
    for record in records:
        group = units.by_label.get(record.unit)
        if record.missing and group is not None:
            without_grad.setdefault(units.name(group), set()).update(record.missing)
    rows, mismatches = compare(
        declared(units, gathered_before, without_grad),
        ran(records, all_reduced, torch_calls.calls, units),
        _peers(groups),
        units,
    )
    notes = [_no_gradient(unit, names) for unit, names in sorted(without_grad.items())]
    notes += [m for m in mismatches if m.kind == "unneeded"]
    mismatches = [m for m in mismatches if m.kind != "unneeded"]
    notes += [m for m in mismatches if m.kind in allow]
    mismatches = [m for m in mismatches if m.kind not in allow]
    layout = next((g.layout for g in groups if g.fsdp_params), groups[0].layout)
    report = fs.StepReport(
        mesh_shape=tuple((str(a), int(s)) for a, s in layout.mesh.shape.items()),
        platform=layout.device.platform,
        collectives=tuple(rows),
        mismatches=tuple(mismatches),
        notes=tuple(notes),
        temp_bytes=None,
        gathered_bytes=gathered_at_once(units),
    )
    logger.debug(
        "check: %d collectives in the step, %d mismatches, %d notes",
        sum(c.times for c in rows),
        len(mismatches),
        len(notes),
    )
    if strict and mismatches:
        raise errors.PolicyMismatchError(
            "check: the step does not match its policy:\n"
            + "\n".join(f"  {m.kind}: {m.explanation}" for m in mismatches)
        )
    return report


def _check_arguments(model: Any, loss_fn: Any, allow: Collection[str]) -> None:
    if not isinstance(model, FSDPModule):
        raise errors.ShardingTypeError(
            f"check: model must be the module torch_frontend.fully_shard was applied to "
            f"(an FSDPModule), not {type(model).__name__}. Call fully_shard(model) on the "
            "root (after its blocks) first."
        )
    state = model._get_fsdp_state()
    if state._is_root is False or len(state._modules) > 1:
        raise errors.ShardingValueError(
            f"check: {type(model).__name__} is not the root module; pass the outermost "
            "module fully_shard was applied to, the one a training step calls."
        )
    if loss_fn is not None and not callable(loss_fn):
        raise errors.ShardingTypeError(
            f"check: loss_fn must be a function of the model's output that returns the "
            f"scalar loss, not {type(loss_fn).__name__}."
        )
    check_allow(allow)


def _step(model: FSDPModule, inputs: tuple, loss_fn: Callable | None) -> None:
    """One forward and backward; on any failure the iteration is discarded."""
    try:
        with torch.enable_grad():
            output = _forward(model, inputs)
            _loss(output, loss_fn).backward()
    except BaseException:
        model._get_fsdp_state()._reset_iter_state()
        raise


def _forward(model: FSDPModule, inputs: tuple) -> Any:
    try:
        return model(*inputs)
    except errors.FunshardError:
        raise  # the frontend's own errors say what is wrong and how to fix it
    except (TypeError, ValueError, RuntimeError, IndexError) as e:
        kind = errors.ShardingTypeError if isinstance(e, TypeError) else errors.ShardingValueError
        raise kind(
            f"check: the forward of {type(model).__name__} failed on the example inputs "
            f"({type(e).__name__}: {e}). Pass the positional arguments of one training "
            "forward (check(model, x) runs model(x)), with the shapes and dtypes it takes."
        ) from e


def _loss(output: Any, loss_fn: Callable | None) -> torch.Tensor:
    if loss_fn is None:
        if not isinstance(output, torch.Tensor):
            raise errors.ShardingTypeError(
                f"check: the model returned a {type(output).__name__}, not a tensor; pass "
                "loss_fn=, a function of that output returning the scalar loss."
            )
        loss = output if output.ndim == 0 else output.sum()
    else:
        loss = loss_fn(output)
    if not isinstance(loss, torch.Tensor):
        raise errors.ShardingTypeError(
            f"check: loss_fn returned a {type(loss).__name__}; it must return the scalar "
            "loss tensor."
        )
    if loss.ndim != 0 or not loss.requires_grad:
        what = f"has shape {tuple(loss.shape)}" if loss.ndim else "does not require grad"
        raise errors.ShardingValueError(
            f"check: the loss {what}; check differentiates a scalar loss that depends on the "
            "model's trainable parameters (loss_fn= turns the output into one)."
        )
    return loss


def _peers(groups: list[FSDPParamGroup]) -> set[int]:
    """The processes of this process's data-parallel groups."""
    return {rank for g in groups for rank in _bridge._group_of(g.layout)}


def _no_gradient(unit: str, names: set[str]):
    return Mismatch(
        "unneeded",
        unit,
        "reduce-scatter",
        0,
        f"unit {unit!r}: {', '.join(sorted(names))} got no gradient in this step, so its "
        "reduce-scatter leaves them out. Where other ranks do reduce them (a routed expert, "
        "a branch taken on some ranks), call set_reduce_scatter_unused_params(True).",
    )
