"""PyTorch frontend: FSDP2's `fully_shard` on the funshard core, collectives through JAX.

    from torch_frontend import fully_shard, MixedPrecisionPolicy, init_distributed

    init_distributed()                 # JAX's runtime + torch's default process group
    mesh = init_device_mesh("cpu", (world,))   # or torch_frontend.device_mesh()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)      # parameters are DTensors, as with FSDP2

    torch_frontend.save(path, model, opt, step)   # funshard.save's format; fs.restore reads it

See docs/torch.md.
"""

try:
    import torch as _torch  # noqa: F401  (the optional extra, checked before the modules)
except ModuleNotFoundError as error:
    if error.name != "torch":
        raise
    # A subclass of ImportError with the missing module's name, as pytest.importorskip
    # and `except ModuleNotFoundError` expect; the message names the extra to install.
    raise ModuleNotFoundError(
        "torch_frontend needs PyTorch, an optional extra of funshard: "
        'pip install "funshard[torch]" (torch >=2.13,<2.15; on a CPU-only machine '
        "install torch from PyTorch's CPU wheel index first, see docs/torch.md).",
        name="torch",
    ) from error

from torch_frontend._check import check as check
from torch_frontend._checkpoint import restore as restore
from torch_frontend._checkpoint import save as save
from torch_frontend._clip import clip_grad_norm_ as clip_grad_norm_
from torch_frontend._distributed import device_mesh as device_mesh
from torch_frontend._distributed import init_distributed as init_distributed
from torch_frontend._fully_shard import CPUOffloadPolicy as CPUOffloadPolicy
from torch_frontend._fully_shard import FSDPModule as FSDPModule
from torch_frontend._fully_shard import OffloadPolicy as OffloadPolicy
from torch_frontend._fully_shard import UnshardHandle as UnshardHandle
from torch_frontend._fully_shard import fully_shard as fully_shard
from torch_frontend._fully_shard import register_fsdp_forward_method as register_fsdp_forward_method
from torch_frontend._policy import MixedPrecisionPolicy as MixedPrecisionPolicy
from torch_frontend._state_dict import full_state_dict as full_state_dict
from torch_frontend._state_dict import load_full_state_dict as load_full_state_dict

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "check",
    "clip_grad_norm_",
    "device_mesh",
    "full_state_dict",
    "fully_shard",
    "init_distributed",
    "load_full_state_dict",
    "register_fsdp_forward_method",
    "restore",
    "save",
]
