"""A group of parameters gathered and reduced together: one collective of each kind."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function
from torch.utils.hooks import RemovableHandle

from funshard import errors
from torch_frontend import _bridge, _flat
from torch_frontend._param import FSDPParam
from torch_frontend._policy import MixedPrecisionPolicy
from torch_frontend._tree import map_tensors, tensors

# One logger for the whole frontend, as FSDP2 has one ("torch.distributed.fsdp.fully_shard"):
# silent unless the application configures it (no handler, level untouched).
logger = logging.getLogger("torch_frontend")

# A started reduce-scatter: its future, the gradients' indices per flat buffer (one
# buffer per dtype), and the flat buffers (JAX reads them until the future completes).
_PendingReduce = tuple[Future[Any], list[list[int]], list[torch.Tensor]]


class TrainingState(enum.Enum):
    """Where a state or group is in the iteration (FSDP2's states)."""

    IDLE = enum.auto()
    FORWARD = enum.auto()
    PRE_BACKWARD = enum.auto()
    POST_BACKWARD = enum.auto()


class ShardedState(enum.Enum):
    """Which tensors a group's modules hold (FSDP2's `ShardedState`)."""

    SHARDED = enum.auto()  # the local shards (DTensors)
    SHARDED_POST_FORWARD = enum.auto()  # the shards, and 1/k of the gathered ones (hpZ)
    UNSHARDED = enum.auto()  # the gathered parameters


def divide_factors(reduce_dtype: torch.dtype, factor: float) -> tuple[float | None, float | None]:
    """(pre, post): FSDP2's division of summed gradients by `factor`, around the sum.

    fp32 and bf16 have the range to sum first and divide once after. Other dtypes
    (fp16) would overflow or underflow that way: they divide by a power of two near
    sqrt(factor) before the sum and by the rest after, with FSDP2's exact factors.
    """
    if reduce_dtype in (torch.float32, torch.bfloat16):
        return None, factor
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre), factor / pre


class FSDPParamGroup:
    """The parameters of one `fully_shard` call and their per-iteration lifecycle.

    Every transition calls one bridge function: `unshard` is ONE all-gather of all
    parameters, `post_backward` ONE reduce-scatter of all their gradients (64-bit
    floating gradients, which JAX cannot sum without x64, reduce in torch's group).
    """

    def __init__(
        self,
        params: list[FSDPParam],
        layout: _bridge.RankLayout,
        mp_policy: MixedPrecisionPolicy,
        reshard_after_forward: bool | int,
        device_mesh=None,
    ):
        self.fsdp_params, self.layout, self.mp_policy = params, layout, mp_policy
        self.device_mesh = device_mesh
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.reduce_grads = True
        self.all_reduce_grads = True  # HSDP: all-reduce over the replicas (FSDP2's flag)
        self.unshard_in_backward = True
        self.gradient_divide_factor: float | None = None
        # FSDPModule's communication settings (see their setters in _fully_shard.py).
        self.force_sum_reduction_for_comms = False
        self.reduce_scatter_unused_params = False
        self.reduce_scatter_max_input_buffers = 1
        self.separate_reduce_scatter_group = False
        self.allocate_memory_from_process_group = False
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.all_reduce_hook_stream: Any = None  # a CUDA stream, where torch has CUDA
        # FSDP2's `AllGather` / `ReduceScatter` objects (`set_custom_all_gather`, ...):
        # where set, that collective runs in torch, over the shard dim's process group.
        self.custom_all_gather: Any = None
        self.custom_reduce_scatter: Any = None
        self._gathered_in_torch = False  # the dispatched gather ran a custom all-gather
        self._missing: list[str] = []  # trained parameters without a gradient (this step)
        self._training_state = TrainingState.IDLE
        self._sharded_state = ShardedState.SHARDED
        self._all_gather_result: Future[Any] | None = None  # dispatched, not yet bound
        self._buckets: list[_flat.Bucket] | None = None  # its flat buffers (None: hpZ)
        self._parts: _bridge.RankLayout | None = None  # hpZ: the group layout of kept parts
        self.name = "the root"  # the module's name under the root (set at lazy init)
        # FSDP2's `_module_fqn`: the module's path from the root ("" for the root, the
        # paths joined by ", " for a group of modules); None until lazy init.
        self._module_fqn: str | None = None
        # The state-dict hooks on each module holding the group's parameters, by module
        # (FSDP2's dicts; the post-load hook is FSDP2's per-parameter one, per module).
        self._module_to_pre_save_state_dict_hook_handle: dict[nn.Module, RemovableHandle] = {}
        self._module_to_pre_load_state_dict_hook_handle: dict[nn.Module, RemovableHandle] = {}
        self._module_to_post_load_state_dict_hook_handle: dict[nn.Module, RemovableHandle] = {}

    def _with_fqn(self, label: str) -> str:
        """`label` as FSDP2 names a profiler range or log record: "<label> (<fqn>)".

        The root (fqn "") and a group not yet initialised keep the bare label, as in
        FSDP2's `_with_fqn`.
        """
        return f"{label} ({self._module_fqn})" if self._module_fqn else label

    @property
    def comm_ctx(self) -> _bridge.CommContext:
        """FSDP2's `comm_ctx`: the process's collective launcher (orders collectives).

        Shared by every group of the job; it holds the reduce-scatter in flight.
        """
        return self.layout.comm

    @property
    def is_sharded(self) -> bool:
        return self._sharded_state == ShardedState.SHARDED

    @property
    def is_sharded_post_forward(self) -> bool:
        return self._sharded_state == ShardedState.SHARDED_POST_FORWARD

    @property
    def is_unsharded(self) -> bool:
        return self._sharded_state == ShardedState.UNSHARDED

    def param_dtype(self, param: FSDPParam) -> torch.dtype:
        return param.gather_dtype(self.mp_policy.param_dtype)

    def reduce_dtype(self, param: FSDPParam) -> torch.dtype:
        if not param.dtype.is_floating_point:
            return param.dtype
        return self.mp_policy.reduce_dtype or self.param_dtype(param)

    def unshard(self, async_op: bool = False) -> None:
        """Gathers every parameter of the group (one collective) and binds the results.

        Args:
          async_op: only dispatch the gather (a prefetch); `wait_for_unshard` binds.

        Raises:
          ValueError: a parameter was replaced after fully_shard.
          RuntimeError: parameters are still on the meta device (all are named).
        """
        if self.is_unsharded or self._all_gather_result is not None:
            if not async_op:
                self.wait_for_unshard()
            return
        label = self._with_fqn("FSDP::all_gather")
        with record_function(label):
            if self.fsdp_params and self._sharded_state == ShardedState.SHARDED_POST_FORWARD:
                # hpZ: gather the kept parts within the group of k ranks only.
                parts = self._parts
                assert parts is not None, "_to_sharded_post_forward sets it with the state"
                blocks = [p.part_block() for p in self.fsdp_params]
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug(
                        "%s: all-gather of %d parameters within groups of %d "
                        "ranks (hpZ re-gather)%s",
                        label,
                        len(blocks),
                        parts.world,
                        " (prefetch)" if async_op else "",
                    )
                self.comm_ctx.label_next(f"{self.name!r} (hpZ re-gather)")
                self._all_gather_result = _bridge.start_all_gather(
                    parts, blocks, *self._rows_and_dims()
                )
                self._gathered_in_torch = False
            elif self.fsdp_params:
                self._start_flat_gather(label, async_op)
            else:
                self._sharded_state = ShardedState.UNSHARDED
        if not async_op:
            self.wait_for_unshard()

    def _rows_and_dims(self) -> tuple[list[int], list[int]]:
        return [p.rows for p in self.fsdp_params], [p.dim for p in self.fsdp_params]

    def _start_flat_gather(self, label: str, async_op: bool) -> None:
        """Starts one all-gather of the group's shards, one flat buffer per dtype.

        Args:
          label: the profiler label of the gather, for its debug record.
          async_op: whether this is a prefetch (said in the debug record).
        """
        for param in self.fsdp_params:
            param.check_bound()
        sources = [p.sync_padded() for p in self.fsdp_params]
        on_meta = [
            p._param_fqn
            for p, source in zip(self.fsdp_params, sources, strict=True)
            if source.is_meta
        ]
        if on_meta:
            raise RuntimeError(_meta_forward(on_meta))
        dtypes = [self.param_dtype(p) for p in self.fsdp_params]
        buckets = _flat.buckets(dtypes, [s.shape for s in sources])
        world = self.layout.world
        flats = [_flat.copy_in(b, sources, dtypes) for b in buckets]
        if self.custom_all_gather is not None:
            # The user's collective, now (FSDP2 on CPU runs it synchronously too).
            done: Future[Any] = Future()
            done.set_result(self._custom_gather(flats))
            self._all_gather_result, self._buckets = done, buckets
            self._gathered_in_torch = True
            return
        blocks = [_bridge.global_block(self.layout, flat) for flat in flats]
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "%s: all-gather of %d parameters over %d ranks, %s%s",
                label,
                len(self.fsdp_params),
                world,
                _describe_buckets(buckets, world),
                " (prefetch)" if async_op else "",
            )
        self.comm_ctx.label_next(f"{self.name!r}")
        future = _bridge.start_all_gather(self.layout, blocks, [world * b.total for b in buckets])
        self._all_gather_result = future
        self._buckets = buckets
        self._gathered_in_torch = False

    def _shard_group(self, method: str) -> dist.ProcessGroup:
        """The torch process group of the shard dim (FSDP2's all-gather group)."""
        mesh = self.device_mesh
        if mesh is None:
            raise errors.ShardingValueError(
                f"{method} on {self.name}: the module has no torch DeviceMesh to run the "
                "custom collective over; pass mesh= to fully_shard."
            )
        return mesh.get_group(mesh.ndim - 1)

    def _custom_gather(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        """Runs the custom all-gather on each flat buffer (FSDP2's call and layout).

        The output is allocated by the collective's `allocate`, `world` times the
        input, rank-major; the input is this rank's slice of it.
        """
        comm, world, rank = self.custom_all_gather, self.layout.world, self.layout.rank
        group = self._shard_group("set_custom_all_gather")
        outs = []
        for flat in flats:
            n = flat.numel()
            out = comm.allocate((world * n,), dtype=flat.dtype, device=flat.device)
            self._check_allocated(out, world * n, flat.dtype, "set_custom_all_gather")
            inp = out.narrow(0, rank * n, n)
            inp.copy_(flat)
            work = comm(output_tensor=out, input_tensor=inp, group=group, async_op=False)
            if work is not None:
                work.wait()
            outs.append(out)
        return outs

    def _check_allocated(self, out: Any, numel: int, dtype: torch.dtype, method: str) -> None:
        if (
            not isinstance(out, torch.Tensor)
            or out.numel() != numel
            or out.dtype != dtype
            or not out.is_contiguous()
        ):
            got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else repr(out)
            raise errors.ShardingValueError(
                f"{method} on {self.name}: the collective's allocate() returned {got}, "
                f"where the default allocates a contiguous ({numel},) {dtype} tensor; "
                "allocate(size, dtype=, device=) must return a tensor of that size and dtype."
            )

    def _finish_gather(self, pending: Future[Any]) -> list[torch.Tensor]:
        """The gathered flat buffers of a dispatched gather (JAX's or a custom one)."""
        if self._gathered_in_torch:
            return pending.result()
        return _bridge.finish_all_gather(pending)

    def wait_for_unshard(self) -> None:
        """Completes a dispatched gather and binds the gathered parameters."""
        if self._all_gather_result is None:
            return
        with record_function(self._with_fqn("FSDP::all_gather_copy_out")):
            fulls = self._finish_gather(self._all_gather_result)
            buckets, self._all_gather_result, self._buckets = self._buckets, None, None
            if buckets is None:  # hpZ: one gathered tensor per parameter
                for param, full in zip(self.fsdp_params, fulls, strict=True):
                    param.to_unsharded(_bridge.from_words(full, self.param_dtype(param)))
            else:
                self._copy_out(buckets, fulls)
            for param in self.fsdp_params:
                param.drop_part()
        self._parts = None
        self._sharded_state = ShardedState.UNSHARDED

    def _copy_out(self, buckets: list, fulls: list) -> None:
        params = self.fsdp_params
        targets = [p.unsharded_padded(self.param_dtype(p)) for p in params]
        unsharded = tuple(p.unsharded_param for p in params)  # made by unsharded_padded
        # Autograd saved views of these parameters in forward; refilling them for the
        # backward is not the in-place change its version check guards against.
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(unsharded):
            for bucket, full in zip(buckets, fulls, strict=True):
                _flat.copy_out(
                    bucket,
                    full,
                    targets,
                    [p.shape for p in params],
                    [p.dim for p in params],
                    self.layout.world,
                )
        for param in params:
            param.bind_unsharded()

    def reshard(self) -> None:
        """Binds the local shards again and drops the gathered tensors (and hpZ parts)."""
        if self._all_gather_result is not None:
            # Its input is the shards' storage, which torch may write next (optimizer).
            self._finish_gather(self._all_gather_result)
            self._all_gather_result = self._buckets = None
        for param in self.fsdp_params:
            param.to_sharded()
            param.drop_part()
        self._parts = None
        self._sharded_state = ShardedState.SHARDED

    def _to_sharded_post_forward(self, k: int) -> None:
        """Keeps 1/k of each gathered parameter and frees the rest (FSDP2's hpZ).

        The backward's `unshard` then gathers within groups of k consecutive ranks.
        """
        self.wait_for_unshard()
        if not self.is_unsharded:
            return
        hpz = _bridge.hpz_layout(self.layout, k)
        for param in self.fsdp_params:
            param.keep_part(self.layout, hpz)
            param.to_sharded()
        self._parts = hpz
        self._sharded_state = ShardedState.SHARDED_POST_FORWARD

    def pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Unshards; on the first module of the pass, hooks post-backward onto the inputs."""
        entering = self._training_state != TrainingState.FORWARD
        self._training_state = TrainingState.FORWARD
        self.unshard()
        if entering:
            args, kwargs = self._register_post_backward_hook(args, kwargs)
        return args, kwargs

    def post_forward(self) -> None:
        k = self.reshard_after_forward
        if k is True or k == self.layout.world:
            self.reshard()
        elif k is not False and k > 1:
            # Without autograd no backward follows: nothing is worth keeping.
            self._to_sharded_post_forward(k) if torch.is_grad_enabled() else self.reshard()
        self._training_state = TrainingState.IDLE

    def pre_backward(self) -> None:
        if self._training_state == TrainingState.PRE_BACKWARD:
            return
        self._training_state = TrainingState.PRE_BACKWARD
        if self.unshard_in_backward:
            self.unshard()

    def prefetch_for_backward(self) -> None:
        """Dispatches the backward's gather early, unless the backward needs none."""
        if self.unshard_in_backward:
            self.unshard(async_op=True)

    def post_backward(self) -> None:
        """Reduce-scatters the group's gradients (one collective) into the shards' `.grad`.

        Idempotent within a backward: a group whose parameters got no gradient only
        reshards. Without gradient sync the gradients stay unsharded, accumulated in
        the reduce dtype, until a backward that synchronises.
        """
        self._training_state = TrainingState.POST_BACKWARD
        logger.debug("%s", self._with_fqn("FSDP::post_backward"))
        if not self.reduce_grads:
            with record_function(self._with_fqn("FSDP::post_backward_accumulate")):
                for param in self.fsdp_params:
                    param.accumulate_unsharded_grad(self.reduce_dtype(param))
            self._reshard_after_backward()
            return
        all_reduce = self.all_reduce_grads or not self.layout.replicate_axes
        with record_function(self._with_fqn("FSDP::post_backward_accumulate")):
            with_grad, grads, posts = self._take_grads(all_reduce)
        # Recorded with the reduce-scatter: a parameter without a gradient on some ranks
        # only makes their reduce-scatters differ, and the error names it.
        reduced = {id(p) for p in with_grad}
        self._missing = [
            p._param_fqn
            for p in self.fsdp_params
            if id(p) not in reduced and p.sharded_param.requires_grad
        ]
        self._reshard_after_backward()
        if not with_grad:
            return
        with record_function(self._with_fqn("FSDP::post_backward_rs_wait")):
            # As FSDP2: the previous group's reduce-scatter ends (it had this group's
            # backward to run in) and frees its flat input before this one's is
            # allocated, unless the cap (`set_reduce_scatter_max_input_buffers`) lets
            # more stay in flight.
            self.comm_ctx.finish_reduce(keep=self.comm_ctx.reduce_scatter_max_input_buffers - 1)
        with record_function(self._with_fqn("FSDP::post_backward_reduce")):
            self._reduce(with_grad, grads, posts, all_reduce)

    def _take_grads(self, all_reduce: bool) -> tuple[list[FSDPParam], list, list]:
        """(parameters with a gradient, their gradients pre-divided, post-divide factors)."""
        factor = self.gradient_divide_factor or float(self.layout.data_parallel)
        with_grad, grads, posts = [], [], []
        for param in self.fsdp_params:
            dtype = self.reduce_dtype(param)
            grad = param.take_unsharded_grad(dtype)
            if grad is None and self.reduce_scatter_unused_params:
                # This rank did not use it (another rank may have): zeros keep every
                # rank's reduce-scatter the same (FSDP2's setting, DDP's unused params).
                grad = param.zero_unsharded_grad(dtype)
            if all_reduce:
                grad = param.with_partial_grad(grad, dtype, self.layout.rank)
            if grad is not None:
                pre, post = divide_factors(dtype, factor)
                with_grad.append(param)
                grads.append(grad if pre is None else grad / pre)
                posts.append(post)
        return with_grad, grads, posts

    def _reduce(
        self, with_grad: list[FSDPParam], grads: list[torch.Tensor], posts: list, all_reduce: bool
    ) -> None:
        """Starts the reduce-scatter of `grads`; it writes the shards' `.grad` when done."""
        dims, shapes = [p.dim for p in with_grad], [g.shape for g in grads]
        if self.custom_reduce_scatter is not None:
            pending, blocks = None, self._custom_reduce_scatter(grads, dims, posts)
        else:
            pending, blocks = self._start_reduce_scatter(grads, dims, all_reduce)

        def finish() -> None:  # once the reduce-scatter is done: write the gradients
            if pending is not None:
                self._finish_blocks(pending, shapes, dims, blocks)
            if self.all_reduce_hook is not None and (all_reduce or not self.layout.replicate_axes):
                self._run_all_reduce_hook(blocks, posts)
            for param, block, post in zip(with_grad, blocks, posts, strict=True):
                assert block is not None, "_finish_blocks fills every block"
                if all_reduce:
                    param.add_sharded_grad(block, post)
                else:
                    param.add_partial_grad(block)

        # The flat inputs stay referenced by `pending` (JAX reads them) until it completes.
        self.comm_ctx.hold_reduce(None if pending is None else pending[0], finish)

    def _custom_reduce_scatter(
        self, grads: list[torch.Tensor], dims: list[int], posts: list
    ) -> list[torch.Tensor | None]:
        """Runs the custom reduce-scatter, one flat buffer per dtype (FSDP2's call).

        The reduce op is FSDP2's: fp32 and bf16 average in the collective (or
        pre-multiply by 1 / the gradient divide factor), and those gradients' post
        divisions are cleared from `posts`; other dtypes, and every dtype with
        `set_force_sum_reduction_for_comms(True)`, sum (their pre-division is done).

        Returns:
          Each gradient's block of this rank, in order.
        """
        comm, world = self.custom_reduce_scatter, self.layout.world
        group = self._shard_group("set_custom_reduce_scatter")
        blocks: list[torch.Tensor | None] = [None] * len(grads)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, grad in enumerate(grads):
            by_dtype.setdefault(grad.dtype, []).append(i)
        for dtype, members in by_dtype.items():
            op, divided = self._reduce_op(dtype)
            member_dims = [dims[i] for i in members]
            flat = _flat.reduce_input([grads[i] for i in members], member_dims, world)
            inp = comm.allocate((flat.numel(),), dtype=dtype, device=flat.device)
            self._check_allocated(inp, flat.numel(), dtype, "set_custom_reduce_scatter")
            inp.copy_(flat)
            del flat
            out = comm.allocate((inp.numel() // world,), dtype=dtype, device=inp.device)
            self._check_allocated(out, inp.numel() // world, dtype, "set_custom_reduce_scatter")
            work = comm(output_tensor=out, input_tensor=inp, group=group, op=op, async_op=False)
            if work is not None:
                work.wait()
            parts = _flat.split_reduced(out, [grads[i].shape for i in members], member_dims, world)
            for i, part in zip(members, parts, strict=True):
                blocks[i] = part
                if divided:
                    posts[i] = None
        return blocks

    def _reduce_op(self, dtype: torch.dtype) -> tuple[Any, bool]:
        """(FSDP2's reduce-scatter op for `dtype`, whether the op divides)."""
        factor, world = self.gradient_divide_factor, self.layout.world
        if self.force_sum_reduction_for_comms or dtype not in (torch.float32, torch.bfloat16):
            return dist.ReduceOp.SUM, False
        if factor is None and self.layout.data_parallel == 1:
            return dist.ReduceOp.SUM, False
        if factor is None or factor == world:
            return dist.ReduceOp.AVG, True
        return dist.ReduceOp.PREMUL_SUM(1 / factor), True

    def _run_all_reduce_hook(self, blocks: list, posts: list) -> None:
        """Calls the all-reduce hook on the reduced gradients, one flat tensor per dtype.

        As FSDP2's `reduce_output`: this rank's blocks in parameter order, flat and
        writable, after the HSDP all-reduce; in fp32 and bf16 already divided (FSDP2
        averages in the collective there), else before the post-division. The hook's
        in-place changes are what the gradients receive (`blocks` and `posts` are
        updated in place).
        """
        hook = self.all_reduce_hook
        assert hook is not None
        in_op = not self.force_sum_reduction_for_comms
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, block in enumerate(blocks):
            by_dtype.setdefault(block.dtype, []).append(i)
        for dtype, members in by_dtype.items():
            divided = in_op and dtype in (torch.float32, torch.bfloat16)
            parts = [
                blocks[i] / posts[i] if divided and posts[i] not in (None, 1) else blocks[i]
                for i in members
            ]
            flat = torch.cat([p.reshape(-1) for p in parts])  # a new, writable tensor
            if self.all_reduce_hook_stream is not None:
                with torch.cuda.stream(self.all_reduce_hook_stream):
                    hook(flat)
                self.all_reduce_hook_stream.synchronize()
            else:
                hook(flat)
            for i, part in zip(members, flat.split([b.numel() for b in parts]), strict=True):
                blocks[i] = part.view(blocks[i].shape)
                if divided:
                    posts[i] = None

    def _start_reduce_scatter(
        self, grads: list[torch.Tensor], dims: list[int], all_reduce: bool
    ) -> tuple[_PendingReduce | None, list[torch.Tensor | None]]:
        """Starts the group's reduce-scatter on JAX; 64-bit gradients reduce now, in torch.

        The others cross as one flat buffer per dtype (`_flat.reduce_input`): one
        operand each, whatever the number of parameters.

        Returns:
          (the started reduce-scatter or None, each gradient's block: 64-bit ones
          filled, the others None until `_finish_blocks` fills them).
        """
        blocks: list[torch.Tensor | None] = [None] * len(grads)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, grad in enumerate(grads):
            if grad.numel() == 0:
                # Nothing to sum (a parameter with a size-0 dim); torch's flat packing
                # (`_chunk_cat`) rejects empty tensors, as in FSDP2's backward.
                world = self.layout.world
                blocks[i] = grad.new_zeros(_flat.block_shape(grad.shape, dims[i], world))
            elif grad.element_size() == 8:
                blocks[i] = self._torch_reduce_scatter(grad, dims[i], all_reduce)
            else:
                by_dtype.setdefault(grad.dtype, []).append(i)
        if not by_dtype:
            return None, blocks
        world = self.layout.world
        members = list(by_dtype.values())
        flats = [
            _flat.reduce_input(
                [grads[i] for i in m],
                [dims[i] for i in m],
                world,
                _bridge.row_align(self.layout, grads[m[0]].dtype),
            )
            for m in members
        ]
        if logger.isEnabledFor(logging.DEBUG):
            self._log_reduce_scatter(flats, all_reduce)
        self.comm_ctx.label_next(f"{self.name!r}", self._missing)
        pending = _bridge.start_reduce_scatter(self.layout, flats, all_reduce=all_reduce)
        return (pending, members, flats), blocks

    def _log_reduce_scatter(self, flats: list[torch.Tensor], all_reduce: bool) -> None:
        label, layout = self._with_fqn("FSDP::post_backward_reduce"), self.layout
        sizes = ", ".join(f"{f.numel()} x {f.dtype}" for f in flats)
        logger.debug(
            "%s: reduce-scatter over %d ranks of %d flat buffer(s) (%s)",
            label,
            layout.world,
            len(flats),
            sizes,
        )
        if all_reduce and layout.replicate_axes:
            # HSDP: one JAX program sums over the replicas too (no collective of its own).
            logger.debug(
                "%s: all-reduce over %d replicas (in the same program)",
                label,
                layout.data_parallel // layout.world,
            )

    def _finish_blocks(
        self,
        pending: _PendingReduce,
        shapes: list[torch.Size],
        dims: list[int],
        blocks: list[torch.Tensor | None],
    ) -> None:
        """Fills `blocks` with this rank's parts of the finished flat reduce-scatter."""
        future, members, _ = pending
        for m, reduced in zip(members, _bridge.finish_reduce_scatter(future), strict=True):
            parts = _flat.split_reduced(
                reduced, [shapes[i] for i in m], [dims[i] for i in m], self.layout.world
            )
            for i, part in zip(m, parts, strict=True):
                blocks[i] = part

    def _torch_reduce_scatter(self, grad: torch.Tensor, dim: int, all_reduce: bool) -> torch.Tensor:
        # JAX without x64 holds no 64-bit float: torch's group sums these exactly in
        # their own dtype (an all-reduce and this rank's rows, as FSDP2 on gloo).
        full = _bridge.padded_full(self.layout, grad, dim).clone()
        mesh = self.device_mesh
        replicas = all_reduce and mesh.ndim > 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "%s: all-reduce of a %s gradient %s in torch's group (JAX holds no 64-bit float)%s",
                self._with_fqn("FSDP::post_backward_reduce"),
                full.dtype,
                tuple(full.shape),
                ", then over the replicas" if replicas else "",
            )
        dist.all_reduce(full, group=mesh.get_group(mesh.ndim - 1))
        if replicas:
            dist.all_reduce(full, group=mesh.get_group(0))
        rows = self.layout.padded_rows(grad.shape[dim])
        return full.narrow(dim, self.layout.rank * rows, rows)

    def cancel_prefetch(self) -> None:
        """Completes and drops a dispatched gather that nothing waited for."""
        if self._all_gather_result is not None:
            self._finish_gather(self._all_gather_result)
            self._all_gather_result = self._buckets = None

    def drop_stale_parts(self) -> None:
        """Reshards fully if hpZ parts from an earlier forward are still kept.

        They were copied from the parameters of that forward; a later optimizer step
        changes the shards, so a new iteration never gathers from them.
        """
        if self._sharded_state == ShardedState.SHARDED_POST_FORWARD:
            self.reshard()

    def _reset_iter_state(self) -> None:
        """Drops this iteration's unreduced gradients and reshards (after an exception)."""
        for param in self.fsdp_params:
            if param._unsharded_param is not None:
                param._unsharded_param.grad = None
        self._training_state = TrainingState.IDLE
        self.reshard()

    def _reshard_after_backward(self) -> None:
        if self.reshard_after_backward:
            with record_function(self._with_fqn("FSDP::post_backward_reshard")):
                self.reshard()

    def _register_post_backward_hook(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        # Autograd runs the Function's backward once the gradients of the inputs are
        # computed, i.e. after the module's backward (parameter gradients accumulate
        # first: AccumulateGrad nodes have the highest priority). Without such inputs,
        # the root's final callback runs post_backward.
        needing = [t for t in tensors((args, kwargs)) if t.requires_grad]
        if not needing or not torch.is_grad_enabled():
            return args, kwargs
        outs = iter(RegisterPostBackwardFunction.apply(self, *needing))
        return map_tensors(lambda t: next(outs) if t.requires_grad else t, (args, kwargs))


def _describe_buckets(buckets: list, world: int) -> str:
    """ "<elements> x <dtype>" of each flat buffer a gather returns, for debug records."""
    return ", ".join(f"{world * b.total} x {b.dtype}" for b in buckets)


def _meta_forward(fqns: list[str]) -> str:
    # FSDP2's sentence first: code written for FSDP2 may match it.
    return (
        "FSDP parameters should be materialized from meta device before training, but the "
        f"following were still on meta device: {fqns}\nMaterialise the model after "
        "fully_shard with module.to_empty(device=...) and initialise it (e.g. "
        "reset_parameters() on each module) before the first forward."
    )


class RegisterPostBackwardFunction(torch.autograd.Function):
    """Identity on the module's inputs whose backward runs the group's post-backward."""

    @staticmethod
    def forward(ctx, group: FSDPParamGroup, *inputs: torch.Tensor):
        ctx.group = group
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.group.post_backward()
        ctx.group.comm_ctx.finish_after_backward()
        return (None, *grads)


def module_params(modules: list[nn.Module], managed_elsewhere) -> list[tuple[nn.Parameter, list]]:
    """The parameters `modules` manage, each with every (module, name) holding it.

    Submodules that already have their own state (an inner `fully_shard`) are skipped,
    with everything below them. Parameters are deduplicated by identity.
    """
    found: dict[int, tuple[nn.Parameter, list]] = {}
    stack = list(reversed(modules))
    seen: set[int] = set()
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for name, param in module._parameters.items():
            if param is not None:
                found.setdefault(id(param), (param, []))[1].append((module, name))
        stack.extend(c for c in reversed(list(module.children())) if not managed_elsewhere(c))
    return list(found.values())
