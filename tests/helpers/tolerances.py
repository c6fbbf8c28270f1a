"""Comparison helpers (DESIGN.md section 5: relative RMS error, fla's convention)."""

import torch


def rel_rms(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref = ref.detach().double()
    x = x.detach().double()
    denom = ref.norm()
    if denom == 0:
        return float((ref - x).norm())
    return float((ref - x).norm() / denom)


def assert_close_rms(ref: torch.Tensor, x: torch.Tensor, tol: float, what: str = "") -> None:
    assert ref.shape == x.shape, f"{what}: shape {tuple(x.shape)} != {tuple(ref.shape)}"
    err = rel_rms(ref, x)
    assert err <= tol, f"{what}: relative RMS error {err:.3e} > {tol:.1e}"
