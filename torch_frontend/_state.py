"""Per-module state: FSDP2's hooks and its lazy root, over its `FSDPParamGroup`s."""

from __future__ import annotations

import functools
import itertools
import logging
import warnings
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.autograd.graph import _MultiHandle
from torch.profiler import record_function
from torch.utils.hooks import RemovableHandle

from funshard import errors
from torch_frontend._bridge import CommContext
from torch_frontend._group import FSDPParamGroup, TrainingState
from torch_frontend._policy import MixedPrecisionPolicy, cast_floating
from torch_frontend._tree import map_tensors, tensors

STATE_ATTR = "_torch_frontend_state"

logger = logging.getLogger("torch_frontend")  # silent unless configured (see _group.py)


class FSDPStateContext:
    """What every state of one root shares (FSDP2's FSDPStateContext)."""

    def __init__(self):
        self.all_states: list[FSDPState] = []  # named_modules() pre-order of the root
        self.iter_forward_root: FSDPState | None = None
        self.post_backward_final_callback_queued = False
        self.is_last_backward = True
        # States in the order their post-forward ran this iteration (with repeats):
        # the default backward prefetch walks it backwards.
        self.post_forward_order: list[FSDPState] = []
        # States in the order their pre-forward ran this iteration, and, from the last
        # iteration that ran backward, the state that ran next after each: the default
        # forward prefetch.
        self.pre_forward_order: list[FSDPState | None] = []
        self.next_in_forward: dict[FSDPState, FSDPState] = {}
        # `set_post_optim_event`'s event: the next root forward waits for it, once.
        self.post_optim_event: torch.Event | None = None


class SeveralParamGroupsError(errors.ShardingValueError, AssertionError):
    """`_fsdp_param_group` of a state with several groups: FSDP2 raises AssertionError."""


def get_module_fsdp_state(module: nn.Module) -> FSDPState | None:
    """The state `fully_shard` attached to `module`, if any."""
    return module.__dict__.get(STATE_ATTR)


class FSDPState:
    """The hooks of one `fully_shard` call (one module, or a list grouped as one).

    Its parameters are in one group per mesh (FSDP2's `_fsdp_param_groups`): one,
    unless `shard_placement_fn` put some on a mesh of their own (`ShardPlacementResult`),
    e.g. experts sharded over an expert-data-parallel mesh. Every hook runs each group
    in list order (the backward's in reverse), as FSDP2's.
    """

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        groups: list[FSDPParamGroup],
        mp_policy: MixedPrecisionPolicy,
        auto_reshard_after_forward: bool,
    ):
        self._modules, self._fsdp_param_groups, self._mp_policy = modules, groups, mp_policy
        self._auto_reshard_after_forward = auto_reshard_after_forward
        self._is_root: bool | None = None
        self._state_ctx = FSDPStateContext()
        self._training_state = TrainingState.IDLE
        self._modules_to_run_forward: set[nn.Module] = set()
        self._states_to_forward_prefetch: list[FSDPState] | None = None  # None: the default
        self._states_to_backward_prefetch: list[FSDPState] | None = None  # None: the default
        self._post_forward_indices: list[int] = []
        self.fqn = type(modules[0]).__name__
        pre_handles, post_handles = [], []
        for module in modules:
            module.__dict__[STATE_ATTR] = self
            # Under torch.compile the hooks run eagerly, around the compiled forward (as
            # FSDP2's, by default): Dynamo must not trace the bridge into JAX.
            pre_handles.append(
                module.register_forward_pre_hook(
                    torch.compiler.disable(functools.partial(self._module_pre_forward, module)),
                    prepend=True,
                    with_kwargs=True,
                )
            )
            post_handles.append(
                module.register_forward_hook(
                    torch.compiler.disable(functools.partial(self._module_post_forward, module)),
                    prepend=False,
                )
            )
        # FSDP2's attributes, so code that removes its hooks finds them here too: a
        # single module has one handle per hook; a group of modules one handle that
        # removes all of them (pre and post: its hooks only work together).
        self._pre_forward_hook_handle: RemovableHandle
        self._post_forward_hook_handle: RemovableHandle
        if len(modules) == 1:
            self._pre_forward_hook_handle = pre_handles[0]
            self._post_forward_hook_handle = post_handles[0]
        else:
            handle = _MultiHandle(tuple(pre_handles + post_handles))
            self._pre_forward_hook_handle = self._post_forward_hook_handle = handle

    @property
    def _fsdp_param_group(self) -> FSDPParamGroup:
        """The state's one parameter group (FSDP2's property, kept for single-mesh code).

        Raises:
          AssertionError: the state has several groups (`SeveralParamGroupsError`,
            also a ValueError); use `_fsdp_param_groups`.
        """
        if len(self._fsdp_param_groups) > 1:
            raise SeveralParamGroupsError(_several_groups(self._fsdp_param_groups))
        return self._fsdp_param_groups[0]

    @property
    def _comm_ctx(self) -> CommContext:
        """FSDP2's `_comm_ctx`: the collective launcher every group of the job shares."""
        return self._fsdp_param_groups[0].comm_ctx

    # ---- forward ----

    def _module_pre_forward(self, module, _module, args, kwargs):
        if len(self._modules) > 1 and not self._modules_to_run_forward:
            self._modules_to_run_forward.update(self._modules)
        return self._pre_forward(args, kwargs)

    def _module_post_forward(self, module, _module, _args, output):
        if len(self._modules) > 1:
            if module not in self._modules_to_run_forward:
                return self._cast_output_dtype(output)
            self._modules_to_run_forward.discard(module)
            if self._modules_to_run_forward:  # the group's post-forward waits for its last module
                return self._cast_output_dtype(output)
        with self._traced("FSDP::post_forward"):
            return self._post_forward(output)

    def _traced(self, label: str) -> record_function:
        """A profiler range named as FSDP2 names it ("<label> (<fqn>)"), logged at debug."""
        label = self._fsdp_param_groups[0]._with_fqn(label)  # all share the module's fqn
        logger.debug("%s", label)
        return record_function(label)

    def _pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Root set-up once per pass, input cast, ONE all-gather, post-backward hook."""
        if self._training_state == TrainingState.PRE_BACKWARD:
            # Activation checkpointing re-runs forward inside backward: parameters only.
            with self._traced("FSDP::pre_forward"):
                for group in self._fsdp_param_groups:
                    group.unshard()
            return self._cast_forward_inputs(args, kwargs)
        first_in_pass = self._training_state != TrainingState.FORWARD
        self._training_state = TrainingState.FORWARD
        if first_in_pass:
            self._root_pre_forward()
        args, kwargs = self._cast_forward_inputs(args, kwargs)
        with self._traced("FSDP::pre_forward"):
            for group in self._fsdp_param_groups:
                args, kwargs = group.pre_forward(args, kwargs)
        if first_in_pass and torch.is_grad_enabled():
            self._state_ctx.pre_forward_order.append(self)
            for state in self._forward_prefetch_targets():  # dispatched now: they run
                with record_function(
                    f"FSDP::forward_prefetch for {state._fsdp_param_groups[0]._module_fqn}"
                ):
                    for group in state._fsdp_param_groups:
                        group.unshard(async_op=True)  # while we compute
        return args, kwargs

    def _forward_prefetch_targets(self) -> list[FSDPState]:
        """Explicit targets, else the state that ran forward after ours last iteration."""
        if self._states_to_forward_prefetch is not None:
            return self._states_to_forward_prefetch
        after = self._state_ctx.next_in_forward.get(self)
        return [after] if after is not None else []

    def _post_forward(self, output: Any) -> Any:
        """Reshard (per reshard_after_forward), pre-backward hooks, output cast."""
        if self._training_state == TrainingState.PRE_BACKWARD:
            return self._cast_output_dtype(output)
        self._finish_forward()
        output = self._register_pre_backward_hook(output)
        if self._state_ctx.iter_forward_root is self:
            output = self._force_complete_incomplete_states(output)
            self._state_ctx.iter_forward_root = None
        return self._cast_output_dtype(output)

    def _finish_forward(self) -> None:
        for group in self._fsdp_param_groups:
            group.post_forward()
        if torch.is_grad_enabled():  # only a forward that a backward may follow
            self._post_forward_indices.append(len(self._state_ctx.post_forward_order))
            self._state_ctx.post_forward_order.append(self)
        self._training_state = TrainingState.IDLE

    def _cast_forward_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        policy = self._mp_policy
        if not (policy.cast_forward_inputs and policy.param_dtype):
            return args, kwargs
        cast = functools.partial(cast_floating, policy.param_dtype)
        with record_function("FSDP::cast_forward_inputs"):
            return map_tensors(cast, args), map_tensors(cast, kwargs)

    def _cast_output_dtype(self, output: Any) -> Any:
        if self._mp_policy.output_dtype is None:
            return output
        with record_function("FSDP::cast_forward_outputs"):
            return map_tensors(
                functools.partial(cast_floating, self._mp_policy.output_dtype), output
            )

    def _root_pre_forward(self) -> None:
        self._lazy_init()
        if self._state_ctx.iter_forward_root is None:
            logger.debug("FSDP::root_pre_forward")
            self._state_ctx.iter_forward_root = self
            with record_function("FSDP::root_pre_forward"):
                self._state_ctx.pre_forward_order.append(None)
                event, self._state_ctx.post_optim_event = self._state_ctx.post_optim_event, None
                if event is not None and event.device.type != "cpu":
                    # FSDP2 makes its gather streams wait for it; the frontend's gathers
                    # are launched from the host, so the host waits. A CPU event has
                    # nothing to wait for: the optimizer ran in program order.
                    event.synchronize()
                groups = [g for st in self._state_ctx.all_states for g in st._fsdp_param_groups]
                for group in groups:
                    group.drop_stale_parts()
                if groups:
                    # One cap for the in-flight reduce-scatters: the largest any group
                    # asks for (FSDP2 resolves its per-group caps the same way).
                    groups[0].comm_ctx.reduce_scatter_max_input_buffers = max(
                        g.reduce_scatter_max_input_buffers for g in groups
                    )
                    # The iteration's first all-gather compares the ranks' collectives.
                    groups[0].comm_ctx.digest_next()

    def _force_complete_incomplete_states(self, output: Any) -> Any:
        # A grouped state whose modules did not all run forward never reached its
        # post-forward; finish it here (deepest first, as the forward would unwind).
        for state in reversed(self._state_ctx.all_states):
            if state is self or not state._modules_to_run_forward:
                continue
            state._finish_forward()
            output = state._register_pre_backward_hook(output)
            output = state._cast_output_dtype(output)
            state._modules_to_run_forward.clear()
        return output

    # ---- lazy initialisation: the first state to run forward is the root ----

    def _lazy_init(self) -> None:
        """Makes this state the root and collects every state below it (once).

        Raises:
          RuntimeError: the root is a group of several modules, or a state below it
            already ran forward as a root of its own.
          ValueError: one parameter is managed by two groups.
        """
        if self._is_root is not None:
            return
        if len(self._modules) > 1:
            raise RuntimeError(_grouped_root(self._modules))
        self._is_root = True
        root = self._modules[0]
        for name, module in root.named_modules():
            state = get_module_fsdp_state(module)
            if state is None or state in self._state_ctx.all_states:
                continue
            if state is not self:
                if state._is_root is not None:
                    raise RuntimeError(_child_ran_forward_first(name, type(root).__name__))
                state._is_root = False
                state.fqn = name
                for group in state._fsdp_param_groups:
                    group.name = name
            state._state_ctx = self._state_ctx
            self._state_ctx.all_states.append(state)
        self._name_groups(root)
        if self._auto_reshard_after_forward:
            # The root's parameters would be gathered again at once for the backward pass.
            for group in self._fsdp_param_groups:
                group.reshard_after_forward = False
        self._name_params(root)  # first: the errors below name parameters from the root
        # As FSDP2's lazy init: a parameter replaced since fully_shard by a DTensor of
        # the same sharding (computed from other sharded parameters, e.g. DoRA's
        # magnitudes) becomes the managed one.
        for param in self._all_params():
            param.reset_sharded_param()
        self._validate_no_duplicate_params()
        if logger.isEnabledFor(logging.DEBUG):
            self._log_lazy_init(root)

    def _name_groups(self, root: nn.Module) -> None:
        """Sets each group's `_module_fqn` as FSDP2 does: its modules' paths, ", "-joined."""
        names: dict[FSDPState, list[str]] = {}
        for name, module in root.named_modules():
            state = get_module_fsdp_state(module)
            if state is not None and state._state_ctx is self._state_ctx:
                names.setdefault(state, []).append(name)
        for state, paths in names.items():
            for group in state._fsdp_param_groups:
                group._module_fqn = ", ".join(paths)

    def _log_lazy_init(self, root: nn.Module) -> None:
        groups = "; ".join(
            f"{g._module_fqn or '<root>'}: {len(g.fsdp_params)} parameters, "
            f"reshard_after_forward={g.reshard_after_forward}"
            for s in self._state_ctx.all_states
            for g in s._fsdp_param_groups
        )
        logger.debug(
            "FSDP::lazy_init: root %s with %d fully_shard groups (%s)",
            type(root).__name__,
            len(self._state_ctx.all_states),
            groups,
        )

    def _name_params(self, root: nn.Module) -> None:
        """Names every managed parameter by its path from the root, for messages."""
        by_param = {id(p.sharded_param): p for p in self._all_params()}
        module_names: dict[int, str] = {}
        for name, module in root.named_modules(remove_duplicate=False):
            module_names.setdefault(id(module), name)
        for param in by_param.values():  # also those no module holds now (set to None)
            module, attr = param.uses[0]
            if id(module) in module_names:
                prefix = module_names[id(module)]
                param._param_fqn = f"{prefix}.{attr}" if prefix else attr
        for name, tensor in root.named_parameters(remove_duplicate=False):
            if id(tensor) in by_param:
                by_param[id(tensor)]._param_fqn = name

    def _validate_no_duplicate_params(self) -> None:
        """Raises if one original parameter is managed by two groups (tied weights).

        Raises:
          ValueError: FSDP2's lazy-init error, naming both users of the parameter.
        """
        owners: dict[int, str] = {}
        for param in self._all_params():
            if param._orig_param_uid in owners:
                raise errors.ShardingValueError(
                    _param_in_two_groups(param._param_fqn, owners[param._orig_param_uid])
                )
            owners[param._orig_param_uid] = param._param_fqn

    def _all_params(self):
        """Every parameter of every group of every state under this root."""
        for state in self._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                yield from group.fsdp_params

    # ---- backward ----

    def _register_pre_backward_hook(self, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return output
        for tensor in tensors(output):
            if not tensor.requires_grad:
                continue
            if tensor._base is not None:
                warnings.warn(_view_output(self.fqn), UserWarning, stacklevel=2)
            tensor.register_hook(self._pre_backward)
        return output

    def _pre_backward(self, grad: torch.Tensor) -> None:
        if self._training_state == TrainingState.PRE_BACKWARD:
            # A further output of this module: the group is gathered already (FSDP2
            # names and logs only the first call).
            self._run_pre_backward()
            return
        with self._traced("FSDP::pre_backward"):
            self._run_pre_backward()

    def _run_pre_backward(self) -> None:
        already = self._training_state == TrainingState.PRE_BACKWARD
        self._training_state = TrainingState.PRE_BACKWARD
        self._register_root_post_backward_final_callback()
        for group in self._fsdp_param_groups:
            group.pre_backward()
        if not already:
            for state in self._backward_prefetch_targets():
                with record_function(
                    f"FSDP::backward_prefetch for {state._fsdp_param_groups[0]._module_fqn}"
                ):
                    # The backward runs the groups in reverse: the last one first.
                    for group in reversed(state._fsdp_param_groups):
                        group.prefetch_for_backward()

    def _backward_prefetch_targets(self) -> list[FSDPState]:
        """Explicit targets, else the state whose post-forward ran just before ours."""
        if self._states_to_backward_prefetch is not None:
            return self._states_to_backward_prefetch
        if not self._post_forward_indices:
            return []
        index = self._post_forward_indices.pop()
        return [self._state_ctx.post_forward_order[index - 1]] if index > 0 else []

    def _register_root_post_backward_final_callback(self) -> None:
        if self._state_ctx.post_backward_final_callback_queued:
            return
        self._state_ctx.post_backward_final_callback_queued = True
        root = self._state_ctx.all_states[0] if self._state_ctx.all_states else self
        Variable._execution_engine.queue_callback(root._root_post_backward_final_callback)

    def _root_post_backward_final_callback(self) -> None:
        logger.debug("FSDP::root_post_backward")
        with record_function("FSDP::root_post_backward_callback"):
            self._end_backward()

    def _end_backward(self) -> None:
        # Groups whose backward never ran (inputs without grad, unused modules) reduce
        # here; then every state starts the next iteration idle.
        # Only the last backward of an iteration (`set_is_last_backward`) ends it: the
        # forward order, the backward prefetch order and dispatched gathers survive
        # backward passes that more will follow before the optimizer step.
        last = self._state_ctx.is_last_backward
        self._state_ctx.iter_forward_root = None
        if last:
            self._state_ctx.post_forward_order.clear()
            self._learn_forward_order()
        for state in self._state_ctx.all_states:
            state._modules_to_run_forward.clear()
            # Reversed, as the backward runs them (FSDP2's order).
            for group in reversed(state._fsdp_param_groups):
                if group._training_state != TrainingState.POST_BACKWARD:
                    group.post_backward()
                if last:
                    # A prefetch whose module never ran must not outlive the
                    # iteration: the optimizer writes the shards it reads next.
                    group.cancel_prefetch()
                group._training_state = TrainingState.IDLE
            if last:
                state._post_forward_indices.clear()
            state._training_state = TrainingState.IDLE
        # Every collective of the backward is issued: the ranks compare their histories
        # (a digest each), so that one that differs fails here, before the optimizer.
        self._comm_ctx.start_agree()
        # The last reduce-scatter overlapped the end of the backward; the optimizer
        # (or the next backward's accumulation) reads its gradients.
        try:
            self._comm_ctx.finish_reduce()
        finally:
            self._state_ctx.post_backward_final_callback_queued = False
        self._comm_ctx.agree()

    def _learn_forward_order(self) -> None:
        order, self._state_ctx.pre_forward_order = self._state_ctx.pre_forward_order, []
        nexts: dict[FSDPState, FSDPState] = {}
        for before, after in itertools.pairwise(order):  # None: a new forward pass began
            if before is not None and after is not None and after is not before:
                nexts.setdefault(before, after)
        self._state_ctx.next_in_forward = nexts

    def _reset_iter_state(self) -> None:
        """Discards a failed iteration: unreduced gradients, gathered parameters, flags.

        Raises:
          RuntimeError: this state is not the root.
        """
        if self._is_root is False:
            raise RuntimeError(_reset_on_non_root(self.fqn))
        self._state_ctx.post_forward_order.clear()
        self._state_ctx.pre_forward_order.clear()
        self._comm_ctx.drop_reduce()  # the failed iteration's gradients
        for state in self._state_ctx.all_states or [self]:
            state._modules_to_run_forward.clear()
            state._post_forward_indices.clear()
            state._training_state = TrainingState.IDLE
            for group in state._fsdp_param_groups:
                group._reset_iter_state()
        self._state_ctx.iter_forward_root = None
        self._state_ctx.post_backward_final_callback_queued = False


# ---- the messages of FSDPState's checks ----


def _grouped_root(modules) -> str:
    names = ", ".join(type(m).__name__ for m in modules)
    return (
        f"fully_shard: the first forward ran through a group of several modules ({names}), "
        "so that group would be the root; the root must be a single module. Call "
        "fully_shard(model) on the module that contains them and run forward through it."
    )


def _child_ran_forward_first(name: str, root: str) -> str:
    return (
        f"fully_shard: module {name!r} already ran forward on its own before the root "
        f"{root} did, so it initialised as a root itself. Run the first forward through "
        "the root module (the outermost fully_shard module)."
    )


def _param_in_two_groups(fqn: str, other: str) -> str:
    # FSDP2's wording ("is shared with a parameter already managed by another FSDP
    # group"), which PyTorch's own tests match, plus the name of the other user.
    return (
        f"Parameter '{fqn}' is shared with a parameter already managed by another FSDP "
        f"group (as {other!r}). For shared/tied parameters, use "
        "fully_shard([module_a, module_b]) to place them in the same FSDP group."
    )


def _several_groups(groups: list[FSDPParamGroup]) -> str:
    # FSDP2's sentence first: code written for FSDP2 may match it.
    fqns = [g._module_fqn for g in groups]
    return (
        f"Expected at most 1 param group for backward compatibility, but got {len(groups)} "
        f"(fqns: {fqns}): shard_placement_fn put parameters on {len(groups)} meshes "
        "(ShardPlacementResult), one group each. Use `_fsdp_param_groups` (plural) to "
        "access all param groups."
    )


def _view_output(fqn: str) -> str:
    return (
        f"fully_shard: module {fqn!r} returned a view tensor. An in-place op on it (x += y) "
        "would drop the pre-backward hook and skip the re-gather; use out-of-place ops or "
        ".clone() the output first."
    )


def _reset_on_non_root(fqn: str) -> str:
    return (
        f"reset_iter_state: module {fqn!r} is not the root; call it on the root module "
        "(the one whose forward ran first)."
    )
