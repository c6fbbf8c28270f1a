"""Block Attention Residuals (SPEC 4): a learned softmax over earlier blocks replaces the plain
residual sum.

Each mix has a pseudo-query w (a d -> 1 linear, no bias, zero-initialised) and its own RMSNorm.
Keys are the normalised sources, values the raw ones, no temperature, all in fp32. With
zero-initialised queries every source gets the same weight at the first step.
"""

from __future__ import annotations

import torch
from torch import nn

from .norms import rms_norm


class DepthMix(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(dim))
        self.norm_weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        values = torch.stack([s.float() for s in sources])  # [n, ..., d]
        keys = rms_norm(values, self.norm_weight, self.eps)
        weights = torch.softmax(keys @ self.query.float(), dim=0)  # [n, ...]
        mixed = (weights.unsqueeze(-1) * values).sum(0)
        return mixed.to(sources[-1].dtype)


class BlockState:
    """The AttnRes bookkeeping of one forward pass: completed blocks and the running partial sum.

    Block size counts decoder layers (K3: 12), not sublayers. Layer 0 pushes the embedding as
    block 0; every `block_size` layers the partial sum becomes a completed block.
    """

    def __init__(self, embedding: torch.Tensor, block_size: int):
        self.blocks: list[torch.Tensor] = []
        self.partial: torch.Tensor | None = embedding
        self.block_size = block_size

    def before_attention(self, layer: int, mix: DepthMix | None) -> torch.Tensor:
        h = mix(self.blocks + [self.partial]) if self.blocks else self.partial
        if layer % self.block_size == 0:
            self.blocks.append(self.partial)
            self.partial = None
        return h

    def add(self, out: torch.Tensor) -> None:
        self.partial = out if self.partial is None else self.partial + out

    def mix(self, mix: DepthMix) -> torch.Tensor:
        return mix(self.blocks + [self.partial])
