"""The benchmark's GPT in plain PyTorch, and the same model in JAX for funshard's step.

`examples/train_torch.py`'s GPT (`examples/models/torch_gpt.py`, the one source): token
and position embeddings, pre-norm blocks (causal attention, 4x tanh-GELU MLP), final
LayerNorm, untied head. The JAX model (`examples/models/jax_gpt.py`'s blocks) computes
the same function from the same weights (`jax_params` converts a torch model's), so all
variants start from one initialisation and see the same data.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # examples.models: the model's one source

from examples.models import VOCAB  # noqa: E402
from examples.models.torch_gpt import GPT  # noqa: E402

DATA = ROOT / "examples" / "data" / "tinyshakespeare.txt"


@dataclasses.dataclass(frozen=True)
class Config:
    """Model shape and the global batch."""

    blocks: int = 4
    width: int = 1024
    heads: int = 16
    seq: int = 64
    batch: int = 2  # global rows per step, split over the ranks

    def params(self) -> int:
        d = self.width
        block = 12 * d * d + 13 * d  # qkv, proj, up, down with biases; two LayerNorms
        return self.blocks * block + (2 * VOCAB + self.seq + 2) * d + VOCAB


QUICK = Config(blocks=2, width=64, heads=4, seq=16, batch=4)
# Shapes of nanoGPT's small character models (`--preset`): 4 x 128 (0.87M parameters
# here) and shakespeare-char's 6 x 384 (10.9M), at sequence 64 and 8 rows per step.
PRESETS = {
    "gpt-51m": Config(),
    "nano-0.8m": Config(blocks=4, width=128, heads=4, seq=64, batch=8),
    "nano-10.8m": Config(blocks=6, width=384, heads=6, seq=64, batch=8),
    "quick": QUICK,
}


def build(cfg: Config, seed: int = 0) -> GPT:
    """The model with the benchmark's initial weights (the same in every variant)."""
    torch.manual_seed(seed)
    return GPT(width=cfg.width, depth=cfg.blocks, heads=cfg.heads, context=cfg.seq)


def batch_at(index: int, cfg: Config) -> np.ndarray:
    """Global batch `index`: random windows of `seq + 1` bytes of the bundled corpus."""
    data = np.frombuffer(DATA.read_bytes(), dtype=np.uint8)
    starts = np.random.default_rng([7, index]).integers(0, len(data) - cfg.seq - 1, cfg.batch)
    return data[starts[:, None] + np.arange(cfg.seq + 1)].astype(np.int64)


# ------------------------------------------------------------------------------ JAX


def jax_params(model: GPT) -> dict:
    """The torch model's weights as numpy in `jax_gpt`'s layout, matmul weights as `x @ w`."""
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}

    def linear(name):
        return {"w": sd[f"{name}.weight"].T.copy(), "b": sd[f"{name}.bias"]}

    def norm(name):
        return {"g": sd[f"{name}.weight"], "b": sd[f"{name}.bias"]}

    blocks = []
    for i in range(len(model.blocks)):
        p = f"blocks.{i}"
        blocks.append(
            {
                "ln1_g": sd[f"{p}.norm1.weight"],
                "ln1_b": sd[f"{p}.norm1.bias"],
                "qkv": sd[f"{p}.qkv.weight"].T.copy(),
                "qkv_b": sd[f"{p}.qkv.bias"],
                "proj": sd[f"{p}.proj.weight"].T.copy(),
                "proj_b": sd[f"{p}.proj.bias"],
                "ln2_g": sd[f"{p}.norm2.weight"],
                "ln2_b": sd[f"{p}.norm2.bias"],
                "ff1": sd[f"{p}.up.weight"].T.copy(),
                "ff1_b": sd[f"{p}.up.bias"],
                "ff2": sd[f"{p}.down.weight"].T.copy(),
                "ff2_b": sd[f"{p}.down.bias"],
            }
        )
    return {
        "root": {
            "tokens": sd["tokens.weight"],
            "positions": sd["positions.weight"],
            "norm": norm("norm"),
            "head": linear("head"),
        },
        "blocks": blocks,
    }


def jax_loss(cfg: Config, reshard_after_forward: bool = True):
    """`loss(state, tokens)` for `fs.value_and_grad`: one `fs.fully_shard` unit per block.

    The blocks are `jax_gpt`'s (fused attention); the root is the torch model's (a head
    with a bias, and a loss over every position of `tokens[:, :-1]`).
    """
    import jax
    import jax.numpy as jnp

    import funshard as fs
    from examples.models import jax_gpt

    unit = fs.fully_shard(
        jax_gpt.make_block(cfg.heads, fused_attention=True),
        reshard_after_forward=reshard_after_forward,
    )

    def loss_fn(state, tokens):
        root = fs.unshard(state["root"])
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        h = root["tokens"][inputs] + root["positions"][None, : inputs.shape[1]]
        for p in state["blocks"]:
            h = unit(p, h)
        h = jax_gpt.layer_norm(h, root["norm"]["g"], root["norm"]["b"])
        logits = h @ root["head"]["w"] + root["head"]["b"]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    return loss_fn


def nbytes(tensors) -> int:
    """Bytes of the tensors' elements (local shards for sharded models)."""
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def adam_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's tensor state (AdamW's moments)."""
    return nbytes(
        v
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.ndim > 0
    )
