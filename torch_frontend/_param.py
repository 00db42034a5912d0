"""One managed parameter: a DTensor over its padded local storage, and its unsharded twin."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import weakref
from collections.abc import Sequence
from typing import cast

import jax
import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from funshard import errors
from torch_frontend import _bridge

# id() of every tensor a group binds to its modules (local shards and unsharded
# parameters) -> its FSDPParam. Not a weak reference to the tensor: `module.to()` and
# `to_empty()` swap a DTensor parameter's contents in place (torch.utils.swap_tensors),
# which refuses tensors with weak references. A hit counts only if the FSDPParam still
# holds that very tensor, so an address reused by a later tensor is never mistaken for it.
_MANAGED: weakref.WeakValueDictionary[int, FSDPParam] = weakref.WeakValueDictionary()
_UID_ATTR = "_torch_frontend_uid"
_uids = itertools.count()


def managed(tensor: torch.Tensor) -> FSDPParam | None:
    """The FSDPParam that binds `tensor` (a shard or an unsharded parameter), if any."""
    owner = _MANAGED.get(id(tensor))
    if owner is not None and (owner.sharded_param is tensor or owner._unsharded_param is tensor):
        return owner
    return None


def _get_orig_param_uid(param: nn.Parameter) -> int:
    """A number that names the original parameter object for as long as it lives.

    Stored on the object itself, so parameters that share it (tied weights) share the
    number and an object made later at the same address (after garbage collection)
    gets another one: `id()` could not tell these apart.
    """
    uid = getattr(param, _UID_ATTR, None)
    if uid is None:
        uid = next(_uids)
        setattr(param, _UID_ATTR, uid)
    return uid


@functools.cache
def spmd_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel mesh and a parameter's tensor-parallel mesh as one (FSDP2's).

    Both must be sub-meshes of one `init_device_mesh` mesh with named, disjoint dims.
    Made without process groups (torch's `_concatenate` reuses the sub-meshes' own), once
    per pair.

    Raises:
      RuntimeError: the meshes come from different meshes, overlap, or lack dim names.
    """
    if dp_mesh.mesh_dim_names is None or tp_mesh.mesh_dim_names is None:
        raise RuntimeError("both meshes need dim names (init_device_mesh's mesh_dim_names)")
    return DeviceMesh._concatenate([dp_mesh, tp_mesh])


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How a group's shards are DTensors: the torch mesh and the placement of a dim.

    Attributes:
      device_mesh: the data-parallel mesh of the group (the one `fully_shard` was
        given, a `ShardPlacementResult`'s, or the dp dims named by `dp_mesh_dims`).
      tp_spec: a tensor-parallel parameter's own DTensor spec (None: a plain one). Its
        shard is then a DTensor on the data-parallel and tensor-parallel dims together,
        with FSDP2's placements.
      dp_shard_dims: with `dp_mesh_dims`, the indices of its shard dims in the full mesh
        that `tp_spec` is on (the parameter is already a DTensor there, `Replicate()` on
        the data-parallel dims); empty otherwise.
      dp_dims: with `dp_mesh_dims`, the indices of all its data-parallel dims.
      flat_mesh: with several shard dims (flattened into one), FSDP2's mesh of the
        sharded DTensor: `device_mesh` in their place, the replicate dims dropped.
    """

    device_mesh: DeviceMesh
    tp_spec: DTensorSpec | None = None
    dp_shard_dims: tuple[int, ...] = ()
    dp_dims: frozenset[int] = frozenset()
    flat_mesh: DeviceMesh | None = None

    @property
    def mesh(self) -> DeviceMesh:
        """The mesh of the sharded DTensor."""
        if self.tp_spec is None:
            return self.device_mesh
        if self.dp_dims:
            # The full mesh, as the parameter was (or FSDP2's flattened view of it).
            return self.flat_mesh or self.tp_spec.mesh
        return spmd_mesh(self.device_mesh, self.tp_spec.mesh)

    def placements(self, dim: int) -> tuple[Placement, ...]:
        """FSDP2's: `Shard(dim)`, after `Replicate()` on an HSDP mesh.

        A tensor-parallel parameter is sharded on `dim` of its TP-local block, so the
        data-parallel placement is `_StridedShard(dim, split_factor=TP shards on dim)`
        where TP already splits `dim`, followed by the TP placements. With
        `dp_mesh_dims` the parameter's own placements stay, but the shard dim's: that
        counts only the TP splits of `dim` on the dims after it, as FSDP2's (with no
        shard dim, DDP, all of them stay).
        """
        replicas = (Replicate(),) * (self.device_mesh.ndim - 1)
        if self.tp_spec is None:
            return (*replicas, Shard(dim))
        if self.dp_dims:
            return self._full_mesh_placements(dim)
        split = self.tp_spec.num_shards_map[dim]
        fsdp = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
        return (*replicas, fsdp, *self.tp_spec.placements)

    def _full_mesh_placements(self, dim: int) -> tuple[Placement, ...]:
        assert self.tp_spec is not None, "dp_mesh_dims' parameters are DTensors"
        mesh, given = self.tp_spec.mesh, self.tp_spec.placements
        placements = list(given)
        for at in self.dp_shard_dims:
            split = 1
            for j in range(at + 1, mesh.ndim):
                p = given[j]
                if isinstance(p, (Shard, _StridedShard)) and p.dim == dim:
                    split *= mesh.size(j)
            placements[at] = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
        if self.flat_mesh is None:
            return tuple(placements)
        # FSDP2's flattened view: the shard dims become one (after Replicate() for HSDP)
        # where the first of them was; the replicate dims go.
        first, hsdp = self.dp_shard_dims[0], self.device_mesh.ndim > 1
        flat: list[Placement] = []
        for i, placement in enumerate(placements):
            if i == first:
                flat.extend([Replicate(), placement] if hsdp else [placement])
            elif i not in self.dp_dims:
                flat.append(placement)
        return tuple(flat)

    def tp_spec_in(self, dtype: torch.dtype) -> DTensorSpec:
        """The tensor-parallel spec of the unsharded parameter gathered in `dtype`."""
        spec = self.tp_spec
        assert spec is not None and spec.tensor_meta is not None, "a tensor-parallel spec"
        meta = spec.tensor_meta
        if meta.dtype == dtype:
            return spec
        return dataclasses.replace(spec, tensor_meta=TensorMeta(meta.shape, meta.stride, dtype))


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class FSDPParam:
    """A parameter of a group, held by this rank as `torch.chunk(p, world, dim)[rank]`.

    The module holds `sharded_param`, an `nn.Parameter` DTensor (`Shard(dim)`, as
    FSDP2's) whose local tensor is a view of `_sharded_param_data`: a contiguous buffer
    of `padded_rows` rows (zero rows after the shard), this rank's block of the group's
    gathers (copied into the group's flat buffer, `_flat.copy_in`). The optimizer
    updates the DTensor in place, hence `_sharded_param_data` too. `_unsharded_param`
    is one persistent plain `nn.Parameter` with one storage, filled by each gather and
    freed by reshard: autograd's saved tensors and gradient accumulation across
    microbatches see it as one leaf. Names as FSDP2's `FSDPParam` (docs/torch.md).

    A tensor-parallel parameter (a DTensor from `parallelize_module`) is sharded as
    FSDP2 shards it: its TP-local block is what the rows, gathers and reduce-scatters
    are about (`shape`), the shard is a DTensor on the data-parallel and TP dims
    together (`ShardSpec.placements`), and the unsharded parameter is a DTensor with
    the TP spec over the gathered block, so the module's TP code runs as before.

    Attributes:
      _param_fqn: the parameter's name (relative to the fully_shard module, then to
        the root).
      uses: every (module, attribute name) that holds the parameter (tied weights).
      _orig_param_uid: `_get_orig_param_uid` of the original parameter, to find one
        managed by two groups.
    """

    def __init__(
        self,
        param: nn.Parameter,
        uses: list[tuple[nn.Module, str]],
        fqn: str,
        layout: _bridge.RankLayout,
        spec: ShardSpec,
        dim: int = 0,
    ):
        if param.ndim == 0:
            raise errors.ShardingValueError(_scalar_param(fqn))
        self._param_fqn, self.uses, self.dim = fqn, uses, dim
        self._orig_param_uid = _get_orig_param_uid(param)
        self.global_shape = tuple(param.shape)  # the sharded DTensor's (TP included)
        data: torch.Tensor = param
        if isinstance(param, DTensor):
            spec = dataclasses.replace(spec, tp_spec=param._spec)
            data = param._local_tensor
        self.layout, self.spec = layout, spec
        self.shape, self.dtype = tuple(data.shape), data.dtype
        self.orig_dtype = data.dtype  # at fully_shard: `module.to(...)` may change dtype
        self.group_modules: tuple[nn.Module, ...] = ()  # the fully_shard call's modules
        self.rows = data.shape[dim]
        self.local_rows = layout.local_rows(self.rows)
        self._sharding_spec: DTensorSpec | None = None
        padded = data.detach().new_zeros(self._padded_shape())
        start = layout.rank * padded.shape[dim]
        if not padded.is_meta:
            self._local(padded).copy_(data.detach().narrow(dim, start, self.local_rows))
        self._sharded_param_data = padded
        # On a dim other than 0 a shard shorter than the padding is a strided view.
        self.sharded_param = nn.Parameter(
            self.to_sharded_dtensor(self._local(padded)), requires_grad=param.requires_grad
        )
        _MANAGED[id(self.sharded_param)] = self
        self._unsharded_param: nn.Parameter | None = None
        self.unsharded_accumulated_grad: torch.Tensor | None = None
        self._part: tuple[torch.Tensor, jax.Array] | None = None
        # HSDP without all-reduce: this replica's reduce-scattered sum, not yet reduced
        # over the replicas (FSDP2's partial reduce output).
        self.partial_grad: torch.Tensor | None = None
        self._setattr_on_modules(self.sharded_param)

    def _padded_shape(self) -> list[int]:
        shape = list(self.shape)
        shape[self.dim] = self.layout.padded_rows(self.rows)
        return shape

    def to_sharded_dtensor(self, local: torch.Tensor) -> DTensor:
        """`local` (this rank's rows) as the DTensor of the full parameter, no copy.

        Built from a spec made once per dtype, as FSDP2 builds its DTensors:
        `DTensor.from_local` re-derives it each time, and gradients are wrapped on
        every backward.
        """
        spec = self._sharding_spec
        if spec is None or spec.tensor_meta is None or spec.tensor_meta.dtype != local.dtype:
            shape = self.global_shape
            meta = TensorMeta(torch.Size(shape), _contiguous_strides(shape), local.dtype)
            spec = DTensorSpec(self.spec.mesh, self.spec.placements(self.dim), tensor_meta=meta)
            self._sharding_spec = spec
        return DTensor(local.detach(), spec, requires_grad=False)

    @property
    def _sharded_local_tensor(self) -> torch.Tensor:
        """This rank's rows of the parameter (the DTensor's local tensor, a view)."""
        return self._sharded_dtensor._local_tensor

    @property
    def _sharded_dtensor(self) -> DTensor:
        # The sharded parameter is a DTensor by construction (`nn.Parameter` of a DTensor
        # keeps the subclass; `reset_sharded_param` adopts DTensors only); torch's stubs
        # type `nn.Parameter(...)` as a plain Parameter.
        return cast(DTensor, self.sharded_param)

    @property
    def tensor_parallel(self) -> bool:
        """Whether the parameter was a tensor-parallel DTensor at `fully_shard`."""
        return self.spec.tp_spec is not None

    @property
    def _unsharded_local(self) -> torch.Tensor:
        """The unsharded parameter's data as a plain tensor (a TP DTensor's local block)."""
        param = self.unsharded_param
        return param._local_tensor if isinstance(param, DTensor) else param

    @property
    def unsharded_param(self) -> nn.Parameter:
        """The unsharded parameter (FSDP2's property): made by the first gather.

        Raises:
          AssertionError: no gather made it yet (a caller's bug).
        """
        param = self._unsharded_param
        assert param is not None, f"{self._param_fqn}: the unsharded parameter is made by a gather"
        return param

    def gather_dtype(self, param_dtype: torch.dtype | None) -> torch.dtype:
        """The dtype the parameter is gathered and computed in (FSDP2's clamping)."""
        if param_dtype is None or not self.dtype.is_floating_point:
            return self.dtype
        return param_dtype

    def check_bound(self) -> None:
        """Raises if a module attribute no longer holds the sharded parameter.

        Raises:
          AttributeError: the parameter was set to None (removed) after fully_shard,
            as FSDP2's lazy initialisation raises.
          ValueError: the parameter was replaced after fully_shard.
        """
        for module, name in self.uses:
            held = module._parameters.get(name)
            if held is None:
                raise AttributeError(_removed_param(self._param_fqn))
            if held is not self.sharded_param:
                raise errors.ShardingValueError(_replaced_param(self._param_fqn))

    def sync_padded(self) -> torch.Tensor:
        """`_sharded_param_data`, re-made first if the shard no longer views it.

        After `module.to(...)`, `to_empty`, `param.data = ...` or
        `load_state_dict(assign=True)` the DTensor's local tensor may be new storage
        (of a new dtype or device): its values are copied into fresh padded storage,
        which the local tensor views again, so that gathers and checkpoints see them.
        """
        local = self._sharded_local_tensor
        if local.is_meta or _same_storage(local, self._sharded_param_data):
            return self._sharded_param_data
        self.dtype = local.dtype
        padded = local.new_zeros(self._padded_shape())
        self._local(padded).copy_(local)
        self._sharded_param_data = padded
        self._sharded_dtensor._local_tensor = self._local(padded)
        if self._unsharded_param is not None and self._unsharded_param.dtype != self.dtype:
            self._unsharded_param = None  # re-made in the new dtype at the next gather
        return self._sharded_param_data

    def reset_sharded_param(self) -> None:
        """Adopts the DTensor the module now holds (`load_state_dict(assign=True)`, `_apply`).

        As FSDP2's: a new DTensor parameter of the same shape becomes the sharded
        parameter (every module holding the old one gets it), and its local tensor is
        padded again; anything else is a replacement fully_shard cannot shard.
        """
        module, name = self.uses[0]
        new = module._parameters.get(name)
        if new is None:
            raise AttributeError(_removed_param(self._param_fqn))
        if new is not self.sharded_param:
            if (
                not isinstance(new, DTensor)
                or new.shape != self.sharded_param.shape
                or new.device_mesh != self.spec.mesh
                or tuple(new.placements) != self.spec.placements(self.dim)
            ):
                raise errors.ShardingValueError(_replaced_param(self._param_fqn))
            _MANAGED.pop(id(self.sharded_param), None)
            self.sharded_param = new
            _MANAGED[id(new)] = self
            self._sharding_spec = None
            if self._unsharded_param is not None:
                self._unsharded_param.requires_grad_(new.requires_grad)
        self._setattr_on_modules(self.sharded_param)
        self.sync_padded()

    def keep_part(self, layout: _bridge.RankLayout, hpz: _bridge.RankLayout) -> None:
        """Keeps this rank's part of the gathered parameter for an hpZ re-gather.

        The part is the rank's 1/k of the padded full tensor in the gather dtype (its
        own buffer, so the full one can be freed); `hpz` is the group layout.
        """
        full = self._unsharded_local.detach()
        part_rows = layout.world * layout.padded_rows(self.rows) // hpz.world
        start = hpz.rank * part_rows
        stop = min(start + part_rows, self.rows)
        shape = list(full.shape)
        shape[self.dim] = part_rows
        part = full.new_zeros(shape)
        if stop > start:
            part.narrow(self.dim, 0, stop - start).copy_(full.narrow(self.dim, start, stop - start))
        self._part = (part, _bridge.global_block(hpz, part, self.dim))

    def part_block(self) -> jax.Array:
        """The kept hpZ part as its group's global array: the re-gather's input."""
        assert self._part is not None, "keep_part() runs before each hpZ re-gather"
        return self._part[1]

    def drop_part(self) -> None:
        self._part = None

    def unsharded_padded(self, dtype: torch.dtype) -> torch.Tensor:
        """The unsharded parameter's storage in `dtype`, allocated, as the gather fills it.

        The unsharded parameter has ONE storage for its life, resized to nothing on
        reshard and back here (FSDP2's): views of it that autograd saved in forward (a
        linear's `weight.t()`) hold that storage, so a resharded module keeps no
        gathered bytes and the backward's re-gather reaches those views. Sharded on
        dim 0, the storage has the padding rows after the parameter's, so the result
        (`world * padded_rows` rows) is what the gather writes in one strided copy;
        on another dim it is the parameter itself.

        Writing into the result bumps the parameter's version counter: callers keep
        it (`torch.autograd._unsafe_preserve_version_counter`).
        """
        full_shape = list(self.shape)
        if self.dim == 0:
            full_shape[0] = self.layout.world * self.layout.padded_rows(self.rows)
        if self._unsharded_param is None or self._unsharded_param.dtype != dtype:
            base = torch.empty(full_shape, dtype=dtype, device=self._sharded_param_data.device)
            data = base.narrow(self.dim, 0, self.rows)
            if self.tensor_parallel:  # the module's TP code sees its DTensor, as with FSDP2
                data = DTensor(data, self.spec.tp_spec_in(dtype), requires_grad=False)
            self._unsharded_param = nn.Parameter(
                data, requires_grad=self.sharded_param.requires_grad
            )
            _MANAGED[id(self._unsharded_param)] = self
        local = self._unsharded_local
        storage = local.untyped_storage()
        nbytes = dtype.itemsize * math.prod(full_shape)
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        if self.dim != 0:
            return local.detach()
        return local.detach().as_strided(full_shape, _contiguous_strides(full_shape), 0)

    def to_unsharded(self, full: torch.Tensor) -> None:
        """Makes the modules use a copy of `full` (a gathered tensor) as the parameter."""
        target = self.unsharded_padded(full.dtype).narrow(self.dim, 0, self.rows)
        with (
            torch.no_grad(),
            torch.autograd._unsafe_preserve_version_counter(self.unsharded_param),
        ):
            target.copy_(full)
        self.bind_unsharded()

    def bind_unsharded(self) -> None:
        """Makes the modules hold the unsharded parameter (filled by the caller).

        It takes the sharded parameter's `requires_grad` first, as FSDP2's
        `to_unsharded` does: `requires_grad_(False)` between steps (on the module's
        parameter, the shard) freezes it from the next forward on, and `True` trains
        it again. Without this the unsharded parameter kept the flag it was made with
        and a frozen parameter still got gradients (and optimizer updates).
        """
        unsharded = self.unsharded_param
        if unsharded.requires_grad != self.sharded_param.requires_grad:
            unsharded.requires_grad_(self.sharded_param.requires_grad)
        self._setattr_on_modules(unsharded)

    def to_sharded(self) -> None:
        """Makes the modules hold the local shard again and frees the gathered values.

        The unsharded parameter keeps its dtype and shape with no storage (as FSDP2
        frees it): autograd's saved references stay valid for the backward's
        re-gather, and a gradient can accumulate into it without one
        (`set_unshard_in_backward(False)`).
        """
        if self._unsharded_param is not None:
            self._unsharded_local.untyped_storage().resize_(0)
        for module, name in self.uses:
            # A slot the user changed while it held the unsharded parameter (`lin.bias
            # = None` between a kept-gathered forward and its backward) keeps the
            # change, so that the next gather's `check_bound` names it: binding the
            # shard again would silently undo it.
            held = module._parameters.get(name)
            if held is self.sharded_param or (held is self._unsharded_param and held is not None):
                module._parameters[name] = self.sharded_param

    def take_unsharded_grad(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The gradient accumulated since the last reduction, in `dtype`; clears it."""
        grad = None if self._unsharded_param is None else self._unsharded_param.grad
        if self._unsharded_param is not None:
            self._unsharded_param.grad = None
        if grad is not None:
            grad = self._grad_local(grad).to(dtype)
        if self.unsharded_accumulated_grad is not None:
            grad = (
                self.unsharded_accumulated_grad
                if grad is None
                else self.unsharded_accumulated_grad + grad
            )
            self.unsharded_accumulated_grad = None
        return grad

    def zero_unsharded_grad(self, dtype: torch.dtype) -> torch.Tensor | None:
        """Zeros in place of a gradient this rank's backward did not produce.

        None where the parameter was never gathered or does not require a gradient
        (FSDP2's `reduce_scatter_unused_params` includes neither).
        """
        param = self._unsharded_param
        if param is None or not param.requires_grad:
            return None
        local = param.to_local() if isinstance(param, DTensor) else param
        return torch.zeros(local.shape, dtype=dtype, device=local.device)

    def _grad_local(self, grad: torch.Tensor) -> torch.Tensor:
        """A gradient's block for the reduce-scatter: a TP DTensor's local one.

        A partial TP gradient (a row-parallel bias's) is reduced over the TP dims first,
        by torch's collective, so that it has the parameter's own TP placements (FSDP2's
        `_get_grad_inner_tensor`).
        """
        if not isinstance(grad, DTensor):
            return grad
        placements = self.spec.tp_spec_in(grad.dtype).placements
        if self.spec.dp_dims:
            # dp_mesh_dims: a partial sum over the data-parallel dims stays one, for
            # the reduce-scatter to sum (FSDP2's: no all-reduce over them first).
            placements = tuple(
                grad.placements[i] if i in self.spec.dp_dims else p
                for i, p in enumerate(placements)
            )
        if tuple(grad.placements) != tuple(placements):
            grad = grad.redistribute(placements=placements)
        local = grad._local_tensor
        return local.wait() if isinstance(local, AsyncCollectiveTensor) else local

    def accumulate_unsharded_grad(self, dtype: torch.dtype) -> None:
        """Keeps this backward's gradient (no reduction this time), in `dtype`."""
        self.unsharded_accumulated_grad = self.take_unsharded_grad(dtype)

    def add_partial_grad(self, block: torch.Tensor) -> None:
        """Accumulates this replica's reduce-scattered sum (no all-reduce this time)."""
        self.partial_grad = (
            block.clone() if self.partial_grad is None else self.partial_grad + block
        )

    def with_partial_grad(
        self, grad: torch.Tensor | None, dtype: torch.dtype, rank: int
    ) -> torch.Tensor | None:
        """`grad` (full) with the partial sum added at this rank's rows, then forgets it.

        The reduce-scatter sums every rank's contribution to rank r's rows, so a partial
        added at rank r's own rows of its contribution arrives in r's result exactly once.
        """
        if self.partial_grad is None:
            return grad
        full = torch.zeros(self.shape, dtype=dtype) if grad is None else grad.clone()
        start = rank * self.partial_grad.shape[self.dim]
        full.narrow(self.dim, start, self.local_rows).add_(self._local(self.partial_grad).to(dtype))
        self.partial_grad = None
        return full

    def add_sharded_grad(self, block: torch.Tensor, divide_factor: float | None) -> None:
        """Adds this rank's rows of a reduced gradient to the shard's `.grad` (a DTensor).

        `block` is JAX's read-only buffer: the gradient is always a new tensor.
        """
        local = self._local(block)
        local = local / divide_factor if divide_factor not in (None, 1) else local.clone()
        local = local.to(self.dtype)
        if self.sharded_param.grad is None:
            self.sharded_param.grad = self.to_sharded_dtensor(local)
        else:
            grad = self.sharded_param.grad
            (grad._local_tensor if isinstance(grad, DTensor) else grad).add_(local)

    def _local(self, padded: torch.Tensor) -> torch.Tensor:
        """The shard's rows of a padded block (a view)."""
        return padded.narrow(self.dim, 0, self.local_rows)

    def _setattr_on_modules(self, param: nn.Parameter) -> None:
        for module, name in self.uses:
            module._parameters[name] = param


def _scalar_param(fqn: str) -> str:
    # FSDP2's sentence first: code written for FSDP2 may match it.
    return (
        f"fully_shard: parameter {fqn!r} is 0-dimensional, and FSDP shards on dim 0. "
        f"Change {fqn} to a 1D tensor with numel equal to 1 (or keep it out of the "
        "sharded module, e.g. as a buffer)."
    )


def _removed_param(fqn: str) -> str:
    # FSDP2's lazy initialisation fails on the None with this AttributeError's text;
    # after its first forward it silently binds the parameter again.
    module, _, name = fqn.rpartition(".")
    holder = f"{module}.{name}" if module else name
    return (
        f"'NoneType' object has no attribute '_local_tensor': fully_shard: parameter "
        f"{fqn!r} was set to None after fully_shard, and fully_shard cannot remove a "
        f"parameter from its group (it would still be gathered, and used). Set "
        f"`{holder} = None` before calling fully_shard, or keep the parameter and zero "
        "it in place (`with torch.no_grad(): p.zero_()`) and freeze it "
        "(`p.requires_grad_(False)`)."
    )


def _replaced_param(fqn: str) -> str:
    return (
        f"fully_shard: parameter {fqn!r} was replaced after fully_shard (e.g. "
        "`module.weight = nn.Parameter(...)`); the new tensor is not sharded and would be "
        "ignored. Assign new values in place instead (`with torch.no_grad(): "
        "module.weight.copy_(...)`), or replace it before calling fully_shard."
    )


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )


def tensor_parallel_refused(what: str, param: FSDPParam) -> str:
    """The message of a frontend tool that cannot take a tensor-parallel parameter."""
    return (
        f"{what}: parameter {param._param_fqn!r} is tensor-parallel (a DTensor with "
        f"placements {param.spec.placements(param.dim)}), and {what} gathers over the "
        "data-parallel mesh only, so it would see this rank's TP block as the whole "
        "tensor; it is not supported for tensor parallelism yet. Use torch's tools, "
        "which read the placements: torch.distributed.checkpoint.state_dict's "
        "get_model_state_dict / set_model_state_dict (StateDictOptions(full_state_dict="
        "True) for full tensors), torch.distributed.checkpoint.save / load, or "
        "torch_frontend.full_state_dict / load_full_state_dict, which take tensor-parallel "
        "parameters (docs/torch.md, 2-D meshes)."
    )
