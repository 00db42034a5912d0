"""One managed parameter: its local shard in padded storage and its unsharded twin."""

from __future__ import annotations

import jax
import torch
from torch import nn

from torch_frontend import _bridge, _errors


class FSDPParam:
    """A parameter of a group, held by this rank as `torch.chunk(p, world, dim=0)[rank]`.

    The shard is a view of `padded`, a contiguous buffer of `padded_rows` rows (zero
    rows after the shard) that JAX reads through DLPack without a copy. The optimizer
    updates the shard in place, hence `padded` too. `unsharded` is one persistent
    `nn.Parameter` whose data is swapped for each gathered tensor: autograd's saved
    tensors and gradient accumulation across microbatches see it as one leaf.

    Attributes:
      fqn: the parameter's name (relative to the fully_shard module, then to the root).
      uses: every (module, attribute name) that holds the parameter (tied weights).
      orig_id: `id` of the original parameter, to find one managed by two groups.
    """

    def __init__(self, param: nn.Parameter, uses: list[tuple[nn.Module, str]], fqn: str,
                 layout: _bridge.Layout, dim: int = 0):
        if param.ndim == 0:
            raise NotImplementedError(_errors.scalar_param(fqn))
        self.fqn, self.uses, self.orig_id, self.dim = fqn, uses, id(param), dim
        self.shape, self.dtype = tuple(param.shape), param.dtype
        self.rows = param.shape[dim]
        self.local_rows = layout.local_rows(self.rows)
        padded_shape = list(param.shape)
        padded_shape[dim] = layout.padded_rows(self.rows)
        self.padded = param.detach().new_zeros(padded_shape)
        start = layout.rank * padded_shape[dim]
        self._local(self.padded).copy_(param.detach().narrow(dim, start, self.local_rows))
        # On a dim other than 0 a shard shorter than the padding is a strided view.
        self.sharded = nn.Parameter(self._local(self.padded), requires_grad=param.requires_grad)
        self.unsharded: nn.Parameter | None = None
        self.accumulated_grad: torch.Tensor | None = None
        self._cast: torch.Tensor | None = None  # `padded` in another gather dtype
        self._part: tuple[torch.Tensor, jax.Array] | None = None
        self._freed_data: torch.Tensor | None = None
        # HSDP without all-reduce: this replica's reduce-scattered sum, not yet reduced
        # over the replicas (FSDP2's partial reduce output).
        self.partial_grad: torch.Tensor | None = None
        self.to_sharded()

    def gather_input(self, layout: _bridge.Layout, dtype: torch.dtype) -> jax.Array:
        """This rank's padded block in `dtype` as a global jax.Array: the gather's input.

        Imported without a copy (DLPack) for this one gather and dropped with it: JAX
        treats arrays as immutable, and the optimizer updates `padded` in place, so no
        JAX array may outlive the gather over it. Another dtype goes through a
        persistent cast buffer, refreshed here (no gather reads it at that moment).
        """
        source = self.sync_padded()
        if dtype != self.dtype:
            if self._cast is None or self._cast.dtype != dtype:
                self._cast = source.to(dtype)
            else:
                self._cast.copy_(source)
            source = self._cast
        return _bridge.global_block(layout, source, self.dim)

    def sync_padded(self) -> torch.Tensor:
        """`padded`, re-made first if the shard was re-bound to other storage.

        After `param.data = ...` (or `load_state_dict(assign=True)`) the shard no longer
        views `padded`: its values are copied into fresh padded storage, which the
        shard views again, so that gathers and checkpoints see them.
        """
        if self.sharded.untyped_storage().data_ptr() != self.padded.untyped_storage().data_ptr():
            self.padded = self.padded.new_zeros(self.padded.shape)
            self._local(self.padded).copy_(self.sharded.detach())
            self.sharded.data = self._local(self.padded)
        return self.padded

    def keep_part(self, layout: _bridge.Layout, hpz: _bridge.Layout) -> None:
        """Keeps this rank's part of the gathered parameter for an hpZ re-gather.

        The part is the rank's 1/k of the padded full tensor in the gather dtype (its
        own buffer, so the full one can be freed); `hpz` is the group layout.
        """
        full = self.unsharded.data
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
        return self._part[1]

    def drop_part(self) -> None:
        self._part = None

    def to_unsharded(self, full: torch.Tensor) -> None:
        """Makes the modules use `full` (a gathered tensor) as the parameter."""
        if self.unsharded is None:
            self.unsharded = nn.Parameter(full, requires_grad=self.sharded.requires_grad)
        else:
            self.unsharded.data = full
        self._bind(self.unsharded)

    def to_sharded(self) -> None:
        """Makes the modules hold the local shard again and frees the gathered tensor."""
        if self.unsharded is not None:
            # Same dtype and shape, no storage (as FSDP2 frees it): autograd's saved
            # references stay valid for the backward's re-gather, which swaps the data
            # in again, and a gradient can accumulate into it without one
            # (`set_unshard_in_backward(False)`).
            self.unsharded.data = self._freed(self.unsharded.dtype)
        self._bind(self.sharded)

    def _freed(self, dtype: torch.dtype) -> torch.Tensor:
        if self._freed_data is None or self._freed_data.dtype != dtype:
            self._freed_data = torch.empty(self.shape, dtype=dtype)
            self._freed_data.untyped_storage().resize_(0)
        return self._freed_data

    def take_unsharded_grad(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The gradient accumulated since the last reduction, in `dtype`; clears it."""
        grad = None if self.unsharded is None else self.unsharded.grad
        if self.unsharded is not None:
            self.unsharded.grad = None
        if grad is not None:
            grad = grad.to(dtype)
        if self.accumulated_grad is not None:
            grad = self.accumulated_grad if grad is None else self.accumulated_grad + grad
            self.accumulated_grad = None
        return grad

    def accumulate_unsharded_grad(self, dtype: torch.dtype) -> None:
        """Keeps this backward's gradient (no reduction this time), in `dtype`."""
        self.accumulated_grad = self.take_unsharded_grad(dtype)

    def add_partial_grad(self, block: torch.Tensor) -> None:
        """Accumulates this replica's reduce-scattered sum (no all-reduce this time)."""
        self.partial_grad = block.clone() if self.partial_grad is None else self.partial_grad + block

    def with_partial_grad(self, grad: torch.Tensor | None, dtype: torch.dtype, rank: int) -> torch.Tensor | None:
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

    def add_sharded_grad(self, block: torch.Tensor, divide_factor: float) -> None:
        """Adds this rank's rows of a reduced gradient to the shard's `.grad`."""
        grad = (self._local(block) / divide_factor).to(self.dtype)
        if self.sharded.grad is None:
            self.sharded.grad = grad
        else:
            self.sharded.grad += grad

    def _local(self, padded: torch.Tensor) -> torch.Tensor:
        """The shard's rows of a padded block (a view)."""
        return padded.narrow(self.dim, 0, self.local_rows)

    def _bind(self, param: nn.Parameter) -> None:
        for module, name in self.uses:
            module._parameters[name] = param
