"""Gated activations of the expert and dense MLPs (Eq. 12 of the K3 report)."""

import torch
import torch.nn.functional as F

from .ops import dispatch
from .ops.fused import fusable


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least fp32: low-precision inputs are upcast, fp64 (used by tests) is kept."""
    return torch.promote_types(dtype, torch.float32)


def situ_glu_reference(gate: torch.Tensor, up: torch.Tensor, beta_gate: float = 4.0,
                       beta_up: float = 25.0) -> torch.Tensor:
    """SiTU-GLU in plain torch ops (autograd keeps every intermediate): `situ_glu`'s reference."""
    dtype = _compute_dtype(gate.dtype)
    g = gate.to(dtype)
    u = up.to(dtype)
    capped_gate = beta_gate * torch.tanh(g / beta_gate)
    capped_up = beta_up * torch.tanh(u / beta_up)
    return (capped_gate * torch.sigmoid(g) * capped_up).to(gate.dtype)


class _SiTUGLU(torch.autograd.Function):
    """SiTU-GLU of the two halves of gate_up [..., 2 * width] (gate first), as the MLPs' fused
    projections produce it: its gradient is one tensor too (two would be concatenated by the
    halves' backward). Saves only gate_up (in its own dtype) and recomputes the tanh and
    sigmoid in backward: the plain form keeps five or six fp32 tensors of the activation's size
    for autograd. Forward and backward each run a registered kernel (model/ops/dispatch.py) where
    one takes the inputs, else the torch forms below."""

    @staticmethod
    def forward(ctx, gate_up, beta_gate, beta_up):
        ctx.save_for_backward(gate_up)
        ctx.betas = beta_gate, beta_up
        gate, up = gate_up.chunk(2, dim=-1)
        out = dispatch.call("situ_glu_forward", gate, up, beta_gate, beta_up)
        # Else the reference's ops in its order: unfused, the forward is bitwise the same.
        return out if out is not None else _situ_glu_forward(gate, up, beta_gate, beta_up)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors[0].chunk(2, dim=-1)
        grad = dispatch.call("situ_glu_backward", gate, up, grad_out, *ctx.betas)
        if grad is None:
            grad = torch.cat(_situ_glu_backward(gate, up, grad_out, *ctx.betas), dim=-1)
        return grad, None, None


_situ_glu_forward = fusable(situ_glu_reference, dynamic="rows")


@fusable(dynamic="rows")
def _situ_glu_backward(gate, up, grad_out, beta_gate: float, beta_up: float):
    """The gradients of gate and up, recomputing the tanh and sigmoid."""
    dtype = _compute_dtype(gate.dtype)
    g, u, grad = gate.to(dtype), up.to(dtype), grad_out.to(dtype)
    # In place where a buffer is free: the recomputation is most of this function's time.
    sigmoid_gate = torch.sigmoid(g)
    tanh_gate = torch.tanh(g / beta_gate)
    tanh_up = torch.tanh(u / beta_up)
    grad_sigmoid = grad * sigmoid_gate
    capped_gate = tanh_gate * beta_gate
    # d/dx beta tanh(x / beta) = 1 - tanh^2; d/dx sigmoid = sigmoid (1 - sigmoid).
    grad_up = torch.addcmul(torch.ones((), dtype=dtype), tanh_up, tanh_up, value=-1)
    grad_up.mul_(capped_gate).mul_(grad_sigmoid)
    d_gate = sigmoid_gate.neg_().add_(1).mul_(capped_gate)  # capped_gate (1 - sigmoid)
    d_gate.addcmul_(tanh_gate, tanh_gate, value=-1).add_(1)
    grad_gate = d_gate.mul_(tanh_up).mul_(grad_sigmoid).mul_(beta_up)
    return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


def situ_glu_halves(gate_up: torch.Tensor, beta_gate: float = 4.0,
                    beta_up: float = 25.0) -> torch.Tensor:
    """SiTU-GLU: beta_g tanh(g / beta_g) * sigmoid(g) * beta_u tanh(u / beta_u), of the gate g
    and up u halves of gate_up [..., 2 * width] -> [..., width].

    The tanh soft-caps bound the output by beta_gate * beta_up (100 for K3) whatever the input,
    which is what keeps the expert activations stable; near zero tanh(x / beta) * beta = x, so it
    is SwiGLU to first order. Computed in (at least) fp32, returned in the input dtype; saves
    only its input for backward (`situ_glu_reference` is the plain form).
    """
    return _SiTUGLU.apply(gate_up, beta_gate, beta_up)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta_gate: float = 4.0,
             beta_up: float = 25.0) -> torch.Tensor:
    """situ_glu_halves of gate and up given apart (concatenated first)."""
    return situ_glu_halves(torch.cat([gate, up], dim=-1), beta_gate, beta_up)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU, silu(g) * u: the uncapped activation SiTU-GLU approximates near zero."""
    dtype = _compute_dtype(gate.dtype)
    return (F.silu(gate.to(dtype)) * up.to(dtype)).to(gate.dtype)
