"""MX quantisation-aware training for the routed experts.

Forward runs on fake-quantised tensors (MXFP4 expert weights, MXFP8 GEMM inputs, blocks of 32
along the reduction dimension, which is the last dimension of w1 [E, 2I, L], w2 [E, L, I] and of
the GEMM inputs [M, L] / [M, I]); backward passes the gradient straight through to the
high-precision tensor (STE). The grouped-experts module exposes two seams, `weight_fake_quant`
and `input_fake_quant`; `apply_mx_qat` fills them. Everything else stays high precision.
"""

from __future__ import annotations

import torch
from torch import nn

from train.precision.mx import fake_quantize_mx


class _StraightThroughFakeQuant(torch.autograd.Function):
    """Forward: the exact fake-quantised tensor. Backward: the incoming gradient, unchanged.
    (A Function rather than the detach trick, whose forward x + (q - x) is not bit-exact q.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fmt: str, block_size: int,
                scale_mode: str) -> torch.Tensor:
        return fake_quantize_mx(x, fmt, block_size, scale_mode)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None, None


class MXFakeQuant(nn.Module):
    """STE fake quantiser for one MX format, blocks along the last dimension. A parameter-free
    module, so it can replace a seam that holds None, a function or a child module."""

    def __init__(self, fmt: str, block_size: int = 32, scale_mode: str = "floor"):
        super().__init__()
        fake_quantize_mx(torch.zeros(block_size), fmt, block_size, scale_mode)  # validates
        self.fmt = fmt
        self.block_size = block_size
        self.scale_mode = scale_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _StraightThroughFakeQuant.apply(x, self.fmt, self.block_size, self.scale_mode)

    def extra_repr(self) -> str:
        return f"fmt={self.fmt!r}, block_size={self.block_size}, scale_mode={self.scale_mode!r}"


mxfp4_weight_fake_quant = MXFakeQuant("e2m1")
mxfp8_input_fake_quant = MXFakeQuant("e4m3")


def apply_mx_qat(model: nn.Module, scale_mode: str = "floor") -> int:
    """Sets MXFP4 weight / MXFP8 input fake quantisers (scale exponent rounding `scale_mode`,
    config precision.qat_scale_mode) on every module that has both seams (`weight_fake_quant`
    and `input_fake_quant`); returns how many modules it set."""
    weight_quant = MXFakeQuant("e2m1", scale_mode=scale_mode)
    input_quant = MXFakeQuant("e4m3", scale_mode=scale_mode)
    # Collected first: assigning a module registers a child, which must not happen mid-walk.
    seams = [module for module in model.modules()
             if hasattr(module, "weight_fake_quant") and hasattr(module, "input_fake_quant")]
    for module in seams:
        module.weight_fake_quant = weight_quant
        module.input_fake_quant = input_quant
    return len(seams)
