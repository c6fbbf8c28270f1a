"""Activation checkpointing of each whole decoder layer, and torch.compile of each decoder
sublayer (attention, MLP/MoE), applied from outside.

Both replace a module's `forward` on the instance, so parameter names (and so checkpoints and
optimizer groups) are the same with and without them. A checkpointed layer keeps only its
inputs (the AttnRes blocks and partial sum it was given, which the model holds anyway) and
recomputes the rest in backward, its two depth mixes included: those stack fp32 copies of all
their sources, the largest activations of a layer. The recomputation runs under the same
autocast (torch and Transformer Engine) as the forward, and must not feed Quantile Balancing a
second time, so the recompute context pauses the layer's balancer.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.k3 import K3Model
from model.kda import KimiDeltaAttention
from model.moe import LatentMoE, statistics_paused
from model.ops.kda import kda_chunk


def _balancers(module: nn.Module) -> list:
    return [m.balancer for m in module.modules()
            if isinstance(m, LatentMoE) and m.balancer is not None]


@contextlib.contextmanager
def _recompute_context(balancers, autocast):
    with statistics_paused(balancers), autocast():
        yield


def _checkpointed(module: nn.Module, autocast) -> None:
    inner = module.forward
    balancers = _balancers(module)

    def contexts():
        return contextlib.nullcontext(), _recompute_context(balancers, autocast)

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    forward.checkpointed = True
    module.forward = forward


def is_checkpointed(module: nn.Module) -> bool:
    return getattr(module.forward, "checkpointed", False)


def apply_activation_checkpointing(model: K3Model,
                                   autocast=contextlib.nullcontext) -> int:
    """Checkpoints every decoder layer (mixes, norms, attention, MLP); returns the number of
    layers. `autocast`: a callable giving the run's autocast context, re-entered for
    recomputation."""
    for layer in model.layers.values():
        _checkpointed(layer, autocast)
    return len(model.layers)


def compile_sublayers(model: K3Model) -> None:
    """torch.compile of every decoder sublayer (the AttnRes bookkeeping between them stays
    eager: it is a few additions over Python lists); modules that set `compile_disabled` (the
    grouped experts) and the KDA chunk form (`KimiDeltaAttention.chunk_op`) run eagerly inside
    the compiled graphs."""
    for layer in model.layers.values():
        for sub in (layer.attn, layer.mlp):
            for module in sub.modules():
                if getattr(module, "compile_disabled", False):
                    module.forward = torch.compiler.disable(module.forward)
                if isinstance(module, KimiDeltaAttention):
                    module.chunk_op = torch.compiler.disable(kda_chunk)
            sub.forward = torch.compile(sub.forward)
