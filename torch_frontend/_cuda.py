"""CUDA for torch_frontend: JAX's allocator, torch's backend and device, stream order.

Torch and JAX share one GPU per process (LOCAL_RANK's). Three things keep them from
stepping on each other; docs/gpu.md explains them for users:

- **Memory.** JAX's GPU client preallocates 75% of the GPU when its backend starts.
  `configure_allocator` sets `XLA_PYTHON_CLIENT_PREALLOCATE=false` before that (JAX
  then grows its pool on demand), unless the user chose an allocator setting already.
- **Devices and groups.** Torch's current CUDA device is the process's JAX device
  (`torch_device`), and torch's default process group uses NCCL for CUDA tensors
  (`torch_backend`); the hot path's collectives still run on JAX (NCCL too).
- **Stream order at the DLPack crossing.** Torch -> JAX: the import passes JAX's stream
  to torch's `__dlpack__`, which makes it wait for torch's current stream
  (`funshard.comm.dlpack_import`). JAX -> torch: `export` passes torch's current
  stream to JAX's `__dlpack__`, which makes it wait until JAX has written the buffer;
  and JAX's buffer stays alive until torch's stream has passed the last use of the
  tensor viewing it (`Retirement`), so JAX never hands the memory to a new program
  while a torch kernel may still read it. The bridge's host waits
  (`jax.block_until_ready` before a collective's result is handed over) keep torch
  from reusing a shard buffer that a gather may still be reading.

Everything here is a no-op for CPU tensors. The pure functions take their inputs as
arguments, so the choices are tested on CPU (tests/test_cuda_paths.py); the CUDA paths
themselves are tested by tests/test_gpu.py on a GPU.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

from funshard import comm, errors

# The environment variables that choose JAX's GPU allocator (read by jaxlib's
# `generate_pjrt_gpu_plugin_options` when the GPU backend starts). If the user set any
# of them, their choice stands.
ALLOCATOR_VARS = (
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_ALLOCATOR",
)
_DLPACK_CUDA = 2  # DLDeviceType.kDLCUDA


def allocator_env(environ: Mapping[str, str], cuda: bool) -> dict[str, str]:
    """The environment variables to set so that JAX leaves the GPU's memory to torch.

    Args:
      environ: the process environment (not modified).
      cuda: whether torch uses CUDA in this process.

    Returns:
      `{"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}` when CUDA is in use and the user set
      none of `ALLOCATOR_VARS`; otherwise `{}`.
    """
    if not cuda or any(name in environ for name in ALLOCATOR_VARS):
        return {}
    return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def configure_allocator(
    environ: MutableMapping[str, str] | None = None,
    *,
    cuda: bool | None = None,
    backend_started: Callable[[], bool] | None = None,
) -> dict[str, str]:
    """Sets `allocator_env` in the environment, before JAX's GPU backend starts.

    Call it before any JAX call that starts a backend (`init_distributed` does, first).

    Args:
      environ: the environment to update (default `os.environ`).
      cuda: whether torch uses CUDA (default `torch.cuda.is_available()`).
      backend_started: whether a JAX backend is running already (default
        `funshard.comm.backends_started`).

    Returns:
      The variables it set (`{}` if none were needed or it was too late).

    Warns:
      RuntimeWarning: the settings were needed but JAX's backend had already started
        (JAX then keeps its default of preallocating 75% of the GPU).
    """
    environ = os.environ if environ is None else environ
    cuda = torch.cuda.is_available() if cuda is None else cuda
    wanted = allocator_env(environ, cuda)
    if not wanted:
        return {}
    started = comm.backends_started if backend_started is None else backend_started
    if started():
        warnings.warn(_too_late_message(), RuntimeWarning, stacklevel=2)
        return {}
    environ.update(wanted)
    return wanted


def _too_late_message() -> str:
    return (
        "torch_frontend: JAX's backend started before init_distributed(), so its GPU "
        "allocator keeps its default of preallocating 75% of the GPU's memory and torch "
        "gets the rest. Call torch_frontend.init_distributed() before any other JAX "
        "call, or set XLA_PYTHON_CLIENT_PREALLOCATE=false (or XLA_CLIENT_MEM_FRACTION) "
        "in the environment before starting Python."
    )


def device_type(jax_device: Any) -> str:
    """The torch device type ("cuda" or "cpu") of the memory of `jax_device`.

    JAX calls CUDA and ROCm GPUs platform "gpu"; torch calls both "cuda".
    """
    return "cuda" if jax_device.platform == "gpu" else "cpu"


def torch_device(jax_device: Any) -> torch.device:
    """The torch device whose memory is `jax_device`'s (a GPU's CUDA ordinal, or CPU)."""
    if device_type(jax_device) == "cuda":
        return torch.device("cuda", jax_device.local_hardware_id)
    return torch.device("cpu")


def torch_backend(device_type: str) -> str:
    """The backend of torch's default process group for a frontend on `device_type`.

    NCCL for CUDA tensors; gloo stays for CPU tensors (torch.distributed.checkpoint's
    metadata, object collectives), as torch's own "cpu:gloo,cuda:nccl" default.
    """
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def set_torch_device(jax_device: Any) -> None:
    """Makes torch's current CUDA device the GPU of `jax_device` (no-op on CPU).

    Torch's `__dlpack__` exports only tensors of the current device, and NCCL needs
    each rank on its own GPU; JAX's device is LOCAL_RANK's GPU under torchrun.
    """
    if device_type(jax_device) == "cuda":
        torch.cuda.set_device(torch_device(jax_device))


def check_same_device(tensor: torch.Tensor, jax_device: Any) -> None:
    """Raises unless `tensor` lives in `jax_device`'s memory (zero-copy needs it).

    Raises:
      ValueError: naming both devices and how to put the model on the right one.
    """
    want = torch_device(jax_device)
    have = tensor.device
    if have.type != want.type or (want.type == "cuda" and have.index != want.index):
        raise errors.ShardingValueError(_other_device(have, jax_device, want))


def _other_device(have: torch.device, jax_device: Any, want: torch.device) -> str:
    return (
        f"fully_shard: a tensor on {have} meets this process's JAX device "
        f"{jax_device} (torch {want}); tensors cross to JAX without a copy, so they "
        f"must be on {want}. Move the model there before the first forward "
        f"(model.to({str(want)!r}); under torchrun, torch.device('cuda', LOCAL_RANK))"
        + (
            ""
            if want.type == "cuda"
            else ", or install JAX's CUDA plugin (pip install -e '.[cuda]') so that JAX "
            "runs on the GPU"
        )
        + "."
    )


def importing(tensor: torch.Tensor):
    """A context in which torch can export `tensor` by DLPack (its device current).

    Torch's `__dlpack__` refuses tensors of another CUDA device than the current one,
    and makes JAX wait for the current device's current stream.
    """
    if tensor.is_cuda and tensor.device.index != torch.cuda.current_device():
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def dlpack_stream(cuda_stream: int) -> int:
    """The DLPack `stream` value for a CUDA stream handle (the array API's convention).

    The legacy default stream (handle 0) is passed as 1; any other stream as its handle.
    """
    return 1 if cuda_stream == 0 else cuda_stream


class Retirement:
    """Keeps JAX buffers alive until torch's stream has passed every use of their views.

    A torch tensor made from a JAX buffer by DLPack frees its reference the moment its
    storage dies on the host, while torch kernels reading it may still be queued on
    torch's stream; JAX could then hand the memory to a new program on its own stream.
    So the JAX array is held until the storage has died AND an event recorded on torch's
    stream at that moment has completed (every kernel queued before it has run).

    Args:
      record: `record(stream) -> event` with `event.query() -> bool` (default: a
        `torch.cuda.Event` recorded on `stream`).
    """

    def __init__(self, record: Callable[[Any], Any] | None = None):
        self._record = record or _record_cuda_event
        self._lock = threading.Lock()
        self._retired: list[tuple[Any, Any]] = []

    def keep(self, array: Any, tensor: torch.Tensor, stream: Any) -> None:
        """Holds `array` until `tensor`'s storage is dead and `stream` has passed it."""
        finalizer = weakref.finalize(tensor.untyped_storage(), self._retire, array, stream)
        finalizer.atexit = False  # no CUDA calls during interpreter shutdown

    def _retire(self, array: Any, stream: Any) -> None:
        event = self._record(stream)
        with self._lock:
            self._retired.append((event, array))

    def release_finished(self) -> int:
        """Drops the arrays whose events have completed; returns how many are still held."""
        with self._lock:
            self._retired = [(e, a) for e, a in self._retired if not e.query()]
            return len(self._retired)

    @property
    def held(self) -> int:
        """Arrays retired (their torch views dead) but not yet released."""
        with self._lock:
            return len(self._retired)


def _record_cuda_event(stream: Any) -> Any:
    event = torch.cuda.Event()
    event.record(stream)
    return event


RETIREMENT = Retirement()


def export(block: Any) -> torch.Tensor:
    """JAX's single-device array `block` as a torch tensor sharing its memory.

    On a GPU, torch's current stream waits (DLPack's stream argument) until JAX has
    written `block`, and `block` is kept alive until torch is done with the view
    (`RETIREMENT`). On CPU it is `torch.from_dlpack(block)`.
    """
    kind, index = block.__dlpack_device__()
    if int(kind) != _DLPACK_CUDA:
        return torch.from_dlpack(block)
    RETIREMENT.release_finished()
    stream = torch.cuda.current_stream(torch.device("cuda", index))
    capsule = block.__dlpack__(stream=dlpack_stream(stream.cuda_stream))
    tensor = torch.utils.dlpack.from_dlpack(capsule)
    RETIREMENT.keep(block, tensor, stream)
    return tensor
