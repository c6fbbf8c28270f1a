"""Activation checkpointing applied from outside: each decoder sublayer (attention, MLP/MoE)
keeps only its input and recomputes the rest in backward.

Implemented by replacing the sublayers' `forward` on the instance, so parameter names (and so
checkpoints and optimizer groups) are the same with and without it. The recomputation must not
feed Quantile Balancing a second time: the recompute context pauses the layer's balancer.
"""

from __future__ import annotations

import contextlib
import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from model.k3 import K3Model
from model.moe import LatentMoE


def _balancers(module: nn.Module) -> list:
    return [m.balancer for m in module.modules()
            if isinstance(m, LatentMoE) and m.balancer is not None]


@contextlib.contextmanager
def _paused(balancers):
    for b in balancers:
        b.accumulating = False
    try:
        yield
    finally:
        for b in balancers:
            b.accumulating = True


def _checkpointed(module: nn.Module) -> None:
    inner = module.forward
    balancers = _balancers(module)

    def contexts():
        return contextlib.nullcontext(), _paused(balancers)

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    module.forward = forward


def apply_activation_checkpointing(model: K3Model) -> int:
    """Checkpoints every decoder layer's attention and MLP; returns the number of sublayers."""
    count = 0
    for layer in model.layers:
        for sub in (layer.attn, layer.mlp):
            _checkpointed(sub)
            count += 1
    return count
