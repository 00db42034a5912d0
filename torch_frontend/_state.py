"""Per-module state: FSDP2's hooks and its lazy root, over one `ParamGroup`."""

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
from torch_frontend._group import ParamGroup, TrainingState
from torch_frontend._policy import MixedPrecisionPolicy, cast_floating
from torch_frontend._tree import map_tensors, tensors

STATE_ATTR = "_torch_frontend_state"

logger = logging.getLogger("torch_frontend")  # silent unless configured (see _group.py)


class IterationContext:
    """What every state of one root shares (FSDP2's FSDPStateContext)."""

    def __init__(self):
        self.all_states: list[FSDPState] = []  # named_modules() pre-order of the root
        self.iter_forward_root: FSDPState | None = None
        self.final_callback_queued = False
        self.is_last_backward = True
        # States in the order their post-forward ran this iteration (with repeats):
        # the default backward prefetch walks it backwards.
        self.post_forward_order: list[FSDPState] = []
        # States in the order their pre-forward ran this iteration, and, from the last
        # iteration that ran backward, the state that ran next after each: the default
        # forward prefetch.
        self.pre_forward_order: list[FSDPState | None] = []
        self.next_in_forward: dict[FSDPState, FSDPState] = {}


def state_of(module: nn.Module) -> FSDPState | None:
    """The state `fully_shard` attached to `module`, if any."""
    return module.__dict__.get(STATE_ATTR)


class FSDPState:
    """The hooks of one `fully_shard` call (one module, or a list grouped as one)."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        group: ParamGroup,
        mp_policy: MixedPrecisionPolicy,
        auto_reshard_after_forward: bool,
    ):
        self.modules, self.group, self.mp_policy = modules, group, mp_policy
        self.auto_reshard_after_forward = auto_reshard_after_forward
        self.is_root: bool | None = None
        self.ctx = IterationContext()
        self.training_state = TrainingState.IDLE
        self.modules_to_run: set[nn.Module] = set()
        self.forward_prefetch: list[FSDPState] | None = None  # None: the default
        self.backward_prefetch: list[FSDPState] | None = None  # None: the default
        self.post_forward_indices: list[int] = []
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

    # ---- forward ----

    def _module_pre_forward(self, module, _module, args, kwargs):
        if len(self.modules) > 1 and not self.modules_to_run:
            self.modules_to_run.update(self.modules)
        return self.pre_forward(args, kwargs)

    def _module_post_forward(self, module, _module, _args, output):
        if len(self.modules) > 1:
            if module not in self.modules_to_run:
                return self.cast_output(output)
            self.modules_to_run.discard(module)
            if self.modules_to_run:  # the group's post-forward waits for its last module
                return self.cast_output(output)
        with self._traced("FSDP::post_forward"):
            return self.post_forward(output)

    def _traced(self, label: str) -> record_function:
        """A profiler range named as FSDP2 names it ("<label> (<fqn>)"), logged at debug."""
        label = self.group.with_fqn(label)
        logger.debug("%s", label)
        return record_function(label)

    def pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Root set-up once per pass, input cast, ONE all-gather, post-backward hook."""
        if self.training_state == TrainingState.PRE_BACKWARD:
            # Activation checkpointing re-runs forward inside backward: parameters only.
            with self._traced("FSDP::pre_forward"):
                self.group.unshard()
            return self.cast_inputs(args, kwargs)
        first_in_pass = self.training_state != TrainingState.FORWARD
        self.training_state = TrainingState.FORWARD
        if first_in_pass:
            self._root_pre_forward()
        args, kwargs = self.cast_inputs(args, kwargs)
        with self._traced("FSDP::pre_forward"):
            args, kwargs = self.group.pre_forward(args, kwargs)
        if first_in_pass and torch.is_grad_enabled():
            self.ctx.pre_forward_order.append(self)
            for state in self._forward_prefetch_targets():  # dispatched now: they run
                with record_function(f"FSDP::forward_prefetch for {state.group.module_fqn}"):
                    state.group.unshard(async_op=True)  # while we compute
        return args, kwargs

    def _forward_prefetch_targets(self) -> list[FSDPState]:
        """Explicit targets, else the state that ran forward after ours last iteration."""
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        after = self.ctx.next_in_forward.get(self)
        return [after] if after is not None else []

    def post_forward(self, output: Any) -> Any:
        """Reshard (per reshard_after_forward), pre-backward hooks, output cast."""
        if self.training_state == TrainingState.PRE_BACKWARD:
            return self.cast_output(output)
        self._finish_forward()
        output = self._register_pre_backward(output)
        if self.ctx.iter_forward_root is self:
            output = self._complete_unfinished_groups(output)
            self.ctx.iter_forward_root = None
        return self.cast_output(output)

    def _finish_forward(self) -> None:
        self.group.post_forward()
        if torch.is_grad_enabled():  # only a forward that a backward may follow
            self.post_forward_indices.append(len(self.ctx.post_forward_order))
            self.ctx.post_forward_order.append(self)
        self.training_state = TrainingState.IDLE

    def cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        policy = self.mp_policy
        if not (policy.cast_forward_inputs and policy.param_dtype):
            return args, kwargs
        cast = functools.partial(cast_floating, policy.param_dtype)
        with record_function("FSDP::cast_forward_inputs"):
            return map_tensors(cast, args), map_tensors(cast, kwargs)

    def cast_output(self, output: Any) -> Any:
        if self.mp_policy.output_dtype is None:
            return output
        with record_function("FSDP::cast_forward_outputs"):
            return map_tensors(
                functools.partial(cast_floating, self.mp_policy.output_dtype), output
            )

    def _root_pre_forward(self) -> None:
        self.lazy_init()
        if self.ctx.iter_forward_root is None:
            logger.debug("FSDP::root_pre_forward")
            self.ctx.iter_forward_root = self
            with record_function("FSDP::root_pre_forward"):
                self.ctx.pre_forward_order.append(None)
                for state in self.ctx.all_states:
                    state.group.drop_stale_parts()

    def _complete_unfinished_groups(self, output: Any) -> Any:
        # A grouped state whose modules did not all run forward never reached its
        # post-forward; finish it here (deepest first, as the forward would unwind).
        for state in reversed(self.ctx.all_states):
            if state is self or not state.modules_to_run:
                continue
            state._finish_forward()
            output = state._register_pre_backward(output)
            output = state.cast_output(output)
            state.modules_to_run.clear()
        return output

    # ---- lazy initialisation: the first state to run forward is the root ----

    def lazy_init(self) -> None:
        """Makes this state the root and collects every state below it (once).

        Raises:
          RuntimeError: the root is a group of several modules, or a state below it
            already ran forward as a root of its own.
          ValueError: one parameter is managed by two groups.
        """
        if self.is_root is not None:
            return
        if len(self.modules) > 1:
            raise RuntimeError(_grouped_root(self.modules))
        self.is_root = True
        root = self.modules[0]
        for name, module in root.named_modules():
            state = state_of(module)
            if state is None or state in self.ctx.all_states:
                continue
            if state is not self:
                if state.is_root is not None:
                    raise RuntimeError(_child_ran_forward_first(name, type(root).__name__))
                state.is_root = False
                state.fqn = state.group.name = name
            state.ctx = self.ctx
            self.ctx.all_states.append(state)
        self._name_groups(root)
        if self.auto_reshard_after_forward:
            # The root's parameters would be gathered again at once for the backward pass.
            self.group.reshard_after_forward = False
        self._name_params(root)  # first: the errors below name parameters from the root
        # As FSDP2's lazy init: a parameter replaced since fully_shard by a DTensor of
        # the same sharding (computed from other sharded parameters, e.g. DoRA's
        # magnitudes) becomes the managed one.
        for state in self.ctx.all_states:
            for param in state.group.params:
                param.reset_sharded_param()
        self._check_names()
        if logger.isEnabledFor(logging.DEBUG):
            self._log_lazy_init(root)

    def _name_groups(self, root: nn.Module) -> None:
        """Sets each group's `module_fqn` as FSDP2 does: its modules' paths, ", "-joined."""
        names: dict[FSDPState, list[str]] = {}
        for name, module in root.named_modules():
            state = state_of(module)
            if state is not None and state.ctx is self.ctx:
                names.setdefault(state, []).append(name)
        for state, paths in names.items():
            state.group.module_fqn = ", ".join(paths)

    def _log_lazy_init(self, root: nn.Module) -> None:
        groups = "; ".join(
            f"{s.group.module_fqn or '<root>'}: {len(s.group.params)} parameters, "
            f"reshard_after_forward={s.group.reshard_after_forward}"
            for s in self.ctx.all_states
        )
        logger.debug(
            "FSDP::lazy_init: root %s with %d fully_shard groups (%s)",
            type(root).__name__,
            len(self.ctx.all_states),
            groups,
        )

    def _name_params(self, root: nn.Module) -> None:
        """Names every managed parameter by its path from the root, for messages."""
        by_param = {id(p.sharded): p for s in self.ctx.all_states for p in s.group.params}
        module_names: dict[int, str] = {}
        for name, module in root.named_modules(remove_duplicate=False):
            module_names.setdefault(id(module), name)
        for param in by_param.values():  # also those no module holds now (set to None)
            module, attr = param.uses[0]
            if id(module) in module_names:
                prefix = module_names[id(module)]
                param.fqn = f"{prefix}.{attr}" if prefix else attr
        for name, param in root.named_parameters(remove_duplicate=False):
            if id(param) in by_param:
                by_param[id(param)].fqn = name

    def _check_names(self) -> None:
        """Raises if one original parameter is managed by two groups (tied weights).

        Raises:
          ValueError: FSDP2's lazy-init error, naming both users of the parameter.
        """
        owners: dict[int, str] = {}
        for state in self.ctx.all_states:
            for param in state.group.params:
                if param.orig_uid in owners:
                    raise errors.ShardingValueError(
                        _param_in_two_groups(param.fqn, owners[param.orig_uid])
                    )
                owners[param.orig_uid] = param.fqn

    # ---- backward ----

    def _register_pre_backward(self, output: Any) -> Any:
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
        if self.training_state == TrainingState.PRE_BACKWARD:
            # A further output of this module: the group is gathered already (FSDP2
            # names and logs only the first call).
            self._run_pre_backward()
            return
        with self._traced("FSDP::pre_backward"):
            self._run_pre_backward()

    def _run_pre_backward(self) -> None:
        already = self.training_state == TrainingState.PRE_BACKWARD
        self.training_state = TrainingState.PRE_BACKWARD
        self._queue_final_callback()
        self.group.pre_backward()
        if not already:
            for state in self._backward_prefetch_targets():
                with record_function(f"FSDP::backward_prefetch for {state.group.module_fqn}"):
                    state.group.prefetch_for_backward()

    def _backward_prefetch_targets(self) -> list[FSDPState]:
        """Explicit targets, else the state whose post-forward ran just before ours."""
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        if not self.post_forward_indices:
            return []
        index = self.post_forward_indices.pop()
        return [self.ctx.post_forward_order[index - 1]] if index > 0 else []

    def _queue_final_callback(self) -> None:
        if self.ctx.final_callback_queued:
            return
        self.ctx.final_callback_queued = True
        root = self.ctx.all_states[0] if self.ctx.all_states else self
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
        last = self.ctx.is_last_backward
        self.ctx.iter_forward_root = None
        if last:
            self.ctx.post_forward_order.clear()
            self._learn_forward_order()
        for state in self.ctx.all_states:
            state.modules_to_run.clear()
            if state.group.training_state != TrainingState.POST_BACKWARD:
                state.group.post_backward()
            if last:
                state.post_forward_indices.clear()
                # A prefetch whose module never ran must not outlive the iteration:
                # the optimizer writes the shards it reads next.
                state.group.cancel_prefetch()
            state.group.training_state = TrainingState.IDLE
            state.training_state = TrainingState.IDLE
        # The last reduce-scatter overlapped the end of the backward; the optimizer
        # (or the next backward's accumulation) reads its gradients.
        self.group.layout.comm.finish_reduce()
        self.ctx.final_callback_queued = False

    def _learn_forward_order(self) -> None:
        order, self.ctx.pre_forward_order = self.ctx.pre_forward_order, []
        nexts: dict[FSDPState, FSDPState] = {}
        for before, after in itertools.pairwise(order):  # None: a new forward pass began
            if before is not None and after is not None and after is not before:
                nexts.setdefault(before, after)
        self.ctx.next_in_forward = nexts

    def reset_iter_state(self) -> None:
        """Discards a failed iteration: unreduced gradients, gathered parameters, flags.

        Raises:
          RuntimeError: this state is not the root.
        """
        if self.is_root is False:
            raise RuntimeError(_reset_on_non_root(self.fqn))
        self.ctx.post_forward_order.clear()
        self.ctx.pre_forward_order.clear()
        self.group.layout.comm.drop_reduce()  # the failed iteration's gradients
        for state in self.ctx.all_states or [self]:
            state.modules_to_run.clear()
            state.post_forward_indices.clear()
            state.training_state = TrainingState.IDLE
            state.group.reset_iter_state()
        self.ctx.iter_forward_root = None
        self.ctx.final_callback_queued = False


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
