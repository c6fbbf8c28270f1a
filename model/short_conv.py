"""Depthwise causal short convolution that restarts at every document boundary."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def doc_causal_conv1d(x: torch.Tensor, weight: torch.Tensor,
                      segments: torch.Tensor | None) -> torch.Tensor:
    """y[t] = sum_i weight[:, K-1-i] * x[t-i], only over inputs of the same document as t.

    x [B, T, C], weight [C, K], segments [B, T] document ids or None (one document per row).
    Written as K shifted multiply-adds: static shapes, and the masking needs no gather.
    """
    kernel = weight.shape[-1]
    y = x * weight[:, kernel - 1]
    for shift in range(1, kernel):
        shifted = F.pad(x, (0, 0, shift, 0))[:, : x.shape[1]]
        term = shifted * weight[:, kernel - 1 - shift]
        if segments is not None:
            prev = F.pad(segments, (shift, 0), value=-1)[:, : x.shape[1]]
            term = term * (prev == segments).unsqueeze(-1).to(x.dtype)
        y = y + term
    return y


class ShortConv(nn.Module):
    """Depthwise causal conv1d (no bias) followed by SiLU, as in the KDA q/k/v paths."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel))  # [channels, K]: shards by row
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.weight.shape[-1])  # nn.Conv1d's default, depthwise kernel
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
        return F.silu(doc_causal_conv1d(x, self.weight, segments))
