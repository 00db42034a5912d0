"""`fully_shard`: FSDP2's entry point, and `FSDPModule`, the class it mixes in."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast, overload

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor

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
    from torch.distributed.device_mesh import DeviceMesh
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

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gathers this module's parameters now (one collective); they stay until reshard.

        Args:
          async_op: only dispatch the gather (JAX runs it while torch computes) and
            return a handle whose `wait()` completes it and binds the parameters.

        Returns:
          An `UnshardHandle` with `async_op=True`, else None.
        """
        group = self._get_fsdp_state()._fsdp_param_group
        group.unshard(async_op=async_op)
        return UnshardHandle(group) if async_op else None

    def reshard(self) -> None:
        """Frees the gathered parameters; the module holds its local shards again."""
        self._get_fsdp_state()._fsdp_param_group.reshard()

    def _apply(self, *args, **kwargs):
        # `module.to(dtype / device)`, `to_empty` and `half()` convert the sharded
        # DTensors: reshard first so that those are what the modules hold, then adopt
        # the converted local tensors as the padded storage JAX gathers from.
        state = get_module_fsdp_state(self)
        if state is not None:
            state._fsdp_param_group.reshard()
        result = super()._apply(*args, **kwargs)
        if state is not None:
            with torch.no_grad():
                for param in state._fsdp_param_group.fsdp_params:
                    param.reset_sharded_param()
        return result

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """False: backward keeps gradients unsharded and unreduced (gradient accumulation).

        Also sets `set_requires_all_reduce` to the same value, as FSDP2 does.
        """
        for state in self._fsdp_states(recurse):
            state._fsdp_param_group.reduce_grads = requires_gradient_sync
            state._fsdp_param_group.all_reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters gradients within the replica but skips the all-reduce.

        Gradient accumulation with less communication: each backward without it adds
        this replica's reduce-scattered sum to a pending partial gradient (the
        parameters' `.grad` is not touched); the next backward with it all-reduces the
        pending sum together with its own gradients. No effect without a replicate axis.
        """
        for state in self._fsdp_states(recurse):
            state._fsdp_param_group.all_reduce_grads = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Changes `reshard_after_forward` (a bool) at run time."""
        if not isinstance(reshard_after_forward, bool):
            raise errors.ShardingValueError(
                f"set_reshard_after_forward: expected a bool, got {reshard_after_forward!r}."
            )
        for state in self._fsdp_states(recurse):
            state._fsdp_param_group.reshard_after_forward = reshard_after_forward
            state._auto_reshard_after_forward = False

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """False keeps parameters gathered after backward (e.g. between accumulation steps)."""
        for state in self._fsdp_states(recurse):
            state._fsdp_param_group.reshard_after_backward = reshard_after_backward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Records whether the next backward is the iteration's last (FSDP2's flag)."""
        self._get_fsdp_state()._state_ctx.is_last_backward = is_last_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divides reduced gradients by `factor` instead of the data-parallel size."""
        self._get_fsdp_state()._fsdp_param_group.gradient_divide_factor = float(factor)

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
        self._get_fsdp_state()._fsdp_param_group.unshard_in_backward = unshard_in_backward

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for FSDP2 compatibility: reductions here are always sums.

        The core reduce-scatters with a sum and divides afterwards, which is what
        this setting asks FSDP2 to do; either value keeps that behaviour.
        """
        if not isinstance(enable, bool):
            raise errors.ShardingTypeError(
                f"set_force_sum_reduction_for_comms: expected a bool, got {enable!r}."
            )

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
    for group in (s._fsdp_param_group for s in states):
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
    """Returned by `unshard(async_op=True)`: `wait()` completes the gather."""

    def __init__(self, group: FSDPParamGroup | None = None) -> None:
        """Made by `FSDPModule.unshard(async_op=True)`, not by users."""
        self._fsdp_param_group = group

    def wait(self) -> None:
        """Waits for the gather and binds the gathered parameters."""
        if self._fsdp_param_group is not None:
            self._fsdp_param_group.wait_for_unshard()
            self._fsdp_param_group = None


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


def _check_not_yet(dp_mesh_dims) -> None:
    if dp_mesh_dims is not None:
        raise errors.UnsupportedError(
            _not_supported_yet("dp_mesh_dims", "pass None and a mesh from init_distributed().")
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


def _shard_dim(shard_placement_fn, param: nn.Parameter, fqn: str, device_mesh: DeviceMesh) -> int:
    """The dimension `shard_placement_fn` shards `param` on (FSDP2's `Shard(dim)`).

    A `ShardPlacementResult` on the mesh `fully_shard` was given is its placement;
    one on another mesh (a parameter group of its own) is not supported yet.
    """
    from torch.distributed.tensor import Shard

    placement: Any = None if shard_placement_fn is None else shard_placement_fn(param)
    result_type = _shard_placement_result()
    if result_type is not None and isinstance(placement, result_type):
        if placement.mesh_info.mesh != device_mesh:
            raise errors.UnsupportedError(_own_mesh(fqn, placement.mesh_info.mesh, device_mesh))
        placement = placement.placement
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise errors.ShardingTypeError(_bad_placement(fqn, placement))
    if not -param.ndim <= placement.dim < param.ndim:
        raise errors.ShardingValueError(
            _placement_out_of_range(fqn, placement.dim, tuple(param.shape))
        )
    return placement.dim % param.ndim


def _own_mesh(fqn: str, mesh: DeviceMesh, device_mesh: DeviceMesh) -> str:
    return _not_supported_yet(
        f"a ShardPlacementResult on another mesh ({mesh}) than fully_shard's "
        f"({device_mesh}) for parameter {fqn!r} (a parameter group of its own)",
        "return a placement on fully_shard's mesh (or a Shard(dim), or None), or shard "
        "the parameter's module in a fully_shard call of its own over that mesh.",
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
    them (one collective per call of `fully_shard`), the backward reduce-scatters their
    gradients into the shards' `.grad`, averaged over the data-parallel world. Apply it
    bottom-up: blocks first, then the root.

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
        `torch.chunk(p, world, dim)[rank]`), or None for dim 0, as in FSDP2.
      offload_policy: None or FSDP2's default `OffloadPolicy()`, or `CPUOffloadPolicy()`
        on a CPU mesh, where parameters, gradients and the optimizer step already live
        in host memory (as FSDP2 on CPU, it changes nothing there).
      ignored_params: parameters to leave alone: not sharded, not gathered, their
        gradients not reduced (as in FSDP2).
      dp_mesh_dims: not supported yet (must be None).

    Returns:
      `module`, its class swapped to `FSDP<Cls>` (a subclass of `FSDPModule`).

    Raises:
      TypeError: a bad argument type (not a module, a policy, a placement).
      ValueError: a module already sharded, an hpZ size that does not divide the
        world, a placement out of range, or a 0-d parameter (as FSDP2).
      NotImplementedError: an argument not supported yet (`CPUOffloadPolicy` on a GPU
        mesh, `dp_mesh_dims`).
      RuntimeError: `CPUOffloadPolicy(pin_memory=True)` without an accelerator (as
        FSDP2); a tensor-parallel parameter whose mesh is not another dim of the
        same named device mesh as `mesh` (`TensorParallelMeshError`, also a
        TypeError and a ValueError).
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    _check_arguments(modules, reshard_after_forward, mp_policy, shard_placement_fn)
    _check_not_yet(dp_mesh_dims)
    ignored = {id(p) for p in ignored_params or ()}
    jax_mesh, device_mesh = _distributed.both_meshes(mesh)
    layout = _distributed.layout_of(jax_mesh)
    _check_offload(offload_policy, layout)
    post_forward = _post_forward_world(reshard_after_forward, layout)
    names = _param_names(modules)
    placed = []
    for param, uses in module_params(modules, lambda m: get_module_fsdp_state(m) is not None):
        if id(param) in ignored:
            continue
        owner, attr = uses[0]
        fqn = f"{names[id(owner)]}.{attr}" if names[id(owner)] else attr
        _check_unmanaged(param, fqn, modules)
        _check_tensor_parallel(param, fqn, device_mesh)
        placed.append((param, uses, fqn, _shard_dim(shard_placement_fn, param, fqn, device_mesh)))
    # Every placement is checked before any module changes: an error loses nothing.
    spec = ShardSpec(device_mesh)
    params = [FSDPParam(param, uses, fqn, layout, spec, dim) for param, uses, fqn, dim in placed]
    for fsdp_param in params:
        fsdp_param.group_modules = tuple(modules)
    group = FSDPParamGroup(params, layout, mp_policy, post_forward, device_mesh)
    if logger.isEnabledFor(logging.DEBUG):
        _log_group(modules, group)
    FSDPState(tuple(modules), group, mp_policy, reshard_after_forward is None)
    _state_dict.register_hooks(group)
    for m in modules:
        m.__class__ = _fsdp_class(type(m))
    # Every module's class is now FSDP<Cls>, a subclass of FSDPModule (the loop above).
    return cast("FSDPModule | list[FSDPModule]", module)
