"""Normalisation layers shared by the language model and the vision encoder."""

import torch
from torch import nn

from .dtypes import upcast
from .init import ONES, Rule, reset_
from .ops import dispatch
from .ops.fused import fusable


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in plain torch ops (autograd keeps every intermediate): `rms_norm`'s reference."""
    x32 = upcast(x)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(x32.dtype)
    return y.to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    """Saves x (in its own dtype), the weight and the per-row 1 / rms (1 / dim of x's bytes)
    and recomputes the normalised x in backward: the plain form keeps x upcast, x^2 and the
    normalised x for autograd, fp32 copies of x's size for a bf16 x. Forward and backward each
    run a registered kernel (model/ops/dispatch.py) where one takes the inputs, else the torch
    forms below."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = (dispatch.call("rms_norm_forward", x, weight, eps)
                   or _rms_norm_forward(x, weight, eps))
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        need_weight = weight is not None and ctx.needs_input_grad[1]
        grad_x, grad_weight = (
            dispatch.call("rms_norm_backward", x, weight, rstd, grad_out, need_weight)
            or _rms_norm_backward(x, weight, rstd, grad_out, need_weight))
        return grad_x, grad_weight, None


@fusable(dynamic="rows")
def _rms_norm_forward(x, weight, eps: float):
    """(y, 1 / rms per row); the reference's ops in its order: unfused, y is bitwise the same."""
    x32 = upcast(x)
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    y = x32 * rstd
    if weight is not None:
        y = y * weight.to(x32.dtype)
    return y.to(x.dtype), rstd


@fusable(dynamic="rows")
def _rms_norm_backward(x, weight, rstd, grad_out, need_weight: bool):
    x_hat = upcast(x) * rstd
    grad = grad_out.to(x_hat.dtype)
    grad_weight = None
    if weight is not None:
        if need_weight:
            rows = tuple(range(grad.dim() - 1))
            grad_weight = (grad * x_hat).sum(rows).to(weight.dtype)
        grad = grad * weight.to(x_hat.dtype)
    # d x_hat / dx: rstd (g - x_hat mean(g x_hat)), the projection off x's direction.
    grad_x = rstd * (grad - x_hat * (grad * x_hat).mean(-1, keepdim=True))
    return grad_x.to(x.dtype), grad_weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 (float64 for float64 input) and cast back to the input dtype;
    saves only x, the weight and 1 / rms for backward (`rms_norm_reference` is the plain form)."""
    return _RMSNorm.apply(x, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        reset_(self)

    def init_rules(self) -> dict[str, Rule]:
        return {"weight": ONES}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
