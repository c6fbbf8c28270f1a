"""The dtype the numerically sensitive parts compute in (norms, gates, KDA, attention, AttnRes):
fp32 for bf16/fp16/fp32 models, and fp64 kept for the float64 runs that tests use to compare
parallel layouts exactly (a cast to fp32 there turns a different summation order's 1e-16 into
1e-7 noise)."""

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def widen(x: torch.Tensor) -> torch.Tensor:
    """x in compute_dtype(x.dtype): at least fp32."""
    return x.to(compute_dtype(x.dtype))
