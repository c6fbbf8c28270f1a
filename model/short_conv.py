"""Depthwise causal short convolution that restarts at every document boundary."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .ops.fused import fusable


def _same_document(segments: torch.Tensor, shift: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, 1]: 1 where position t - shift exists and is in t's document, else 0."""
    prev = F.pad(segments, (shift, 0), value=-1)[:, : segments.shape[1]]
    return (prev == segments).unsqueeze(-1).to(dtype)


def _shifted(x: torch.Tensor, shift: int) -> torch.Tensor:
    """x[t - shift] at t (zeros before the start)."""
    return F.pad(x, (0, 0, shift, 0))[:, : x.shape[1]]


def _shifts(x: torch.Tensor, segments: torch.Tensor | None, kernel: int):
    """(shift, x[t - shift], its same-document mask or None) for shift = 0 .. kernel - 1."""
    yield 0, x, None
    for shift in range(1, kernel):
        mask = None if segments is None else _same_document(segments, shift, x.dtype)
        yield shift, _shifted(x, shift), mask


def _conv(weight: torch.Tensor, shifts) -> torch.Tensor:
    kernel = weight.shape[-1]
    y = None
    for shift, shifted, mask in shifts:
        term = shifted * weight[:, kernel - 1 - shift]
        if mask is not None:
            term = term * mask
        y = term if y is None else y + term
    return y


def doc_causal_conv1d(x: torch.Tensor, weight: torch.Tensor,
                      segments: torch.Tensor | None) -> torch.Tensor:
    """y[t] = sum_i weight[:, K-1-i] * x[t-i], only over inputs of the same document as t.

    x [B, T, C], weight [C, K], segments [B, T] document ids or None (one document per row).
    Written as K shifted multiply-adds: static shapes, and the masking needs no gather.
    """
    return _conv(weight, _shifts(x, segments, weight.shape[-1]))


def doc_causal_conv1d_silu_reference(x: torch.Tensor, weight: torch.Tensor,
                                     segments: torch.Tensor | None) -> torch.Tensor:
    """silu(doc_causal_conv1d(...)) in plain torch ops (autograd keeps the shifted inputs, the
    terms and the pre-activation): `doc_causal_conv1d_silu`'s reference."""
    return F.silu(doc_causal_conv1d(x, weight, segments))


class _DocCausalConv1dSiLU(torch.autograd.Function):
    """Saves x, the weight and the document ids and recomputes the convolution in backward."""

    @staticmethod
    def forward(ctx, x, weight, segments):
        ctx.save_for_backward(x, weight, segments)
        return _conv_silu_forward(x, weight, segments)

    @staticmethod
    def backward(ctx, grad_out):
        return *_conv_silu_backward(*ctx.saved_tensors, grad_out), None


_conv_silu_forward = fusable(doc_causal_conv1d_silu_reference)


@fusable
def _conv_silu_backward(x, weight, segments, grad_out):
    """The gradients of x and the weight, recomputing the convolution."""
    kernel = weight.shape[-1]
    shifts = list(_shifts(x, segments, kernel))  # kept for the weight's gradient
    grad_pre = torch.ops.aten.silu_backward(grad_out, _conv(weight, shifts))
    grad_x, grad_weight = None, []  # grad_weight by shift: column kernel - 1 - shift
    for shift, shifted, mask in shifts:
        grad_term = grad_pre if mask is None else grad_pre * mask
        grad_weight.append((grad_term * shifted).sum((0, 1)))
        # y[t] read x[t - shift]: x[t] gets y[t + shift]'s gradient.
        from_later = grad_term[:, shift:] * weight[:, kernel - 1 - shift]
        if grad_x is None:
            grad_x = from_later
        else:
            grad_x[:, :-shift] += from_later
    grad_weight = torch.stack(grad_weight[::-1], dim=-1)
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


def doc_causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor,
                           segments: torch.Tensor | None) -> torch.Tensor:
    """silu(doc_causal_conv1d(x, weight, segments)), saving only x, the weight and the ids."""
    return _DocCausalConv1dSiLU.apply(x, weight, segments)


class ShortConv(nn.Module):
    """Depthwise causal conv1d (no bias) followed by SiLU, as in the KDA q/k/v paths."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel))  # [channels, K]: shards by row
        # Context-parallel seam (filled from parallel/): halo(x, segments, width) prepends the
        # `width` inputs before this fragment and returns (inputs, segments) over both.
        self.halo = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.weight.shape[-1])  # nn.Conv1d's default, depthwise kernel
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
        if self.halo is None:
            return doc_causal_conv1d_silu(x, self.weight, segments)
        width = self.weight.shape[-1] - 1
        x, segments = self.halo(x, segments, width)
        return doc_causal_conv1d_silu(x, self.weight, segments)[:, width:]
