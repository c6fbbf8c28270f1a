"""The device peak used for MFU, and the model FLOPs it divides (counted in model.flops,
re-exported here for the training loop and `k3-plan`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from model.flops import (
    attention_flops_per_token,
    forward_flops_per_token,
    head_forward_flops_per_token,
    layer_forward_flops_per_token,
    training_flops_per_token,
    vision_forward_flops,
    vision_training_flops,
)

__all__ = ["PeakFlops", "attention_flops_per_token", "forward_flops_per_token",
           "head_forward_flops_per_token", "layer_forward_flops_per_token",
           "training_flops_per_token", "vision_forward_flops", "vision_training_flops"]


# Dense bf16 tensor-core peaks (FLOP/s) of common training GPUs, by device-name substring.
_GPU_PEAKS = {"H200": 989e12, "H100": 989e12, "GH200": 989e12, "B200": 2250e12, "A100": 312e12,
              "L40S": 362e12, "A10": 125e12}


@dataclass
class PeakFlops:
    flops: float
    source: str  # how the peak was obtained: shown next to MFU

    @staticmethod
    def measure(device: torch.device, seconds: float = 0.6) -> PeakFlops:
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            for key, peak in _GPU_PEAKS.items():
                if key in name:
                    return PeakFlops(peak, f"{key} bf16 peak")
        return PeakFlops(_matmul_probe(device, seconds), f"{device.type} matmul probe")


def _matmul_probe(device: torch.device, seconds: float, n: int = 512, windows: int = 3) -> float:
    """Achieved fp32 matmul FLOP/s of this process: the CPU has no datasheet peak to divide by.
    The best of `windows` timed windows: another process that takes a core for a moment slows
    one window, not the peak."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a @ b  # warm-up
    best = 0.0
    for _ in range(windows):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / windows:
            a @ b
            count += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 2 * n**3 * count / (time.perf_counter() - start))
    return best
