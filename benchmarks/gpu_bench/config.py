"""The models' shapes, the targets and each part's time budget."""

from __future__ import annotations

import dataclasses

TARGETS = {"funshard / plain JAX": 1.05, "torch_frontend / FSDP2": 1.10, "MFU": 0.35}
# Seconds per part (their sum stays under the 8-minute total with a margin).
BUDGETS = {
    "probe": 40,
    "dlpack": 30,
    "tests": 90,
    "jax-plain": 85,
    "jax-funshard": 95,
    "torch-plain": 35,
    "torch-fsdp2": 40,
    "torch-frontend": 50,
}
TORCH_PARTS = ("torch-plain", "torch-fsdp2", "torch-frontend")
JAX_PARTS = ("jax-plain", "jax-funshard")


@dataclasses.dataclass(frozen=True)
class GPT:
    """A GPT's shape and its global batch (world size 1: all of it on the one device)."""

    blocks: int
    width: int
    heads: int
    vocab: int
    seq: int
    batch: int

    def params(self) -> int:
        d = self.width
        return self.blocks * (12 * d * d + 13 * d) + (2 * self.vocab + self.seq + 2) * d

    def model_flops(self) -> float:
        """Training FLOPs per step: 6 per matmul parameter per token, plus attention
        (12 * blocks * width * seq per token, counted without the causal half)."""
        tokens = self.batch * self.seq
        matmul = self.blocks * 12 * self.width**2 + self.width * self.vocab
        return 6.0 * matmul * tokens + 12.0 * self.blocks * self.width * self.seq * tokens


JAX_GPT = GPT(blocks=18, width=2048, heads=16, vocab=32768, seq=2048, batch=8)  # 1.04B
TORCH_GPT = GPT(blocks=12, width=1024, heads=16, vocab=32768, seq=1024, batch=8)  # 218M
SMOKE_JAX_GPT = GPT(blocks=2, width=64, heads=2, vocab=128, seq=32, batch=4)
SMOKE_TORCH_GPT = GPT(blocks=2, width=64, heads=2, vocab=128, seq=32, batch=4)
