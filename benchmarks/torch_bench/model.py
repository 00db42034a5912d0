"""The benchmark's GPT in plain PyTorch, and the same model in JAX for funshard's step.

A byte-level GPT of `examples/train_torch.py`'s family: token and position embeddings,
pre-norm blocks (causal attention, 4x tanh-GELU MLP), final LayerNorm, untied head. The
JAX model computes the same function from the same weights (`jax_params` converts a
torch model's), so all variants start from one initialisation and see the same data.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256
DATA = Path(__file__).resolve().parents[2] / "examples" / "data" / "tinyshakespeare.txt"


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


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.norm2 = nn.LayerNorm(cfg.width)
        self.up = nn.Linear(cfg.width, 4 * cfg.width)
        self.down = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Embeddings, blocks, final norm, head; `forward(inputs, targets)` is the mean loss."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, cfg.width)
        self.positions = nn.Embedding(cfg.seq, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.blocks))
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, VOCAB)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.tokens(inputs) + self.positions(torch.arange(inputs.shape[1]))
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def build(cfg: Config, seed: int = 0) -> GPT:
    """The model with the benchmark's initial weights (the same in every variant)."""
    torch.manual_seed(seed)
    return GPT(cfg)


def batch_at(index: int, cfg: Config) -> np.ndarray:
    """Global batch `index`: random windows of `seq + 1` bytes of the bundled corpus."""
    data = np.frombuffer(DATA.read_bytes(), dtype=np.uint8)
    starts = np.random.default_rng([7, index]).integers(0, len(data) - cfg.seq - 1, cfg.batch)
    return data[starts[:, None] + np.arange(cfg.seq + 1)].astype(np.int64)


# ------------------------------------------------------------------------------ JAX


def jax_params(model: GPT) -> dict:
    """The torch model's weights as numpy, matmul weights transposed to `x @ w`."""
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}

    def linear(name):
        return {"w": sd[f"{name}.weight"].T.copy(), "b": sd[f"{name}.bias"]}

    def norm(name):
        return {"g": sd[f"{name}.weight"], "b": sd[f"{name}.bias"]}

    blocks = []
    for i in range(len(model.blocks)):
        p = f"blocks.{i}"
        blocks.append({"norm1": norm(f"{p}.norm1"), "qkv": linear(f"{p}.qkv"),
                       "proj": linear(f"{p}.proj"), "norm2": norm(f"{p}.norm2"),
                       "up": linear(f"{p}.up"), "down": linear(f"{p}.down")})
    return {"root": {"tokens": sd["tokens.weight"], "positions": sd["positions.weight"],
                     "norm": norm("norm"), "head": linear("head")},
            "blocks": blocks}


def jax_loss(cfg: Config, reshard_after_forward: bool = True):
    """`loss(state, tokens)` for `fs.value_and_grad`: one `fs.fully_shard` unit per block."""
    import jax
    import jax.numpy as jnp

    import funshard as fs

    def layer_norm(x, p):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["b"]

    def dense(x, p):
        return x @ p["w"] + p["b"]

    def block(p, x):
        b, t, d = x.shape
        hd = d // cfg.heads
        qkv = dense(layer_norm(x, p["norm1"]), p["qkv"]).reshape(b, t, 3, cfg.heads, hd)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + dense(attended.reshape(b, t, d), p["proj"])
        up = jax.nn.gelu(dense(layer_norm(x, p["norm2"]), p["up"]), approximate=True)
        return x + dense(up, p["down"])

    unit = fs.fully_shard(block, reshard_after_forward=reshard_after_forward)

    def loss_fn(state, tokens):
        root = fs.unshard(state["root"])
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        h = root["tokens"][inputs] + root["positions"][None, : inputs.shape[1]]
        for p in state["blocks"]:
            h = unit(p, h)
        logits = dense(layer_norm(h, root["norm"]), root["head"])
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
    return nbytes(v for s in opt.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.ndim > 0)
