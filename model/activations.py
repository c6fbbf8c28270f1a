"""Gated activations of the expert and dense MLPs (SPEC 5, Eq. 12)."""

import torch
import torch.nn.functional as F


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least fp32: low-precision inputs are upcast, fp64 (used by tests) is kept."""
    return torch.promote_types(dtype, torch.float32)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta_gate: float = 4.0,
             beta_up: float = 25.0) -> torch.Tensor:
    """SiTU-GLU: beta_g tanh(g / beta_g) * sigmoid(g) * beta_u tanh(u / beta_u).

    The tanh soft-caps bound the output by beta_gate * beta_up (100 for K3) whatever the input,
    which is what keeps the expert activations stable; near zero tanh(x / beta) * beta = x, so it
    is SwiGLU to first order. Computed in (at least) fp32, returned in the input dtype.
    """
    dtype = _compute_dtype(gate.dtype)
    g = gate.to(dtype)
    u = up.to(dtype)
    capped_gate = beta_gate * torch.tanh(g / beta_gate)
    capped_up = beta_up * torch.tanh(u / beta_up)
    return (capped_gate * torch.sigmoid(g) * capped_up).to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU, silu(g) * u: the uncapped activation SiTU-GLU approximates near zero."""
    dtype = _compute_dtype(gate.dtype)
    return (F.silu(gate.to(dtype)) * up.to(dtype)).to(gate.dtype)
