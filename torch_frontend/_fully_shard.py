"""`fully_shard`: FSDP2's entry point, and `FSDPModule`, the class it mixes in."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, cast, overload

import torch
from torch import nn
from torch.distributed import _symmetric_memory as symm_mem
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Replicate

from funshard import comm, errors
from torch_frontend import _bridge, _distributed, _param, _state_dict, _tree
from torch_frontend._group import FSDPParamGroup, module_params
from torch_frontend._param import FSDPParam, ShardSpec
from torch_frontend._policy import MixedPrecisionPolicy
from torch_frontend._state import FSDPState, get_module_fsdp_state

cls_to_fsdp_cls: dict[type, type] = {}

logger = logging.getLogger("torch_frontend")  # silent unless configured (see _group.py)


# FSDP2 raises built-in types that say little for these mistakes (IndexError,
# AssertionError, TypeError); each class here is that type, so code written for FSDP2
# still catches it, and also funshard's, with a message naming the module and the fix.
class EmptyGroupError(errors.ShardingValueError, IndexError):
    """`fully_shard([])`: FSDP2 fails with IndexError (tuple index out of range)."""


class ShardedTwiceError(errors.ShardingValueError, AssertionError):
    """A module fully sharded twice (or listed twice): FSDP2's contract AssertionError."""


class SharedParameterError(errors.ShardingValueError, TypeError):
    """A parameter another group already manages: FSDP2 fails with a TypeError."""


class DeepcopyError(errors.UnsupportedError, AssertionError):
    """`copy.deepcopy` of a sharded module: FSDP2 raises AssertionError."""


class TensorParallelMeshError(errors.ShardingValueError, RuntimeError, TypeError):
    """A TP DTensor whose mesh does not compose with `fully_shard`'s.

    FSDP2 fails with RuntimeError (meshes of two `init_device_mesh` calls, or
    overlapping ones) or TypeError (a mesh without dim names: "Invariant encountered").
    """


if TYPE_CHECKING:
    from jax.sharding import Mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import Shard

if TYPE_CHECKING:
    # FSDPModule is only ever mixed into an nn.Module subclass (`FSDP<Cls>(FSDPModule,
    # Cls)`, made by `_fsdp_class`): its methods use the module's, and `super()` reaches
    # the module's `__call__` and `_apply`. At run time the base is `object`.
    _ModuleBase = nn.Module
else:
    _ModuleBase = object


class FSDPModule(_ModuleBase):
    """Mixed into every module `fully_shard` was applied to (class `FSDP<Cls>`)."""

    def __deepcopy__(self, memo):
        raise DeepcopyError(_deepcopy_message(self))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # Dynamo traces the call itself, not this
            return super().__call__(*args, **kwargs)
        try:
            return super().__call__(*args, **kwargs)
        except RuntimeError as exc:
            _note_converted_dtype(self, exc, (args, kwargs))
            raise

    def _get_fsdp_state(self) -> FSDPState:
        state = get_module_fsdp_state(self)
        if state is None:
            raise RuntimeError(not_fsdp_module("FSDPModule", self))
        return state

    def _fsdp_states(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._get_fsdp_state()]
        states: list[FSDPState] = []
        for module in self.modules():
            state = get_module_fsdp_state(module)
            if state is not None and state not in states:
                states.append(state)
        return states

    def _fsdp_groups(self, recurse: bool) -> list[FSDPParamGroup]:
        """Every parameter group of these states (several where parameters have own meshes)."""
        return [g for state in self._fsdp_states(recurse) for g in state._fsdp_param_groups]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gathers this module's parameters now (one collective); they stay until reshard.

        Args:
          async_op: only dispatch the gather (JAX runs it while torch computes) and
            return a handle whose `wait()` completes it and binds the parameters.

        Returns:
          An `UnshardHandle` with `async_op=True`, else None.
        """
        groups = self._get_fsdp_state()._fsdp_param_groups
        for group in groups:
            group.unshard(async_op=async_op)
        return UnshardHandle(groups) if async_op else None

    def reshard(self) -> None:
        """Frees the gathered parameters; the module holds its local shards again."""
        for group in self._get_fsdp_state()._fsdp_param_groups:
            group.reshard()

    def _apply(self, *args, **kwargs):
        # `module.to(dtype / device)`, `to_empty` and `half()` convert the sharded
        # DTensors: reshard first so that those are what the modules hold, then adopt
        # the converted local tensors as the padded storage JAX gathers from.
        groups = [] if (state := get_module_fsdp_state(self)) is None else state._fsdp_param_groups
        for group in groups:
            group.reshard()
        result = super()._apply(*args, **kwargs)
        with torch.no_grad():
            for group in groups:
                for param in group.fsdp_params:
                    param.reset_sharded_param()
        return result

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """False: backward keeps gradients unsharded and unreduced (gradient accumulation).

        Also sets `set_requires_all_reduce` to the same value, as FSDP2 does.
        """
        for group in self._fsdp_groups(recurse):
            group.reduce_grads = group.all_reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters gradients within the replica but skips the all-reduce.

        Gradient accumulation with less communication: each backward without it adds
        this replica's reduce-scattered sum to a pending partial gradient (the
        parameters' `.grad` is not touched); the next backward with it all-reduces the
        pending sum together with its own gradients. No effect without a replicate axis.
        """
        for group in self._fsdp_groups(recurse):
            group.all_reduce_grads = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Changes `reshard_after_forward` (a bool) at run time."""
        if not isinstance(reshard_after_forward, bool):
            raise errors.ShardingValueError(
                f"set_reshard_after_forward: expected a bool, got {reshard_after_forward!r}."
            )
        for state in self._fsdp_states(recurse):
            for group in state._fsdp_param_groups:
                group.reshard_after_forward = reshard_after_forward
            state._auto_reshard_after_forward = False

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """False keeps parameters gathered after backward (e.g. between accumulation steps)."""
        for group in self._fsdp_groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Records whether the next backward is the iteration's last (FSDP2's flag)."""
        self._get_fsdp_state()._state_ctx.is_last_backward = is_last_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divides reduced gradients by `factor` instead of the data-parallel size."""
        for group in self._fsdp_groups(recurse=False):
            group.gradient_divide_factor = float(factor)

    def reset_iter_state(self) -> None:
        """After an exception mid-iteration: discard its gradients in flight, reshard all.

        Raises:
          RuntimeError: called on a module that is not the root.
        """
        self._get_fsdp_state()._reset_iter_state()

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's older name of `set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: the backward does not gather this module's parameters again.

        For modules whose backward needs no parameters (e.g. an embedding lookup,
        whose weight gradient needs only the indices); the gradient is still
        reduce-scattered. With False, a backward that does need them fails in torch.
        """
        for group in self._fsdp_groups(recurse=False):
            group.unshard_in_backward = unshard_in_backward

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for FSDP2 compatibility: reductions here are always sums.

        The core reduce-scatters with a sum and divides afterwards, which is what
        this setting asks FSDP2 to do; either value keeps that behaviour.
        """
        if not isinstance(enable, bool):
            raise errors.ShardingTypeError(
                f"set_force_sum_reduction_for_comms: expected a bool, got {enable!r}."
            )
        for group in self._fsdp_groups(recurse=False):
            group.force_sum_reduction_for_comms = enable  # what an all-reduce hook sees

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: Any = None
    ) -> None:
        """Calls `hook(reduce_output)` on this module's reduced gradients (FSDP2's hook).

        `reduce_output` is this rank's flat gradient shard, one tensor per dtype (one
        per module in practice): the reduce-scatter's output, with HSDP after the
        all-reduce over the replicas, in the reduce dtype, with the padding rows. What
        the hook writes in place is what the gradients receive; its return value is
        ignored. As in FSDP2, fp32 and bf16 gradients are already divided (FSDP2
        averages inside the collective there); other dtypes, and every dtype after
        `set_force_sum_reduction_for_comms(True)`, are divided after the hook. It is
        not called where HSDP skips the all-reduce (`set_requires_all_reduce(False)`).
        The hook runs once the reduce-scatter completes, at the next module's
        post-backward or at the end of the backward.

        Args:
          hook: a callable of one tensor.
          stream: a CUDA stream to run the hook in (FSDP only, not HSDP).

        Raises:
          ValueError: the module's parameters are in several groups (per-parameter
            meshes), or `stream` is given with HSDP.
          TypeError: `hook` is not a callable of one positional argument.
        """
        groups = self._fsdp_groups(recurse=False)
        if len(groups) > 1:
            raise errors.ShardingValueError(
                "set_all_reduce_hook is not supported with multiple param groups (from "
                f"per-param mesh via shard_placement_fn). {type(self).__name__}'s "
                "parameters are in several groups; set the hook on each group's module."
            )
        _check_one_argument(hook, "set_all_reduce_hook", "hook(reduce_output: torch.Tensor)")
        for group in groups:
            group.all_reduce_hook = hook
            if stream is not None:
                if group.layout.replicate_axes:
                    raise errors.ShardingValueError(
                        "stream cannot be set when using native HSDP "
                        f"({type(self).__name__}'s mesh has a replicate dim): the hook "
                        "runs after the all-reduce over the replicas."
                    )
                group.all_reduce_hook_stream = stream

    def set_custom_all_gather(self, comm: Any) -> None:
        """Runs this module's all-gathers with the user's collective (FSDP2's `AllGather`).

        `comm.allocate(size, dtype=, device=)` makes the output buffer (`world` times
        the flat input, rank-major), and `comm(output_tensor=, input_tensor=, group=,
        async_op=False)` fills it, in torch, over the shard dim's process group: the
        same calls, sizes and layout as FSDP2's, the input being this rank's slice of
        the output. The gather then runs on the calling thread (no prefetch overlap),
        as FSDP2's on CPU. Not for the hpZ re-gather of `reshard_after_forward=k`.

        Args:
          comm: an object with `allocate` and `__call__` as above.

        Raises:
          ValueError: the module's parameters are in several groups (per-parameter
            meshes); at the first gather, `allocate` returned a tensor of another
            size or dtype.
          TypeError: `comm` lacks `allocate` or is not callable.
        """
        for group in self._custom_comm_groups(comm, "set_custom_all_gather"):
            group.custom_all_gather = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Runs this module's gradient reduce-scatters with the user's collective.

        FSDP2's `ReduceScatter`: `comm.allocate` makes the flat input (`world` times
        the output, rank-major) and the output, and `comm(output_tensor=,
        input_tensor=, group=, op=, async_op=False)` reduces, in torch, over the shard
        dim's process group, with FSDP2's op (`AVG` for fp32 and bf16, `SUM` after a
        pre-division for fp16 or with `set_force_sum_reduction_for_comms(True)`). It
        runs on the calling thread, at the module's post-backward.

        Args:
          comm: an object with `allocate` and `__call__` as above.

        Raises:
          ValueError: the module's parameters are in several groups (per-parameter
            meshes); at the first reduction, `allocate` returned a tensor of another
            size or dtype.
          TypeError: `comm` lacks `allocate` or is not callable.
          NotImplementedError: the module's mesh has a replicate dim (HSDP): not yet.
        """
        groups = self._custom_comm_groups(comm, "set_custom_reduce_scatter")
        if any(g.layout.replicate_axes for g in groups):
            raise errors.UnsupportedError(
                f"set_custom_reduce_scatter on {type(self).__name__}: not yet with HSDP "
                "(a mesh with a replicate dim); the custom reduce-scatter runs on 1-D "
                "FSDP meshes."
            )
        for group in groups:
            group.custom_reduce_scatter = comm

    def _custom_comm_groups(self, comm: Any, method: str) -> list[FSDPParamGroup]:
        groups = self._fsdp_groups(recurse=False)
        if len(groups) > 1:
            raise errors.ShardingValueError(
                f"{method} is not supported with multiple param groups (from per-param "
                f"mesh via shard_placement_fn). {type(self).__name__}'s parameters are in "
                "several groups; the custom comm would be ambiguous across them."
            )
        if not callable(getattr(comm, "allocate", None)) or not callable(comm):
            raise errors.ShardingTypeError(
                f"{method} on {type(self).__name__}: expected an object with "
                "allocate(size, *, dtype, device) and __call__ (FSDP2's Comm interface: "
                f"torch.distributed.fsdp's AllGather / ReduceScatter), got {comm!r}."
            )
        return groups

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The root's next forward waits for `event` before it gathers, then drops it.

        FSDP2 makes its all-gather streams wait for the event instead of the whole
        current stream. The frontend launches its gathers from the host: on a device
        the host waits for the event; a CPU event (FSDP2 accepts one) has nothing to
        wait for. Set a new event each iteration.

        Args:
          event: recorded after the optimizer step.
        """
        self._get_fsdp_state()._state_ctx.post_optim_event = event

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """True: parameters that got no gradient on this rank are reduced as zeros.

        Needed where ranks use different parameters of one module (a mixture of
        experts whose router sends each rank's tokens to other experts, a multi-modal
        model): every rank then reduce-scatters the same parameters, as FSDP2 does
        (DDP's `find_unused_parameters`). Only parameters that require a gradient and
        were gathered in the iteration count.

        Args:
          reduce_scatter_unused_params: whether to include them.
          recurse: also set it on every FSDP module below this one.
        """
        for group in self._fsdp_groups(recurse):
            group.reduce_scatter_unused_params = bool(reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many gradient reduce-scatters (and their flat inputs) may be in flight.

        1, the default, is FSDP2's: a module's post-backward first waits for the
        reduce-scatter started before it. More lets the backward go on while earlier
        ones run, holding their flat inputs meanwhile (memory for overlap). The
        largest value among the root's modules applies, resolved at each root forward.

        Args:
          max_input_buffers: at least 1.
          recurse: also set it on every FSDP module below this one.

        Raises:
          TypeError: not an int (a bool included).
          ValueError: less than 1.
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise errors.ShardingTypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__} "
                f"(set_reduce_scatter_max_input_buffers on {type(self).__name__})."
            )
        if max_input_buffers < 1:
            raise errors.ShardingValueError(
                f"max_input_buffers must be a positive int, got {max_input_buffers} "
                f"(set_reduce_scatter_max_input_buffers on {type(self).__name__}; 1 is "
                "the default)."
            )
        for group in self._fsdp_groups(recurse):
            group.reduce_scatter_max_input_buffers = max_input_buffers

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Accepted for FSDP2 compatibility: reduce-scatters already overlap gathers.

        FSDP2 gives its reduce-scatters a process group of their own so that they do
        not queue behind all-gathers on one communicator. The frontend's collectives
        run through JAX, in one launch order shared by every rank; a reduce-scatter
        runs on the collective thread while torch computes, whatever this says. The
        setting is recorded and changes no collective.

        Args:
          enable: FSDP2's switch (True gives it its own group).
          recurse: also set it on every FSDP module below this one.
        """
        for group in self._fsdp_groups(recurse):
            group.separate_reduce_scatter_group = bool(enable)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted for FSDP2 compatibility: JAX allocates the collectives' buffers.

        FSDP2 then asks the process group for its staging buffers (NCCL's zero-copy
        allocator; on gloo it allocates as usual). Here the collectives' buffers are
        JAX's, so the setting is recorded and changes nothing.

        Args:
          enable: FSDP2's switch.
        """
        groups = self._fsdp_groups(recurse=False)
        _refuse_custom_comm(groups, "set_allocate_memory_from_process_group()")
        for group in groups:
            group.allocate_memory_from_process_group = bool(enable)

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """FSDP2's NCCL symmetric-memory buffers: set as FSDP2 sets them, used by nothing.

        As FSDP2, it selects torch's symmetric-memory `backend`, which raises where
        this torch build has none (torch's CPU builds). Where it succeeds it changes
        no collective: the frontend's gathers and reductions run on JAX's buffers
        (on CUDA, XLA's own NCCL communicators).

        Args:
          backend: "NCCL", the only backend FSDP2 supports.

        Raises:
          RuntimeError: this torch build has no such symmetric-memory backend (the
            message is torch's, with the module named).
          AssertionError: a custom all-gather or reduce-scatter is set, as FSDP2.
        """
        _refuse_custom_comm(self._fsdp_groups(recurse=False), "set_symm_mem()")
        try:
            symm_mem.set_backend(backend)
        except RuntimeError as exc:
            raise RuntimeError(
                f"{exc} (set_symm_mem_for_comm on {type(self).__name__}: this torch build "
                "has no symmetric memory for that backend; FSDP2 raises the same)."
            ) from None

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Dispatches these modules' gathers right after this module's own (forward).

        Replaces the default, which from the second iteration on prefetches the module
        that ran forward right after this one in the last iteration that ran backward
        (an empty list turns prefetching off for this module).

        Args:
          modules: FSDP modules, usually the next one(s) to run forward.
        """
        self._get_fsdp_state()._states_to_forward_prefetch = _states_of(
            modules, "set_modules_to_forward_prefetch"
        )

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Dispatches these modules' gathers at this module's pre-backward.

        Replaces the default, which prefetches the module whose forward ran just
        before this one's.

        Args:
          modules: FSDP modules, usually the next one(s) to run backward.
        """
        self._get_fsdp_state()._states_to_backward_prefetch = _states_of(
            modules, "set_modules_to_backward_prefetch"
        )


class CustomCommError(errors.ShardingValueError, AssertionError):
    """A buffer setting after a custom collective: FSDP2 raises AssertionError."""


def _refuse_custom_comm(groups: list[FSDPParamGroup], method: str) -> None:
    for group in groups:
        for kind, custom in (
            ("all gather", group.custom_all_gather),
            ("reduce scatter", group.custom_reduce_scatter),
        ):
            if custom is not None:
                raise CustomCommError(
                    f"cannot call {method} when {kind} comm is custom: "
                    f"{type(custom).__name__} (the custom collective allocates its own "
                    "buffers)."
                )


def _check_one_argument(fn: Any, method: str, expected: str) -> None:
    """Raises unless `fn` can be called with one positional argument."""
    if not callable(fn):
        raise errors.ShardingTypeError(f"{method}: expected a callable {expected}, got {fn!r}.")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    try:
        signature.bind(None)
    except TypeError as exc:
        raise errors.ShardingTypeError(
            f"{method}: {fn!r} cannot be called as {expected}: {exc}."
        ) from None


def _deepcopy_message(module: nn.Module) -> str:
    # FSDP2's sentence first: code written for FSDP2 may match it.
    return (
        f"FSDP does not support deepcopy. Please use state dict for serialization. "
        f"({type(module).__name__} is fully sharded: its parameters are this rank's "
        "shards, tied to collectives of this job.) Deep-copy the model before "
        "fully_shard, or build a new model and load torch_frontend.full_state_dict(model) "
        "into it."
    )


_DTYPE_WORDS = ("dtype", "scalar type")


def _note_converted_dtype(module: nn.Module, exc: RuntimeError, inputs: Any) -> None:
    """Adds a note to a dtype mismatch caused by converting parameters after fully_shard.

    `model.to(torch.float64)` after `fully_shard` converts the shards (as FSDP2's
    does), so the forward computes in float64 and float32 inputs fail inside torch
    (`mat1 and mat2 must have the same dtype`, `Input type (float) and bias type
    (double) should be the same`) without a word about why. The exception keeps its
    type and text (FSDP2's); the note says what changed. It is added when the error
    speaks of dtypes or when a floating-point input differs from the dtype the
    converted parameters compute in (torch's wording varies by operator).
    """
    if any(n.startswith(_NOTE_START) for n in getattr(exc, "__notes__", ())):
        return  # an inner module noted it
    state = get_module_fsdp_state(module)
    states = [state, *state._state_ctx.all_states] if state is not None else []
    for group in (g for s in states for g in s._fsdp_param_groups):
        for param in group.fsdp_params:
            if param.dtype == param.orig_dtype:
                continue
            computes_in = group.param_dtype(param)
            mismatched = any(
                t.is_floating_point() and t.dtype != computes_in for t in _tree.tensors(inputs)
            )
            if mismatched or any(w in str(exc) for w in _DTYPE_WORDS):
                exc.add_note(_converted_dtype(param._param_fqn, param.orig_dtype, param.dtype))
            return


_NOTE_START = "torch_frontend: parameter "  # how `_converted_dtype`'s note begins


def _converted_dtype(fqn: str, before: torch.dtype, after: torch.dtype) -> str:
    return (
        f"{_NOTE_START}{fqn!r} (and others) became {after} after "
        f"fully_shard (module.to({after}) or similar), while it was {before} at "
        f"fully_shard; the forward computes in {after}, so inputs of another dtype fail "
        f"as above (as with FSDP2). Cast the inputs to {after}, or convert the model "
        "before fully_shard; to compute in a lower precision, keep the parameters and "
        "pass MixedPrecisionPolicy(param_dtype=...) instead."
    )


def _states_of(modules, method: str) -> list[FSDPState]:
    states = []
    for module in modules:
        state = get_module_fsdp_state(module) if isinstance(module, nn.Module) else None
        if state is None:
            raise errors.ShardingValueError(not_fsdp_module(method, module))
        states.append(state)
    return states


def not_fsdp_module(method: str, module) -> str:
    """The message for `method` called on a module `fully_shard` was not applied to."""
    return (
        f"{method}: {type(module).__name__} has no fully_shard state; call "
        "torch_frontend.fully_shard on it first."
    )


class UnshardHandle:
    """Returned by `unshard(async_op=True)`: `wait()` completes the gathers."""

    def __init__(self, groups: list[FSDPParamGroup] | None = None) -> None:
        """Made by `FSDPModule.unshard(async_op=True)`, not by users."""
        self._fsdp_param_groups = groups

    def wait(self) -> None:
        """Waits for the gathers (one per parameter group) and binds the parameters."""
        if self._fsdp_param_groups is not None:
            for group in self._fsdp_param_groups:
                group.wait_for_unshard()
            self._fsdp_param_groups = None


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Makes `module.<method_name>(...)` run FSDP's pre- and post-forward like `forward`.

    For methods such as `generate` that use the parameters without calling `forward`.
    As in FSDP2, a module `fully_shard` was not applied to is left alone (so one script
    runs with and without sharding).

    Args:
      module: the module `fully_shard` was applied to.
      method_name: the name of its method to hook.

    Raises:
      ValueError: `module` has no method `method_name`.
    """
    state = get_module_fsdp_state(module)
    if state is None:
        return
    if not callable(getattr(module, method_name, None)):
        raise errors.ShardingValueError(
            f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}."
        )
    method = getattr(module, method_name)  # bound: the original implementation

    def wrapped(*args, **kwargs):
        args, kwargs = state._pre_forward(args, kwargs)
        return state._post_forward(method(*args, **kwargs))

    setattr(module, method_name, wrapped)


def _fsdp_class(cls: type) -> type:
    if cls not in cls_to_fsdp_cls:
        cls_to_fsdp_cls[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return cls_to_fsdp_cls[cls]


def _check_offload(offload_policy, layout: _bridge.RankLayout) -> None:
    """Accepts FSDP2's policies where they hold: on a CPU mesh everything is host memory.

    `CPUOffloadPolicy` keeps the shards, their gradients and the optimizer step in host
    memory and gathers on the device. On a CPU mesh that is where they are already, so
    it changes nothing, as FSDP2's does there; pinning needs an accelerator, as FSDP2's
    `pin_memory()` does. On a GPU mesh it would need host-to-device copies not built yet.
    """
    if offload_policy is None or type(offload_policy) is OffloadPolicy:
        return
    if type(offload_policy) is not CPUOffloadPolicy:
        raise errors.UnsupportedError(
            _not_supported_yet(
                f"offload_policy={offload_policy!r}",
                "pass None, OffloadPolicy() or CPUOffloadPolicy().",
            )
        )
    if layout.device.platform != "cpu":
        raise errors.UnsupportedError(
            _not_supported_yet(
                f"offload_policy={offload_policy!r} on a {layout.device.platform.upper()} mesh",
                "pass None to keep the shards in device memory, or run on a CPU mesh.",
            )
        )
    if offload_policy.pin_memory and not torch.accelerator.is_available():
        raise RuntimeError(
            "fully_shard: CPUOffloadPolicy(pin_memory=True) pins host memory for copies to "
            "an accelerator, and none is available (FSDP2's pin_memory() raises: Cannot "
            "access accelerator device when none is available). Pass "
            "CPUOffloadPolicy(pin_memory=False)."
        )


def _not_supported_yet(what: str, how: str) -> str:
    return f"fully_shard: {what} is not supported by torch_frontend yet; {how}"


def _check_arguments(modules, reshard_after_forward, mp_policy, shard_placement_fn) -> None:
    if not modules:
        raise EmptyGroupError(_empty_group())
    for i, module in enumerate(modules):
        if not isinstance(module, nn.Module):
            raise errors.ShardingTypeError(
                "fully_shard: expected an nn.Module or a list of them, got "
                f"{type(module).__name__}."
            )
        if get_module_fsdp_state(module) is not None or any(m is module for m in modules[:i]):
            raise ShardedTwiceError(_sharded_twice(module))
        if (
            isinstance(module, (nn.ModuleList, nn.ModuleDict))
            and type(module).forward is nn.Module.forward
        ):
            raise errors.ShardingValueError(_container_without_forward(module))
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, int):
        raise errors.ShardingTypeError(_bad_reshard_after_forward(reshard_after_forward))
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise errors.ShardingTypeError(_bad_mp_policy(mp_policy))
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise errors.ShardingTypeError(_bad_placement_fn(shard_placement_fn))


def _sharded_twice(module: nn.Module) -> str:
    return (
        f"fully_shard: {type(module).__name__} is already fully sharded (or listed twice "
        "in one call); call fully_shard once per module, and list each module of a "
        "group once."
    )


def _empty_group() -> str:
    return (
        "fully_shard: got an empty list of modules (FSDP2 fails with IndexError: tuple "
        "index out of range). Pass a module, or a non-empty list of modules that form "
        "one group."
    )


def _container_without_forward(module: nn.ModuleList | nn.ModuleDict) -> str:
    # FSDP2's sentence first (its ValueError), without the module's repr.
    return (
        f"fully_shard does not support containers that do not implement forward: "
        f"{type(module).__name__} of {len(module)} modules. Its modules run forward one by "
        "one from the parent's forward, so no hook of the container would gather their "
        "parameters. Shard each of them (`for block in model.blocks: "
        "fully_shard(block)`), or list them as one group (`fully_shard(list(model.blocks))`)."
    )


def _bad_reshard_after_forward(value) -> str:
    return (
        f"fully_shard: reshard_after_forward must be True, False, None or an int group "
        f"size, got {value!r} ({type(value).__name__})."
    )


def _bad_mp_policy(mp_policy) -> str:
    return (
        "fully_shard: mp_policy must be a torch_frontend.MixedPrecisionPolicy, got "
        f"{type(mp_policy).__name__}."
    )


def _bad_placement_fn(fn) -> str:
    return (
        f"fully_shard: shard_placement_fn must be a callable (param -> Shard(dim) or None), "
        f"got {type(fn).__name__}."
    )


def _check_unmanaged(param: nn.Parameter, fqn: str, modules: list[nn.Module]) -> None:
    owner = _param.managed(param)
    if owner is not None:
        outer = any(
            m is o or any(m is d for d in o.modules()) for m in modules for o in owner.group_modules
        )
        raise SharedParameterError(
            _already_managed(fqn) if outer else _shared_with_group(fqn, owner._param_fqn)
        )


def _check_tensor_parallel(param: nn.Parameter, fqn: str, device_mesh: DeviceMesh) -> None:
    """A TP DTensor must live on the other dims of the mesh `fully_shard` shards over.

    FSDP2 joins the two meshes (`DeviceMesh._concatenate`) and fails with torch's
    RuntimeError when they do not come from one mesh or overlap; this says which
    parameter and what to pass.
    """
    if not isinstance(param, DTensor):
        return
    if len(param.placements) > 2:
        raise errors.UnsupportedError(_tp_dims(fqn, param))
    try:
        _param.spmd_mesh(device_mesh, param.device_mesh)
    except RuntimeError as exc:
        raise TensorParallelMeshError(_tp_mesh(fqn, param, device_mesh, exc)) from None


def _tp_dims(fqn: str, param: DTensor) -> str:
    # FSDP2's sentence first (its NotImplementedError).
    return (
        f"FSDP only supports 1D TP/EP or 2D EP+TP, not {tuple(param.placements)}: "
        f"parameter {fqn!r} is a DTensor on a {param.device_mesh.ndim}-D mesh. Place it "
        "on at most two model-parallel dims."
    )


def _tp_mesh(fqn: str, param: DTensor, device_mesh: DeviceMesh, exc: RuntimeError) -> str:
    return (
        f"fully_shard: parameter {fqn!r} is a DTensor on {param.device_mesh} (tensor "
        f"parallelism), and the mesh fully_shard shards over, {device_mesh}, is not "
        f"another dim of the same device mesh ({exc}). Take both from one named "
        'init_device_mesh: mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", '
        '"tp")); parallelize_module(block, mesh["tp"], plan); fully_shard(block, '
        'mesh=mesh["dp"]).'
    )


def _already_managed(fqn: str) -> str:
    return (
        f"fully_shard: parameter {fqn!r} is already managed by another FSDP group (an "
        "outer module was fully sharded first). Apply fully_shard bottom-up: the inner "
        "modules (e.g. each block) first, then their parent."
    )


def _shared_with_group(fqn: str, other: str) -> str:
    # FSDP2's lazy-init wording (PyTorch's tests match it); FSDP2 itself fails here with
    # "TypeError: Invariant encountered" (it takes the shard for a tensor-parallel one).
    return (
        f"Parameter {fqn!r} is shared with a parameter already managed by another FSDP "
        f"group (as {other!r}): the module holding it is reachable through two parents, "
        "and fully_shard was applied to the other one first. For shared/tied parameters, "
        "use fully_shard([module_a, module_b]) to place them in the same FSDP group, or "
        "fully_shard the shared module itself before either parent."
    )


def _shard_placement_result() -> Any:
    """FSDP2's `ShardPlacementResult` (private in torch 2.13), if this torch has it."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    except ImportError:
        return None
    return ShardPlacementResult


@dataclasses.dataclass(frozen=True)
class _GroupMesh:
    """Where one parameter group lives (FSDP2's `FSDPMeshInfo` of a group).

    Attributes:
      device_mesh: the data-parallel torch mesh its gathers and reduce-scatters run over.
      layout: this process's layout on the matching jax mesh.
      spec: how its shards are DTensors.
      info: the `ShardPlacementResult.mesh_info` that named this mesh (None:
        `fully_shard`'s own).
      full_mesh: with `dp_mesh_dims`, the full mesh the parameters are DTensors on.
    """

    device_mesh: DeviceMesh
    layout: _bridge.RankLayout
    spec: ShardSpec
    info: Any = None
    full_mesh: DeviceMesh | None = None

    @property
    def key(self) -> tuple:
        """Its process groups: FSDP2 groups parameters by these."""
        return tuple(self.device_mesh.get_group(i) for i in range(self.device_mesh.ndim))

    def check(self, param: nn.Parameter, fqn: str) -> None:
        """Raises if `param` cannot be sharded over this mesh (see the two checks)."""
        if self.full_mesh is None:
            _check_tensor_parallel(param, fqn, self.device_mesh)
        else:
            _check_full_mesh_param(param, fqn, self.full_mesh, self.spec)


def _group_mesh(mesh: Any, info: Any = None, **spec: Any) -> _GroupMesh:
    """A group's mesh from a `fully_shard(mesh=...)` value (None, jax or torch mesh)."""
    jax_mesh, device_mesh = _distributed.both_meshes(mesh)
    layout = _distributed.layout_of(jax_mesh)
    return _GroupMesh(device_mesh, layout, ShardSpec(device_mesh, **spec), info)


def _default_mesh(mesh, dp_mesh_dims, reshard_after_forward) -> _GroupMesh:
    """The mesh of the parameters `shard_placement_fn` does not place elsewhere."""
    if dp_mesh_dims is None:
        return _group_mesh(mesh)
    shard, replicate = _named_dims(mesh, dp_mesh_dims, reshard_after_forward)
    names = mesh.mesh_dim_names
    dp_mesh = _dp_mesh(mesh, shard, replicate) if shard else _ddp_mesh(mesh, replicate)
    shard_dims = tuple(names.index(n) for n in shard)
    dp_dims = frozenset((*shard_dims, *(names.index(n) for n in replicate)))
    flat = _flat_mesh(mesh, shard, replicate) if len(shard) > 1 else None
    made = _group_mesh(dp_mesh, dp_shard_dims=shard_dims, dp_dims=dp_dims, flat_mesh=flat)
    return dataclasses.replace(made, full_mesh=mesh)


def _one_dim(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    # FSDP2's: several dims of one role flattened into one 1-D mesh.
    return mesh[names[0]] if len(names) == 1 else mesh[names]._flatten("_".join(names))


@functools.cache
def _dp_mesh(mesh: DeviceMesh, shard: tuple[str, ...], replicate: tuple[str, ...]) -> DeviceMesh:
    """FSDP2's data-parallel mesh of `dp_mesh_dims`: (shard), or (replicate, shard) for HSDP."""
    if not replicate:
        return _one_dim(mesh, shard)
    return DeviceMesh._concatenate([_one_dim(mesh, replicate), _one_dim(mesh, shard)])


@functools.cache
def _ddp_mesh(mesh: DeviceMesh, replicate: tuple[str, ...]) -> DeviceMesh:
    """FSDP2's DDP mode (`dp_mesh_dims` without a shard dim) as an HSDP mesh of one shard
    per replica: `(replicate, 1)`. The frontend's groups all-gather and reduce-scatter over
    the size-1 dim (a copy) and all-reduce over the replicas, which is DDP's arithmetic,
    and the parameters keep their own placements (see `ShardSpec`)."""
    dp = _one_dim(mesh, replicate)
    name = dp.mesh_dim_names[0] if dp.mesh_dim_names else "replicate"
    return dp._unflatten(0, (dp.size(), 1), (name, f"{name}_unsharded"))


@functools.cache
def _flat_mesh(mesh: DeviceMesh, shard: tuple[str, ...], replicate: tuple[str, ...]) -> DeviceMesh:
    """The sharded DTensors' mesh with several shard dims, as FSDP2 makes it: the
    data-parallel mesh where the first shard dim was, the other dims as they are."""
    names = mesh.mesh_dim_names or ()
    parts = []
    for name in names:
        if name == shard[0]:
            parts.append(_dp_mesh(mesh, shard, replicate))
        elif name not in shard and name not in replicate:
            parts.append(mesh[name])
    return DeviceMesh._concatenate(parts)


def _named_dims(mesh, dims, reshard_after_forward) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """`dp_mesh_dims`' (shard dims, replicate dims), checked as FSDP2 checks them.

    Raises:
      TypeError: `dims` is not a `DataParallelMeshDims`, or `mesh` not a torch mesh.
      ValueError: the mesh has no dim names, or lacks a named dim (FSDP2's).
      NotImplementedError: an int `reshard_after_forward` (FSDP2's), or shard dims that
        are not consecutive in the mesh.
    """
    dims_type = _data_parallel_mesh_dims()
    if dims_type is None or not isinstance(dims, dims_type):
        raise errors.ShardingTypeError(_bad_dims(dims))
    dims = cast("DataParallelMeshDims", dims)
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise errors.ShardingTypeError(_dims_need_device_mesh(mesh))
    if mesh is None or mesh.mesh_dim_names is None:
        raise errors.ShardingValueError(_dims_need_names(mesh))
    for name in (*dims.shard_names, *dims.replicate_names):
        if name not in mesh.mesh_dim_names:
            raise errors.ShardingValueError(_dim_not_in_mesh(name, mesh))
    if not isinstance(reshard_after_forward, bool) and isinstance(reshard_after_forward, int):
        raise errors.UnsupportedError(_dims_hpz(reshard_after_forward))
    at = [mesh.mesh_dim_names.index(n) for n in dims.shard_names]
    if at and at != list(range(at[0], at[0] + len(at))):
        # FSDP2 assumes them consecutive (its flattened view replaces a run of dims).
        raise errors.UnsupportedError(
            _not_supported_yet(
                f"{dims}: shard dims that are not consecutive, in order, in the mesh "
                f"{mesh.mesh_dim_names}",
                "name shard dims that follow each other in the mesh.",
            )
        )
    return dims.shard_names, dims.replicate_names


def _data_parallel_mesh_dims() -> type | None:
    """FSDP2's `DataParallelMeshDims` (torch 2.13 and later), if this torch has it."""
    try:
        from torch.distributed.fsdp import DataParallelMeshDims
    except ImportError:
        return None
    return DataParallelMeshDims


def _check_full_mesh_param(param: nn.Parameter, fqn: str, mesh: DeviceMesh, spec: ShardSpec):
    """With `dp_mesh_dims`: a DTensor on that very mesh, replicated over its dp dims.

    Raises:
      ValueError: FSDP2's three errors, naming the parameter.
    """
    names = mesh.mesh_dim_names or ()
    if not isinstance(param, DTensor):
        raise errors.ShardingValueError(_full_mesh_plain(fqn, names))
    if param.device_mesh is not mesh:
        raise errors.ShardingValueError(_full_mesh_other(fqn, param.device_mesh, mesh))
    for i in sorted(spec.dp_dims):
        if not isinstance(param.placements[i], Replicate):
            role = "shard" if i in spec.dp_shard_dims else "replicate"
            raise errors.ShardingValueError(_full_mesh_split(fqn, role, names[i], i, param))


def _placement(shard_placement_fn, param: nn.Parameter, fqn: str, default: _GroupMesh):
    """(the dim `shard_placement_fn` shards `param` on, the mesh of its group).

    `Shard(dim)` or None (dim 0) keep fully_shard's mesh; FSDP2's
    `ShardPlacementResult` also names a mesh (its `mesh_info`), whose parameters form a
    group of their own, as in FSDP2.
    """
    placement: Any = None if shard_placement_fn is None else shard_placement_fn(param)
    group_mesh = default
    result_type = _shard_placement_result()
    if result_type is not None and isinstance(placement, result_type):
        group_mesh = _info_mesh(placement.mesh_info, fqn, default)
        placement = placement.placement
    return _shard_dim(placement, param, fqn), group_mesh


def _info_mesh(info: Any, fqn: str, default: _GroupMesh) -> _GroupMesh:
    """The group mesh of a `ShardPlacementResult`'s `mesh_info`.

    Raises:
      TypeError: it is not an `FSDPMeshInfo` (FSDP2 needs one to group by).
      NotImplementedError: with `dp_mesh_dims`, or an info whose dims are not FSDP2's
        usual (shard) or (replicate, shard).
    """
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    if not isinstance(info, FSDPMeshInfo):
        raise errors.ShardingTypeError(_bad_info(fqn, info))
    if default.full_mesh is not None:
        raise errors.UnsupportedError(
            _not_supported_yet(
                f"a ShardPlacementResult with dp_mesh_dims (parameter {fqn!r})",
                "return Shard(dim) or None, or shard that module in a fully_shard call of its own.",
            )
        )
    hsdp = isinstance(info, HSDPMeshInfo)
    usual = (2, 1, 0) if hsdp else (1, 0, None)
    if (info.mesh.ndim, info.shard_mesh_dim, info.replicate_mesh_dim) != usual:
        raise errors.UnsupportedError(
            _not_supported_yet(
                f"{type(info).__name__} with shard_mesh_dim={info.shard_mesh_dim} on a "
                f"{info.mesh.ndim}-D mesh (parameter {fqn!r})",
                "use FSDPMeshInfo(mesh_1d, shard_mesh_dim=0) or HSDPMeshInfo(mesh_2d, "
                "shard_mesh_dim=1, replicate_mesh_dim=0).",
            )
        )
    return _group_mesh(info.mesh, info)


def _shard_dim(placement: Any, param: nn.Parameter, fqn: str) -> int:
    """The dimension of FSDP2's `Shard(dim)` (None: 0), checked against the parameter."""
    from torch.distributed.tensor import Shard

    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise errors.ShardingTypeError(_bad_placement(fqn, placement))
    if not -param.ndim <= placement.dim < param.ndim:
        raise errors.ShardingValueError(
            _placement_out_of_range(fqn, placement.dim, tuple(param.shape))
        )
    return placement.dim % param.ndim


def _two_infos(fqn: str, known: _GroupMesh, new: _GroupMesh) -> str:
    # FSDP2's sentence first: code written for FSDP2 may match it.
    what = "fully_shard's own mesh" if known.info is None else f"{known.info}"
    return (
        "Params sharing the same process group must use the same FSDPMeshInfo object, "
        f"but got different objects: parameter {fqn!r} names {new.info} for the process "
        f"groups of {what}. Make one FSDPMeshInfo per mesh and return that object for "
        "every parameter of the mesh (or None / Shard(dim) for fully_shard's own mesh)."
    )


def _bad_info(fqn: str, info: Any) -> str:
    return (
        f"fully_shard: shard_placement_fn returned a ShardPlacementResult whose mesh_info "
        f"is a {type(info).__name__} for parameter {fqn!r}; it must be an FSDPMeshInfo "
        "(torch.distributed.fsdp._fully_shard._fsdp_common), e.g. "
        'FSDPMeshInfo(mesh["efsdp"], shard_mesh_dim=0).'
    )


def _bad_dims(dims: Any) -> str:
    return (
        f"fully_shard: dp_mesh_dims must be a torch.distributed.fsdp.DataParallelMeshDims "
        f"(torch 2.13 and later), got {type(dims).__name__}."
    )


def _dims_need_device_mesh(mesh: Any) -> str:
    return (
        f"fully_shard: dp_mesh_dims names dims of a torch DeviceMesh, but mesh is a "
        f"{type(mesh).__name__}. Pass mesh=init_device_mesh(..., mesh_dim_names=...)."
    )


def _dims_need_names(mesh: Any) -> str:
    # FSDP2's sentence first: code written for FSDP2 may match it.
    return (
        f"mesh must have mesh_dim_names when dp_mesh_dims is provided (got {mesh}). Pass "
        'mesh=init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp")).'
    )


def _dim_not_in_mesh(name: str, mesh: DeviceMesh) -> str:
    # FSDP2's sentence first.
    return (
        f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {mesh.mesh_dim_names}: "
        "name dims of the mesh passed to fully_shard in dp_mesh_dims."
    )


def _dims_hpz(k: int) -> str:
    # FSDP2's sentence first (its NotImplementedError).
    return (
        "reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims): "
        f"got {k}. Pass True or False."
    )


def _full_mesh_plain(fqn: str, names: tuple) -> str:
    # FSDP2's sentence first (its ValueError).
    return (
        "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD "
        f"mesh (e.g. via distribute_module). Got plain tensor for parameter '{fqn}'. Make "
        f"it a DTensor on the {names} mesh passed to fully_shard, Replicate() on the "
        "data-parallel dims (distribute_tensor(p, mesh, placements))."
    )


def _full_mesh_other(fqn: str, got: DeviceMesh, mesh: DeviceMesh) -> str:
    # FSDP2's sentence first (its ValueError).
    return (
        "Expected param's DTensor mesh to be the same mesh passed to fully_shard, but got "
        f"different mesh objects: parameter '{fqn}' is on {got}, fully_shard got {mesh}. "
        "Distribute the parameters over the very mesh object passed to fully_shard."
    )


def _full_mesh_split(fqn: str, role: str, name: str, index: int, param: DTensor) -> str:
    # FSDP2's sentence first (its ValueError).
    return (
        f"Expected Replicate() on DP {role} dim '{name}' (index {index}) but got "
        f"{param.placements[index]}: parameter '{fqn}' has placements "
        f"{tuple(param.placements)}. With dp_mesh_dims, fully_shard shards the "
        "data-parallel dims itself: distribute the parameter with Replicate() there."
    )


def _bad_placement(fqn: str, placement) -> str:
    return (
        f"fully_shard: shard_placement_fn returned {placement!r} for parameter {fqn!r}; "
        "return torch.distributed.tensor.Shard(dim) to shard it on dim, or None for dim 0."
    )


def _placement_out_of_range(fqn: str, dim: int, shape: tuple) -> str:
    return (
        f"fully_shard: shard_placement_fn returned Shard({dim}) for parameter {fqn!r} of "
        f"shape {shape}; the dim must be in [-{len(shape)}, {len(shape)})."
    )


def _post_forward_world(reshard_after_forward: bool | int | None, layout: _bridge.RankLayout):
    """True / False, or the hpZ group size k (1 < k < world), as FSDP2 normalises it."""
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return reshard_after_forward is not False
    k = reshard_after_forward
    comm.check_group_size("fully_shard", k, layout.world)
    if k == 1:
        warnings.warn(_hpz_one(), UserWarning, stacklevel=3)
    return False if k == 1 else True if k == layout.world else k


def _hpz_one() -> str:
    return (
        "fully_shard: reshard_after_forward=1 (int) means resharding to groups of one "
        "rank, i.e. keeping the whole gathered parameters; it behaves as False."
    )


def _param_names(modules: list[nn.Module]) -> dict[int, str]:
    """id(module) -> its name relative to the fully_shard call, for messages."""
    names: dict[int, str] = {}
    for i, top in enumerate(modules):
        prefix = f"[{i}]." if len(modules) > 1 else ""
        for name, module in top.named_modules():
            names.setdefault(id(module), prefix + name)
    return names


def _log_group(modules: list[nn.Module], group: FSDPParamGroup) -> None:
    """One debug record per `fully_shard` call: what the new group holds and how."""
    names = ", ".join(type(m).__name__ for m in modules)
    params = ", ".join(f"{p._param_fqn} {tuple(p.shape)} dim {p.dim}" for p in group.fsdp_params)
    logger.debug(
        "fully_shard: group of %s: %d parameters [%s] over %d ranks, reshard_after_forward=%s, %s",
        names,
        len(group.fsdp_params),
        params,
        group.layout.world,
        group.reshard_after_forward,
        group.mp_policy,
    )


@overload
def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | Mesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = ...,
    offload_policy: OffloadPolicy | None = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
) -> FSDPModule: ...


@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | Mesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = ...,
    offload_policy: OffloadPolicy | None = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | Mesh | None = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    offload_policy: OffloadPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> FSDPModule | list[FSDPModule]:
    """Shards `module`'s parameters over the mesh and installs FSDP2's hooks.

    Each parameter not already managed by an inner `fully_shard` becomes a DTensor
    (`Shard(0)`, after `Replicate()` on an HSDP mesh) whose local tensor is this rank's
    shard `torch.chunk(p, world, dim=0)[rank]` (possibly empty); the forward gathers
    them (one collective per call of `fully_shard` and mesh), the backward
    reduce-scatters their gradients into the shards' `.grad`, averaged over the
    data-parallel world. Apply it bottom-up: blocks first, then the root.

    Tensor parallelism composes as in FSDP2 (torchtitan's recipe): a parameter that
    `parallelize_module` made a DTensor on `mesh["tp"]` is sharded over `mesh["dp"]`
    on its TP-local block, becoming a DTensor on both dims with FSDP2's placements
    (`(_StridedShard(0, sf=tp), Shard(0))` column-parallel, `(Shard(0), Shard(1))`
    row-parallel). The gathers and reduce-scatters run over the dp ranks only and
    move the TP-local block; the forward sees the TP DTensor, so the TP collectives
    stay torch's.

    Args:
      module: a module, or a list of modules that form ONE group (tied weights).
      mesh: a torch `DeviceMesh` as FSDP2 takes it (`init_device_mesh("cpu", (n,))`,
        or 2-D `(replicate, shard)` for HSDP, or the data-parallel dims of a bigger
        named mesh, `mesh["dp"]`), or the mesh from `init_distributed()` (None: that
        mesh).
      reshard_after_forward: True frees the gathered parameters after forward and
        gathers again in backward; False keeps them. An int k (a divisor of the shard
        world size, FSDP2's hpZ) keeps each rank's 1/k of them, so the backward's
        gather runs within groups of k consecutive ranks only (1 is False, the world
        size is True). None: True, except for the root (the module that runs forward
        first), which stays gathered.
      mp_policy: the mixed-precision policy.
      shard_placement_fn: called on each parameter; returns
        `torch.distributed.tensor.Shard(dim)` to shard it on `dim` (this rank keeps
        `torch.chunk(p, world, dim)[rank]`), or None for dim 0, as in FSDP2; or FSDP2's
        `ShardPlacementResult(placement, mesh_info)`, whose parameters on another mesh
        form a parameter group of their own (`_fsdp_param_groups`; e.g. experts over
        an expert-data-parallel mesh).
      offload_policy: None or FSDP2's default `OffloadPolicy()`, or `CPUOffloadPolicy()`
        on a CPU mesh, where parameters, gradients and the optimizer step already live
        in host memory (as FSDP2 on CPU, it changes nothing there).
      ignored_params: parameters to leave alone: not sharded, not gathered, their
        gradients not reduced (as in FSDP2).
      dp_mesh_dims: FSDP2's `DataParallelMeshDims(shard=..., replicate=...)`: `mesh` is
        then the full named mesh, the parameters DTensors on it with `Replicate()` on
        those dims, which fully_shard shards (a tuple of names flattens several, as
        FSDP2's). With replicate dims only (FSDP2's DDP mode) the parameters keep
        their placements and their gradients are all-reduced over those dims.

    Returns:
      `module`, its class swapped to `FSDP<Cls>` (a subclass of `FSDPModule`).

    Raises:
      TypeError: a bad argument type (not a module, a policy, a placement, a
        `DataParallelMeshDims`, an `FSDPMeshInfo`).
      ValueError: a module already sharded, an hpZ size that does not divide the
        world, a placement out of range, or a 0-d parameter (as FSDP2); with
        `dp_mesh_dims`, a parameter that is not a DTensor on `mesh` replicated over
        its dims, or a dim not in it; two `FSDPMeshInfo` objects for one process group.
      NotImplementedError: an argument not supported yet (`CPUOffloadPolicy` on a GPU
        mesh, `dp_mesh_dims` without a shard dim or with shard dims not consecutive in
        the mesh, or with a `ShardPlacementResult`; an int `reshard_after_forward` with
        `dp_mesh_dims`, as FSDP2).
      RuntimeError: `CPUOffloadPolicy(pin_memory=True)` without an accelerator (as
        FSDP2); a tensor-parallel parameter whose mesh is not another dim of the
        same named device mesh as `mesh` (`TensorParallelMeshError`, also a
        TypeError and a ValueError).
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    _check_arguments(modules, reshard_after_forward, mp_policy, shard_placement_fn)
    ignored = {id(p) for p in ignored_params or ()}
    default = _default_mesh(mesh, dp_mesh_dims, reshard_after_forward)
    _check_offload(offload_policy, default.layout)
    names = _param_names(modules)
    placed: dict[tuple, tuple[_GroupMesh, list]] = {}  # process groups -> mesh, parameters
    for param, uses in module_params(modules, lambda m: get_module_fsdp_state(m) is not None):
        if id(param) in ignored:
            continue
        owner, attr = uses[0]
        fqn = f"{names[id(owner)]}.{attr}" if names[id(owner)] else attr
        _check_unmanaged(param, fqn, modules)
        dim, group_mesh = _placement(shard_placement_fn, param, fqn, default)
        group_mesh.check(param, fqn)
        # FSDP2 groups parameters by process group; one group's must share one info.
        known, params = placed.setdefault(group_mesh.key, (group_mesh, []))
        if known.info is not group_mesh.info:
            raise errors.ShardingValueError(_two_infos(fqn, known, group_mesh))
        params.append((param, uses, fqn, dim))
    # No parameters: one empty group, whose hooks still run.
    ordered = _in_fsdp2_order(placed, modules) or [(default, [])]
    post_forward = []
    for group_mesh, _ in ordered:  # a plain loop: the hpZ warning names the caller's line
        post_forward.append(_post_forward_world(reshard_after_forward, group_mesh.layout))
    # Every placement and hpZ size is checked before any module changes: an error loses
    # nothing.
    groups = [
        _make_group(group_mesh, params, modules, mp_policy, post)
        for (group_mesh, params), post in zip(ordered, post_forward, strict=True)
    ]
    FSDPState(tuple(modules), groups, mp_policy, reshard_after_forward is None)
    for group in groups:
        _state_dict.register_hooks(group)
    for m in modules:
        m.__class__ = _fsdp_class(type(m))
    # Every module's class is now FSDP<Cls>, a subclass of FSDPModule (the loop above).
    return cast("FSDPModule | list[FSDPModule]", module)


def _make_group(
    group_mesh: _GroupMesh,
    placed: list,
    modules: list[nn.Module],
    mp_policy: MixedPrecisionPolicy,
    post_forward: bool | int,
) -> FSDPParamGroup:
    """One parameter group on its mesh, with its own layout (its collectives' ranks)."""
    layout, spec = group_mesh.layout, group_mesh.spec
    params = [FSDPParam(param, uses, fqn, layout, spec, dim) for param, uses, fqn, dim in placed]
    for fsdp_param in params:
        fsdp_param.group_modules = tuple(modules)
    group = FSDPParamGroup(params, layout, mp_policy, post_forward, group_mesh.device_mesh)
    if logger.isEnabledFor(logging.DEBUG):
        _log_group(modules, group)
    return group


def _in_fsdp2_order(placed: dict, modules: list[nn.Module]) -> list:
    """The groups in FSDP2's order: by their first parameter in its parameter order.

    FSDP2 lists a call's parameters module by module, children before their parent
    (a post-order walk that stops at modules with a `fully_shard` of their own).
    """
    order: dict[int, int] = {}
    seen: set[int] = set()

    def walk(module: nn.Module) -> None:
        seen.add(id(module))
        for child in module.children():
            if id(child) not in seen and get_module_fsdp_state(child) is None:
                walk(child)
        for param in module._parameters.values():
            if param is not None:
                order.setdefault(id(param), len(order))

    for top in modules:
        walk(top)
    return sorted(placed.values(), key=lambda g: min(order[id(p[0])] for p in g[1]))
