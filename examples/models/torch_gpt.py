"""The GPT in plain PyTorch: `examples/train_torch.py`'s, the torch benchmarks'.

Module names (`tokens`, `positions`, `blocks.{i}.qkv`, ..., `norm`, `head`) are the
state-dict keys the benchmarks convert to JAX (`benchmarks/torch_bench/model.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import VOCAB


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (b, heads, t, head_dim)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        # The JAX and Flax twins' jax.nn.gelu is the tanh approximation.
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Token and position embeddings, `depth` blocks, final norm and head.

    Args:
      width, depth, heads, context: the model's shape (`context`: the most positions).
      vocab: the number of tokens (bytes by default).
      zero_biases: GPT-2's initialisation, normal(0.02) weights and zero biases; False
        keeps torch's default biases (`benchmarks/gpu_check.py`'s model).
    """

    def __init__(
        self,
        *,
        width: int,
        depth: int,
        heads: int,
        context: int,
        vocab: int = VOCAB,
        zero_biases: bool = True,
    ):
        super().__init__()
        self.vocab = vocab
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if zero_biases and isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits `(batch, time, vocab)`, or with `targets` their mean loss."""
        positions = torch.arange(tokens.shape[-1], device=tokens.device)
        h = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        if targets is None:
            return logits
        # The loss inside forward: the root's output is then a scalar, not a view of
        # the logits (in-place ops on a view would skip FSDP's pre-backward hook).
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))
