"""Learning-rate schedules: linear warmup, then cosine or WSD (warmup-stable-decay) decay."""

from __future__ import annotations

import math


def lr_at(step: int, *, peak_lr: float, total_steps: int, warmup_steps: int,
          schedule: str = "cosine", min_lr_ratio: float = 0.1,
          decay_fraction: float = 0.2) -> float:
    """lr for the update that follows `step` completed updates (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    min_lr = peak_lr * min_lr_ratio
    if schedule == "constant":
        return peak_lr
    if schedule == "cosine":
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr + 0.5 * (peak_lr - min_lr) * (1 + math.cos(math.pi * progress))
    if schedule == "wsd":
        decay_steps = max(1, int(total_steps * decay_fraction))
        decay_start = total_steps - decay_steps
        if step < decay_start:
            return peak_lr
        progress = min(1.0, (step - decay_start) / decay_steps)
        return peak_lr - (peak_lr - min_lr) * progress
    raise ValueError(f"optim.schedule={schedule!r}: must be one of cosine, wsd, constant")
