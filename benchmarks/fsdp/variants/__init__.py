"""The benchmark's variants: ways of training the same model, compared in one run.

Each module in this folder registers one or more builders `build(ctx) -> Variant` with
`register`; `builders()` imports them all, so adding a variant (a torch or Flax form,
say) is one small file here and no edit anywhere else::

    # benchmarks/fsdp/variants/flax_fsdp.py
    \"\"\"Flax: the model as an nnx.Module, sharded with funshard's Flax adapter.\"\"\"

    import jax

    from . import Context, Variant, register


    @register(order=90)  # where it sits in the tables (the existing ones use 10..80)
    def variant_flax(ctx: Context) -> Variant | None:
        try:
            import flax  # noqa: F401
        except ImportError:
            return None  # skipped: the run goes on without this variant
        step, state, tokens = ...  # build from ctx.cfg, ctx.params, ctx.tokens, ctx.opt
        return Variant("flax fsdp", jax.jit(step), state, (tokens,), len(ctx.devices),
                       "one line for the report's variant notes")

The step must be `step(state, *const) -> (new_state, loss)`: the run feeds `new_state`
back each step and reads collectives, memory and FLOPs from its compiled program.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

import numpy as np
import optax

from ..model import Config

AXIS = "fsdp"  # the one mesh axis every multi-device variant shards over
# The variant the others are compared with ("time / funshard", targets, probes).
BASELINE = "funshard reshard=True"


@dataclasses.dataclass
class Context:
    """What every variant builder gets: the config, the host-side full parameters and batch."""

    cfg: Config
    params: dict  # full f32 parameters (numpy, host)
    tokens: np.ndarray  # (batch, seq) int32, the global batch
    devices: list
    opt: optax.GradientTransformation


@dataclasses.dataclass
class Variant:
    """One jitted train step `step(state, *const) -> (new_state, loss)`.

    `state` (parameters + optimizer state, or the buffers for collectives-only) is fed
    back each step; `const` (the batch, ...) is not.
    """

    name: str
    step: Callable
    state: Any
    const: tuple
    devices: int
    note: str = ""
    has_loss: bool = True  # False: the step's scalar output is not a training loss


Builder = Callable[[Context], Variant | None]
_REGISTRY: list[tuple[float, Builder]] = []


def register(order: float) -> Callable[[Builder], Builder]:
    """Returns a decorator that adds a variant builder to the benchmark.

    Args:
        order: the variant's place in the run and in the report's tables (ascending;
            ties keep import order).

    Returns:
        A decorator that records the builder and returns it unchanged. A builder may
        return None to leave its variant out of the run (an optional dependency missing).
    """

    def add(build: Builder) -> Builder:
        _REGISTRY.append((order, build))
        return build

    return add


def builders() -> list[Builder]:
    """Imports every module of this package and returns the registered builders in order."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return [build for _, build in sorted(_REGISTRY, key=lambda entry: entry[0])]


def train_step(value_and_grad: Callable, opt: optax.GradientTransformation) -> Callable:
    """Returns `step((params, opt_state), tokens) -> ((params, opt_state), loss)`.

    Args:
        value_and_grad: `value_and_grad(params, tokens) -> (loss, grads)`, e.g.
            `jax.value_and_grad(loss)` or `fs.value_and_grad(loss)`.
        opt: the optimizer; its update is applied to the parameters.
    """

    def step(train_state, tokens):
        params, opt_state = train_state
        value, grads = value_and_grad(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    return step
