"""funshard's exceptions: one typed hierarchy, each class also the built-in it replaces.

Every error funshard raises for a user's mistake is a `FunshardError`, and also the
built-in exception Python code already catches for that kind of mistake: a
`ShardingValueError` is a `ValueError`, a `ShardingTypeError` a `TypeError`. Existing
`except ValueError:` code keeps working; `except funshard.errors.FunshardError:` catches
every funshard error at once. The message names the offending leaf by its key path and
says how to fix it. docs/errors.md lists the classes and where each is raised.
"""

from __future__ import annotations


class FunshardError(Exception):
    """Base class of every error funshard raises for a user's input or environment."""


class ShardingValueError(FunshardError, ValueError):
    """A value funshard cannot work with: a shape, dtype, mesh, axis, option or batch."""


class ShardingTypeError(FunshardError, TypeError):
    """An object of the wrong kind: a non-array leaf, a `Sharded` leaf in user math."""


class UnsupportedError(FunshardError, NotImplementedError):
    """A layout or composition funshard does not support (yet); the message says why."""


class PolicyMismatchError(FunshardError, RuntimeError):
    """A compiled step does not match the policy it declares (`funshard.check(strict=True)`)."""


class CheckpointError(FunshardError, ValueError):
    """A directory that is not a checkpoint, is corrupt, or does not match its target."""


class CheckpointExistsError(FunshardError, FileExistsError):
    """A checkpoint directory already exists and overwriting was not asked for."""


class CheckpointNotFoundError(FunshardError, FileNotFoundError):
    """No checkpoint directory at the path given to `restore` (or its save is in flight)."""


class CheckpointInFlightError(FunshardError, RuntimeError):
    """An asynchronous save to the same directory has not finished; `.wait()` on it first."""


class DistributedError(FunshardError, RuntimeError):
    """The multi-process runtime failed: a peer left, start-up gave up, or state is stale."""


class DistributedTimeoutError(FunshardError, TimeoutError):
    """Multi-process start-up or a collective did not complete within its time limit."""


class BackendStartedWarning(RuntimeWarning):
    """JAX's backend started before `import funshard`: what funshard sets up first is missing.

    funshard sizes the CPU backend's thread pool when JAX creates it, and a
    multi-process job must call `funshard.distributed.initialize()` before the backend
    starts. The warning says which of the two was lost and how to order the calls.
    """


__all__ = [
    "BackendStartedWarning",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInFlightError",
    "CheckpointNotFoundError",
    "DistributedError",
    "DistributedTimeoutError",
    "FunshardError",
    "ShardingTypeError",
    "ShardingValueError",
    "UnsupportedError",
]
