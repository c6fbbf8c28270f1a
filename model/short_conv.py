"""Depthwise causal short convolution that restarts at every document boundary."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .init import Rule, Uniform, reset_
from .ops import dispatch
from .ops.fused import fusable


def _shifts(x: torch.Tensor, segments: torch.Tensor | None, kernel: int):
    """(shift, x[t - shift] for t >= shift, whether that input is in t's document) for shift =
    0 .. kernel - 1: a view of x [B, T - shift, C] and a [B, T - shift, 1] mask in x's dtype (None
    for shift 0 or without segments). Positions before `shift` read nothing: no zero padding, so
    every term is one pass over the tokens that have an input at that shift."""
    T = x.shape[1]
    for shift in range(kernel):
        reach = max(T - shift, 0)  # positions with an input this far back
        mask = None
        if segments is not None and shift:
            mask = (segments[:, shift:] == segments[:, :reach]).unsqueeze(-1).to(x.dtype)
        yield shift, x[:, :reach], mask


def _taps(weight: torch.Tensor) -> torch.Tensor:
    """[C, K] -> [K, C], each tap's channel vector contiguous: a column of the [C, K] weight has
    stride K, and a product with it runs TensorIterator's scalar loop on CPU."""
    return weight.t().contiguous()


def _conv(taps: torch.Tensor, shifts) -> torch.Tensor:
    kernel = taps.shape[0]
    y = None
    for shift, earlier, mask in shifts:
        term = earlier * taps[kernel - 1 - shift]
        if mask is not None:
            term.mul_(mask)
        if y is None:  # shift 0: every position
            y = term
        else:
            y[:, shift:] += term
    return y


def doc_causal_conv1d(x: torch.Tensor, weight: torch.Tensor,
                      segments: torch.Tensor | None) -> torch.Tensor:
    """y[t] = sum_i weight[:, K-1-i] * x[t-i], only over inputs of the same document as t.

    x [B, T, C], weight [C, K], segments [B, T] document ids or None (one document per row).
    Written as K shifted multiply-adds: static shapes, and the masking needs no gather.
    """
    return _conv(_taps(weight), _shifts(x, segments, weight.shape[-1]))


def doc_causal_conv1d_silu_reference(x: torch.Tensor, weight: torch.Tensor,
                                     segments: torch.Tensor | None) -> torch.Tensor:
    """silu(doc_causal_conv1d(...)) in plain torch ops (autograd keeps the shifted inputs, the
    terms and the pre-activation): `doc_causal_conv1d_silu`'s reference."""
    return F.silu(doc_causal_conv1d(x, weight, segments))


class _DocCausalConv1dSiLU(torch.autograd.Function):
    """Saves x, the weight and the document ids and recomputes the convolution in backward.
    Forward and backward each run a registered kernel (model/ops/dispatch.py) where one takes
    the inputs, else the torch forms below."""

    @staticmethod
    def forward(ctx, x, weight, segments):
        ctx.save_for_backward(x, weight, segments)
        out = dispatch.call("conv_silu_forward", x, weight, segments)
        return out if out is not None else _conv_silu_forward(x, weight, segments)

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors  # once: activation checkpointing unpacks each tensor once
        grads = dispatch.call("conv_silu_backward", *saved, grad_out)
        if grads is None:
            grads = _conv_silu_backward(*saved, grad_out)
        return *grads, None


_conv_silu_forward = fusable(doc_causal_conv1d_silu_reference)


@fusable
def _conv_silu_backward(x, weight, segments, grad_out):
    """The gradients of x and the weight, recomputing the convolution."""
    kernel = weight.shape[-1]
    shifts = list(_shifts(x, segments, kernel))  # kept for the weight's gradient
    taps = _taps(weight)
    grad_pre = torch.ops.aten.silu_backward(grad_out, _conv(taps, shifts))
    grad_x, grad_weight = None, []  # grad_weight by shift: column kernel - 1 - shift
    for shift, earlier, mask in shifts:
        grad_term = grad_pre[:, shift:]
        if mask is not None:
            grad_term = grad_term * mask
        grad_weight.append((grad_term * earlier).sum((0, 1)))
        # y[t] read x[t - shift]: x[t] gets y[t + shift]'s gradient.
        from_later = grad_term * taps[kernel - 1 - shift]
        if grad_x is None:
            grad_x = from_later
        else:
            grad_x[:, :from_later.shape[1]] += from_later
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
        reset_(self)

    def init_rules(self) -> dict[str, Rule]:
        bound = 1.0 / math.sqrt(self.weight.shape[-1])  # nn.Conv1d's default, depthwise kernel
        return {"weight": Uniform(-bound, bound)}

    @property
    def width(self) -> int:
        """How many earlier inputs an output reads besides its own: kernel - 1."""
        return self.weight.shape[-1] - 1

    def forward(self, x: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
        if self.halo is None:
            return doc_causal_conv1d_silu(x, self.weight, segments)
        return self.continued(*self.halo(x, segments, self.width))

    def continued(self, x: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
        """The outputs after x's first `width` positions, which hold the inputs before them (a
        context-parallel halo, a decode cache's tail); segments [B, width + T] or None."""
        return doc_causal_conv1d_silu(x, self.weight, segments)[:, self.width:]
