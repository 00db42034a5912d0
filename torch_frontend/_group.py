"""A group of parameters gathered and reduced together: one collective of each kind."""

from __future__ import annotations

import enum

import torch
from torch import nn
from torch.utils import _pytree as pytree

from torch_frontend import _bridge
from torch_frontend._param import FSDPParam
from torch_frontend._policy import MixedPrecisionPolicy


class TrainingState(enum.Enum):
    """Where a state or group is in the iteration (FSDP2's states)."""

    IDLE = enum.auto()
    FORWARD = enum.auto()
    PRE_BACKWARD = enum.auto()
    POST_BACKWARD = enum.auto()


class ParamGroup:
    """The parameters of one `fully_shard` call and their per-iteration lifecycle.

    Every transition calls one bridge function: `unshard` is ONE all-gather of all
    parameters, `post_backward` ONE reduce-scatter of all their gradients.
    """

    def __init__(self, params: list[FSDPParam], layout: _bridge.Layout,
                 mp_policy: MixedPrecisionPolicy, reshard_after_forward: bool | int):
        self.params, self.layout, self.mp_policy = params, layout, mp_policy
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.reduce_grads = True
        self.all_reduce_grads = True  # HSDP: all-reduce over the replicas (FSDP2's flag)
        self.unshard_in_backward = True
        self.gradient_divide_factor: float | None = None
        self.training_state = TrainingState.IDLE
        self.is_unsharded = False
        self._pending: list | None = None  # a dispatched, not yet bound all-gather
        self._parts: _bridge.Layout | None = None  # hpZ: the group layout of kept parts

    def param_dtype(self, param: FSDPParam) -> torch.dtype:
        return self.mp_policy.param_dtype or param.dtype

    def reduce_dtype(self, param: FSDPParam) -> torch.dtype:
        return self.mp_policy.reduce_dtype or self.param_dtype(param)

    def unshard(self, async_op: bool = False) -> None:
        """Gathers every parameter of the group (one collective) and binds the results.

        Args:
          async_op: only dispatch the gather (a prefetch); `wait_for_unshard` binds.
        """
        if self.is_unsharded or self._pending is not None:
            if not async_op:
                self.wait_for_unshard()
            return
        if self.params and self._parts is not None:
            # hpZ: gather the kept parts within the group of k ranks only.
            blocks = [p.part_block() for p in self.params]
            self._pending = _bridge.start_all_gather(
                self._parts, blocks, *self._rows_and_dims())
        elif self.params:
            blocks = [p.gather_input(self.layout, self.param_dtype(p)) for p in self.params]
            self._pending = _bridge.start_all_gather(self.layout, blocks, *self._rows_and_dims())
        else:
            self.is_unsharded = True
        if not async_op:
            self.wait_for_unshard()

    def _rows_and_dims(self) -> tuple[list[int], list[int]]:
        return [p.rows for p in self.params], [p.dim for p in self.params]

    def wait_for_unshard(self) -> None:
        """Completes a dispatched gather and binds the gathered parameters."""
        if self._pending is None:
            return
        fulls = _bridge.finish_all_gather(self._pending)
        self._pending = None
        for param, full in zip(self.params, fulls):
            param.to_unsharded(full)
            param.drop_part()
        self._parts = None
        self.is_unsharded = True

    def reshard(self) -> None:
        """Binds the local shards again and drops the gathered tensors (and hpZ parts)."""
        if self._pending is not None:
            # Its input is the shards' storage, which torch may write next (optimizer).
            _bridge.finish_all_gather(self._pending)
            self._pending = None
        for param in self.params:
            param.to_sharded()
            param.drop_part()
        self._parts = None
        self.is_unsharded = False

    def reshard_to_group(self, k: int) -> None:
        """Keeps 1/k of each gathered parameter and frees the rest (FSDP2's hpZ).

        The backward's `unshard` then gathers within groups of k consecutive ranks.
        """
        self.wait_for_unshard()
        if not self.is_unsharded:
            return
        hpz = _bridge.hpz_layout(self.layout, k)
        for param in self.params:
            param.keep_part(self.layout, hpz)
            param.to_sharded()
        self._parts = hpz
        self.is_unsharded = False

    def pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Unshards; on the first module of the pass, hooks post-backward onto the inputs."""
        entering = self.training_state != TrainingState.FORWARD
        self.training_state = TrainingState.FORWARD
        self.unshard()
        if entering:
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def post_forward(self) -> None:
        k = self.reshard_after_forward
        if k is True or k == self.layout.world:
            self.reshard()
        elif k is not False and k > 1:
            # Without autograd no backward follows: nothing is worth keeping.
            self.reshard_to_group(k) if torch.is_grad_enabled() else self.reshard()
        self.training_state = TrainingState.IDLE

    def pre_backward(self) -> None:
        if self.training_state == TrainingState.PRE_BACKWARD:
            return
        self.training_state = TrainingState.PRE_BACKWARD
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
        self.training_state = TrainingState.POST_BACKWARD
        if not self.reduce_grads:
            for param in self.params:
                param.accumulate_unsharded_grad(self.reduce_dtype(param))
            self._reshard_after_backward()
            return
        all_reduce = self.all_reduce_grads or not self.layout.replicate_axes
        with_grad, grads = [], []
        for param in self.params:
            grad = param.take_unsharded_grad(self.reduce_dtype(param))
            if all_reduce:
                grad = param.with_partial_grad(grad, self.reduce_dtype(param), self.layout.rank)
            if grad is not None:
                with_grad.append(param)
                grads.append(grad)
        self._reshard_after_backward()
        if not with_grad:
            return
        blocks = _bridge.reduce_scatter(
            self.layout, grads, [p.dim for p in with_grad], all_reduce=all_reduce)
        if not all_reduce:
            for param, block in zip(with_grad, blocks):
                param.add_partial_grad(block)
            return
        factor = self.gradient_divide_factor or float(self.layout.data_parallel)
        for param, block in zip(with_grad, blocks):
            param.add_sharded_grad(block, factor)

    def cancel_prefetch(self) -> None:
        """Completes and drops a dispatched gather that nothing waited for."""
        if self._pending is not None:
            _bridge.finish_all_gather(self._pending)
            self._pending = None

    def drop_stale_parts(self) -> None:
        """Reshards fully if hpZ parts from an earlier forward are still kept.

        They were copied from the parameters of that forward; a later optimizer step
        changes the shards, so a new iteration never gathers from them.
        """
        if self._parts is not None:
            self.reshard()

    def reset_iter_state(self) -> None:
        """Drops this iteration's unreduced gradients and reshards (after an exception)."""
        for param in self.params:
            if param.unsharded is not None:
                param.unsharded.grad = None
        self.training_state = TrainingState.IDLE
        self.reshard()

    def _reshard_after_backward(self) -> None:
        if self.reshard_after_backward:
            self.reshard()

    def _register_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        # Autograd runs the Function's backward once the gradients of the inputs are
        # computed, i.e. after the module's backward (parameter gradients accumulate
        # first: AccumulateGrad nodes have the highest priority). Without such inputs,
        # the root's final callback runs post_backward.
        leaves, spec = pytree.tree_flatten((args, kwargs))
        where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not where or not torch.is_grad_enabled():
            return args, kwargs
        outs = _PostBackward.apply(self, *(leaves[i] for i in where))
        for i, out in zip(where, outs):
            leaves[i] = out
        return pytree.tree_unflatten(leaves, spec)


class _PostBackward(torch.autograd.Function):
    """Identity on the module's inputs whose backward runs the group's post-backward."""

    @staticmethod
    def forward(ctx, group: ParamGroup, *inputs: torch.Tensor):
        ctx.group = group
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.group.post_backward()
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
