"""Normalisation layers shared by the language model and the vision encoder."""

import torch
from torch import nn

from model.dtypes import widen


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 (or wider) and cast back to the input dtype."""
    wide = widen(x)
    y = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * widen(weight)
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
