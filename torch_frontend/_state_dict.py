"""State dicts of fully sharded modules: local shards (as FSDP2) and full tensors.

`module.state_dict()` holds each rank's local shards under the usual names: hooks
registered by `fully_shard` bind the shards again before a save or a load, as FSDP2's
do, so a module whose gathered parameters are still bound (`reshard_after_forward=False`
after a forward) saves and loads its shards all the same. `full_state_dict` gathers the
unpadded full tensors through the bridge's all-gather (one collective per mesh layout);
`load_full_state_dict` copies each rank's chunk of full tensors into its shards in place.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Mapping

import jax
import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from funshard import comm, errors
from torch_frontend import _bridge
from torch_frontend._group import FSDPParamGroup
from torch_frontend._param import FSDPParam, tensor_parallel_refused
from torch_frontend._state import get_module_fsdp_state

logger = logging.getLogger("torch_frontend")  # silent unless configured (see _group.py)


@dataclasses.dataclass(frozen=True)
class Managed:
    """A managed parameter and the layout of its group."""

    param: FSDPParam
    layout: _bridge.RankLayout

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The shape of the whole tensor (a tensor-parallel parameter's, TP included)."""
        return self.param.global_shape if self.param.tensor_parallel else self.param.shape

    def chunk(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full tensor (`torch.chunk(full, world, dim)[rank]`), of
        its TP block for a tensor-parallel parameter (cut locally, no collective)."""
        param, layout = self.param, self.layout
        if param.tensor_parallel:
            spec = param.spec.tp_spec_in(full.dtype)
            full = distribute_tensor(full, spec.mesh, spec.placements, src_data_rank=None)
            full = full.to_local()
        start, count = layout.chunk(param.rows)
        return full.narrow(param.dim, start, count)


def register_hooks(group: FSDPParamGroup) -> None:
    """Installs the state-dict hooks of `group` on every module that holds its parameters."""
    modules: dict[int, nn.Module] = {}
    for param in group.fsdp_params:
        for module, _ in param.uses:
            modules.setdefault(id(module), module)
    for module in modules.values():
        reshard = functools.partial(_reshard, group)
        # Kept, as FSDP2 keeps its handles, so the hooks can be removed.
        group._module_to_pre_save_state_dict_hook_handle[module] = (
            module.register_state_dict_pre_hook(reshard)
        )
        group._module_to_pre_load_state_dict_hook_handle[module] = (
            module.register_load_state_dict_pre_hook(reshard)
        )
        group._module_to_post_load_state_dict_hook_handle[module] = (
            module.register_load_state_dict_post_hook(functools.partial(_adopt_assigned, group))
        )


def _reshard(group: FSDPParamGroup, *_) -> None:
    # As FSDP2: the state dict holds (and loads into) the shards. A later backward
    # gathers again if it needs the parameters.
    group.reshard()


def _adopt_assigned(group: FSDPParamGroup, module: nn.Module, _incompatible) -> None:
    # load_state_dict(assign=True) put new Parameter objects into the module: keep
    # the shard Parameters (the optimizer holds them) and take over the new data.
    with torch.no_grad():
        for param in group.fsdp_params:
            if any(owner is module for owner, _ in param.uses):
                param.reset_sharded_param()


def managed_params(
    module: nn.Module, what: str, tensor_parallel: bool = False
) -> dict[int, Managed]:
    """`id` of each local shard managed at or below `module` -> its `Managed`.

    Args:
      module: the module.
      what: the public function asking, for the error's message.
      tensor_parallel: whether the caller takes tensor-parallel parameters.

    Raises:
      NotImplementedError: a managed parameter is tensor-parallel and the caller does
        not take them (its checkpoints hold the data-parallel gather only).
    """
    managed: dict[int, Managed] = {}
    for sub in module.modules():
        state = get_module_fsdp_state(sub)
        if state is not None:
            for group in state._fsdp_param_groups:  # each on its own mesh
                for param in group.fsdp_params:
                    if param.tensor_parallel and not tensor_parallel:
                        raise errors.UnsupportedError(tensor_parallel_refused(what, param))
                    managed[id(param.sharded_param)] = Managed(param, group.layout)
    return managed


def gather_full(entries: list[Managed]) -> dict[int, torch.Tensor]:
    """The full, unpadded tensor of each entry (one all-gather per layout), by shard id.

    A tensor-parallel parameter's gather gives its TP block, which torch's DTensor then
    gathers over the TP dims (`full_tensor`, as `get_model_state_dict` does).
    Every process must call it with the same entries in the same order.
    """
    by_layout: dict[_bridge.RankLayout, list[FSDPParam]] = {}
    for entry in entries:
        params = by_layout.setdefault(entry.layout, [])
        if all(p is not entry.param for p in params):
            params.append(entry.param)
    _same_on_every_rank(by_layout)
    pending = []
    for layout, params in by_layout.items():
        blocks = [_bridge.global_block(layout, p.sync_padded(), p.dim) for p in params]
        if logger.isEnabledFor(logging.DEBUG):
            _log_full_gather(layout, params)
        pending.append(
            (
                params,
                _bridge.start_all_gather(
                    layout, blocks, [p.rows for p in params], [p.dim for p in params]
                ),
            )
        )
    fulls: dict[int, torch.Tensor] = {}
    for params, future in pending:
        for param, full in zip(params, _bridge.finish_all_gather(future), strict=True):
            # JAX's buffer is read-only: the caller gets its own copy.
            full = _bridge.from_words(full, param.dtype).clone()
            if param.tensor_parallel:
                full = _tensor_parallel_full(param, full)
            fulls[id(param.sharded_param)] = full
    return fulls


def _tensor_parallel_full(param: FSDPParam, block: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a tensor-parallel parameter from its gathered TP block."""
    spec = param.spec.tp_spec_in(block.dtype)
    assert spec.tensor_meta is not None, "a tensor-parallel spec has its tensor's meta"
    dtensor = DTensor.from_local(
        block,
        spec.mesh,
        spec.placements,
        run_check=False,
        shape=spec.tensor_meta.shape,
        stride=spec.tensor_meta.stride,
    )
    return dtensor.full_tensor()


def _log_full_gather(layout: _bridge.RankLayout, params: list[FSDPParam]) -> None:
    logger.debug(
        "full_state_dict: all-gather of %d parameters over %d ranks, %d elements (%s)",
        len(params),
        layout.world,
        sum(math.prod(p.shape) for p in params),
        ", ".join(sorted({str(p.dtype) for p in params})),
    )


def _same_on_every_rank(by_layout: dict[_bridge.RankLayout, list[FSDPParam]]) -> None:
    """Checks, before any gather, that every rank is gathering the same parameters.

    A `full_state_dict` called on some ranks only (`if rank == 0:`) would otherwise pair
    its all-gathers with the others' next training gathers: wrong tensors, or a hang.
    This is not a per-step path, so it can afford the key-value round trip.
    """
    processes = {d.process_index for layout in by_layout for d in layout.mesh.devices.flat}
    leaves = [(p.shape, p.dim, p.dtype) for group in by_layout.values() for p in group]
    comm.same_collective("full_state_dict", leaves, processes, noun=("parameter", "parameters"))


def full_state_dict(module: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The module's state dict with full, unpadded tensors, as an unsharded copy holds them.

    Every managed parameter is all-gathered (one collective per mesh layout, over the
    shard axis only on an HSDP mesh); a tensor-parallel one is then gathered over its
    TP dims by torch's DTensor; buffers and unmanaged parameters are copied.
    Every process must call it (it runs collectives): the ranks first check through
    JAX's coordination service that they all gather the same parameters. The result is
    what `nn.Module.load_state_dict` of the unsharded model accepts.

    Args:
      module: a module fully sharded with `fully_shard` (or containing such modules).
      rank0_only: only process 0 returns the tensors; the others return `{}` (they
        still take part in the gathers).

    Returns:
      The state dict's keys (the usual names) -> new tensors owned by the caller.

    Raises:
      RuntimeError: another rank gathers other parameters, or left the job.
      TimeoutError: another rank did not call it within `departure_timeout` seconds
        (FUNSHARD_DEPARTURE_TIMEOUT, 30 by default).
    """
    local = module.state_dict(keep_vars=True)
    managed = managed_params(module, "torch_frontend.full_state_dict", tensor_parallel=True)
    fulls = gather_full([managed[id(t)] for t in local.values() if id(t) in managed])
    if rank0_only and jax.process_index() != 0:
        return {}
    return {key: fulls[id(t)] if id(t) in fulls else t.detach().clone() for key, t in local.items()}


def _problems(expected: dict[str, tuple], state_dict: Mapping[str, object]) -> list[str]:
    """One line per key of `state_dict` that does not fit `expected` ({key: full shape})."""
    problems = [f"  missing key {k!r}" for k in expected if k not in state_dict]
    problems += [f"  unexpected key {k!r}" for k in state_dict if k not in expected]
    for key, shape in expected.items():
        value = state_dict.get(key)
        if key not in state_dict:
            continue
        if not isinstance(value, torch.Tensor):
            problems.append(f"  key {key!r} holds a {type(value).__name__}, not a tensor")
        elif tuple(value.shape) != shape:
            problems.append(
                f"  key {key!r} has shape {tuple(value.shape)}; the module's "
                f"full tensor has shape {tuple(shape)}"
            )
    return problems


def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Loads full (unsharded) tensors: each rank copies its chunk into its shards in place.

    The inverse of `full_state_dict`, on any world size: the state dict of an unsharded
    copy of the model loads as it is (a tensor-parallel parameter takes its whole tensor
    and keeps this rank's TP block of it). No collectives run; the shards keep their
    identity (an optimizer built over them stays valid).

    Args:
      module: a module fully sharded with `fully_shard` (or containing such modules).
      state_dict: every key of `module.state_dict()`, each a full tensor.

    Raises:
      ValueError: keys are missing or unexpected, or a value is not a tensor of the
        full shape; the message names every such key.
    """
    local = module.state_dict(keep_vars=True)
    managed = managed_params(module, "torch_frontend.load_full_state_dict", tensor_parallel=True)
    expected = {
        key: managed[id(t)].full_shape if id(t) in managed else tuple(t.shape)
        for key, t in local.items()
    }
    problems = _problems(expected, state_dict)
    if problems:
        raise errors.ShardingValueError(_mismatch(problems))
    chunks = {
        key: _chunk(managed[id(t)], state_dict[key]) if id(t) in managed else state_dict[key]
        for key, t in local.items()
    }
    module.load_state_dict(chunks)


def _mismatch(problems: list[str]) -> str:
    return (
        "load_full_state_dict: the state dict does not fit the module:\n"
        + "\n".join(problems)
        + "\nPass the full (unsharded) tensors of every key of the module's state_dict(), "
        "as full_state_dict() or an unsharded copy's state_dict() returns them."
    )


def _chunk(entry: Managed, full: torch.Tensor) -> torch.Tensor:
    """This rank's rows of `full` as a DTensor like the managed parameter's."""
    return entry.param.to_sharded_dtensor(entry.chunk(full).to(entry.param.dtype))
