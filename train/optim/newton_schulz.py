"""Newton-Schulz orthogonalisation of a batch of matrices.

Each matrix G is mapped to roughly U V^T (G = U S V^T): its singular values are pushed into
about [0.5, 1.5] by five steps of a quintic polynomial whose coefficients maximise the slope at
zero (Keller Jordan's Muon). The arithmetic follows torch.optim.Muon step for step, so that in
bf16 a batch gives the same bits as torch's per-matrix function on each of its matrices.
"""

from __future__ import annotations

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7  # floor of the Frobenius norm, torch's value


def default_ns_dtype(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.dtype:
    """bf16 where matmuls are fast in it (CUDA), fp32 elsewhere (CPU, where bf16 is slow);
    float64 matrices (precision=fp64) stay float64."""
    if dtype == torch.float64:
        return dtype
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def newton_schulz(
    x: torch.Tensor, steps: int = 5, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Orthogonalise every matrix of x [..., m, n] independently; returns `dtype` (default by
    device), same shape. Each matrix is normalised by its own Frobenius norm."""
    if x.ndim < 2:
        raise ValueError(f"newton_schulz needs matrices [..., m, n], got shape {tuple(x.shape)}")
    a, b, c = NS_COEFFICIENTS
    shape = x.shape
    # Contiguous batches give the same bits as separate matrices (strided inputs do not).
    y = x.to(dtype or default_ns_dtype(x.device, x.dtype)).reshape(-1, *shape[-2:]).contiguous()
    transposed = shape[-2] > shape[-1]
    if transposed:  # iterate on the short side: the Gram matrix is min(m, n) square
        y = y.mT
    y = y / torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    for _ in range(steps):
        gram = y @ y.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        y = torch.baddbmm(y, poly, y, beta=a)  # a X + (b A + c A^2) X
    if transposed:
        y = y.mT
    return y.reshape(shape)
