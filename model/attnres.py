"""Block Attention Residuals: a learned softmax over earlier blocks replaces the plain
residual sum.

Each mix has a pseudo-query w (a d -> 1 linear, no bias, zero-initialised) and its own RMSNorm.
Keys are the normalised sources, values the raw ones, no temperature, all in fp32. With
zero-initialised queries every source gets the same weight at the first step.
"""

from __future__ import annotations

import torch
from torch import nn

from .dtypes import upcast
from .init import ONES, ZEROS, Rule, reset_
from .norms import rms_norm_reference
from .ops import dispatch
from .ops.fused import fusable


def depth_mix_reference(sources: list[torch.Tensor], query: torch.Tensor,
                        norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The depth mix in plain torch ops (autograd keeps the stacked values and the keys):
    `depth_mix`'s reference."""
    values = torch.stack([upcast(s) for s in sources])  # [n, ..., d]
    keys = rms_norm_reference(values, norm_weight, eps)
    weights = torch.softmax(keys @ query.to(keys.dtype), dim=0)  # [n, ...]
    mixed = (weights.unsqueeze(-1) * values).sum(0)
    return mixed.to(sources[-1].dtype)


class _DepthMix(torch.autograd.Function):
    """Saves the sources themselves (the blocks stay alive for later mixes anyway), the weights
    and each source row's 1 / rms, and stacks the values again in backward: the plain form keeps
    the stacked values and the normalised keys, two fp32 tensors [n, ..., d] per mix. Forward
    and backward each run a registered kernel (model/ops/dispatch.py; it may read the sources in
    place) where one takes the inputs, else the torch forms below on the stacked values."""

    @staticmethod
    def forward(ctx, query, norm_weight, eps, *sources):
        out = dispatch.call("depth_mix_forward", sources, query, norm_weight, eps)
        if out is None:
            values = torch.stack([upcast(s) for s in sources])
            out = _depth_mix_forward(values, query, norm_weight, eps)
        mixed, weights, rstd = out
        ctx.save_for_backward(query, norm_weight, weights, rstd, *sources)
        return mixed.to(sources[-1].dtype)

    @staticmethod
    def backward(ctx, grad):
        query, norm_weight, weights, rstd, *sources = ctx.saved_tensors
        grads = dispatch.call("depth_mix_backward", sources, query, norm_weight, weights, rstd,
                              grad)
        if grads is None:
            values = torch.stack([upcast(s) for s in sources])
            grads = _depth_mix_backward(values, query, norm_weight, weights, rstd, grad)
        dvalues, dquery, dweight = grads
        return (dquery.to(query.dtype), dweight.to(norm_weight.dtype), None,
                *(d.to(s.dtype) for d, s in zip(dvalues.unbind(0), sources)))


@fusable(dynamic="dim0")
def _depth_mix_forward(values, query, norm_weight, eps: float):
    """(mixed, weights, 1 / rms per source row): the reference's ops in its order (unfused, the
    mix is bitwise the same)."""
    rstd = torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
    keys = values * rstd * norm_weight.to(values.dtype)
    weights = torch.softmax(keys @ query.to(values.dtype), dim=0)
    mixed = (weights.unsqueeze(-1) * values).sum(0)
    return mixed, weights, rstd


@fusable(dynamic="dim0")
def _depth_mix_backward(values, query, norm_weight, weights, rstd, grad):
    """Gradients of the stacked values, the query and the norm weight. The logits are
    x_hat . u with x_hat = values / rms and u = norm_weight * query, so the norm's backward
    needs no keys: mean(dx_hat x_hat) = dlogits (x_hat . u) / d for dx_hat = dlogits u."""
    grad = grad.to(values.dtype)
    u = norm_weight.to(values.dtype) * query.to(values.dtype)
    dweights = (values * grad).sum(-1)  # [n, ...]
    dlogits = weights * (dweights - (weights * dweights).sum(0, keepdim=True))
    x_hat = values * rstd
    logits = (x_hat * u).sum(-1, keepdim=True)
    dlogits = dlogits.unsqueeze(-1)
    dvalues = weights.unsqueeze(-1) * grad + rstd * dlogits * (
        u - x_hat * (logits / values.shape[-1]))
    # du = sum over sources and rows of dlogits x_hat, as a matmul over the token rows: BLAS's
    # blocked sums keep the cancellation in it to the reference's accuracy, a compiled
    # reduction's running sum did not (2x its error).
    du = ((rstd * dlogits).mT @ values).sum(tuple(range(values.dim() - 1)))
    return dvalues, du * norm_weight.to(du.dtype), du * query.to(du.dtype)


def depth_mix(sources: list[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor,
              eps: float) -> torch.Tensor:
    """softmax over the sources of (RMSNorm(source) . query), mixing the raw sources, in fp32
    (float64 for float64 sources); saves what `_DepthMix` says (`depth_mix_reference` is the
    plain form)."""
    return _DepthMix.apply(query, norm_weight, eps, *sources)


class DepthMix(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(dim))
        self.norm_weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        reset_(self)

    def init_rules(self) -> dict[str, Rule]:
        return {"query": ZEROS, "norm_weight": ONES}

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        return depth_mix(sources, self.query, self.norm_weight, self.eps)


class BlockState:
    """The AttnRes bookkeeping of one forward pass: completed blocks and the running partial sum.

    Block size counts decoder layers (K3: 12), not sublayers. Layer 0 pushes the embedding as
    block 0; every `block_size` layers the partial sum becomes a completed block. A layer takes
    `blocks` (a snapshot tuple) and `partial` and returns the new partial, so that a whole
    layer, its depth mixes included, is one function of tensors (activation checkpointing,
    pipeline stages).
    """

    def __init__(self, embedding: torch.Tensor, block_size: int):
        self.blocks: list[torch.Tensor] = []
        self.partial: torch.Tensor | None = embedding
        self.block_size = block_size

    def start_layer(self, layer: int) -> None:
        """Completes a block before every block_size-th layer (layer 0: the embedding)."""
        if layer % self.block_size == 0:
            self.blocks.append(self.partial)
            self.partial = None

    def sources(self) -> list[torch.Tensor]:
        """Completed blocks, then the partial sum if the current block has one."""
        return self.blocks + ([] if self.partial is None else [self.partial])
