"""Per-step figures read from the model after a step (one host sync per step, off the hot path)."""

from __future__ import annotations

import resource
import sys

import torch

from model.k3 import K3Model


def moe_stats(model: K3Model) -> dict[str, float]:
    """Expert load CV and max/mean per MoE layer (of the last balanced step) and the QB bias
    range, as floats for logging."""
    layers = [m for m in model.moe_layers() if m.balancer is not None]
    if not layers:
        return {}
    cv = torch.stack([m.balancer.load_stats()["load_cv"] for m in layers]).float().cpu()
    mx = torch.stack([m.balancer.load_stats()["load_max_over_mean"] for m in layers]).float().cpu()
    bias = torch.stack([m.balancer.bias for m in layers]).float().cpu()
    row = {"moe/cv_mean": float(cv.mean()), "moe/cv_max": float(cv.max()),
           "moe/max_over_mean_max": float(mx.max()),
           "moe/bias_min": float(bias.min()), "moe/bias_max": float(bias.max())}
    for i, layer in model.layers.items():
        if layer.mlp in layers:
            j = layers.index(layer.mlp)
            row[f"moe/layer{i}/cv"] = float(cv[j])
            row[f"moe/layer{i}/max_over_mean"] = float(mx[j])
    return row


def merge_stage_figures(rows: list[dict[str, float]]) -> dict[str, float]:
    """`moe_stats` and QK-Clip rows of the pipeline stages (each of its own layers) as the whole
    model's: per-layer figures side by side, extremes over the stages, clipped heads summed and
    the mean CV over every MoE layer."""
    out: dict[str, float] = {}
    for row in rows:
        for key, value in row.items():
            if key not in out:  # per-layer figures: one stage each
                out[key] = value
            elif key == "moe/bias_min":
                out[key] = min(out[key], value)
            elif key == "attn/clipped_heads":
                out[key] += value
            else:
                out[key] = max(out[key], value)
    cvs = [v for k, v in out.items() if k.startswith("moe/layer") and k.endswith("/cv")]
    if cvs:
        out["moe/cv_mean"] = sum(cvs) / len(cvs)
    return out


def peak_memory_gb(device: torch.device) -> float:
    """Peak device memory on CUDA; the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20
