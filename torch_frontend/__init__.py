"""PyTorch frontend: FSDP2's `fully_shard` on the funshard core, collectives through JAX.

    from torch_frontend import fully_shard, MixedPrecisionPolicy, init_distributed

    mesh = init_distributed()          # torchrun's environment; no environment: 1 process
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)

See docs/torch.md.
"""

from torch_frontend._distributed import init_distributed as init_distributed
from torch_frontend._fully_shard import FSDPModule as FSDPModule
from torch_frontend._fully_shard import UnshardHandle as UnshardHandle
from torch_frontend._fully_shard import fully_shard as fully_shard
from torch_frontend._fully_shard import register_fsdp_forward_method as register_fsdp_forward_method
from torch_frontend._policy import MixedPrecisionPolicy as MixedPrecisionPolicy

__all__ = [
    "FSDPModule",
    "MixedPrecisionPolicy",
    "UnshardHandle",
    "fully_shard",
    "init_distributed",
    "register_fsdp_forward_method",
]
