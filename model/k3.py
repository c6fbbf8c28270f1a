"""The K3 multimodal model: MoonViT-V2 tokens merged into a hybrid KDA/MLA decoder with Block
Attention Residuals and latent MoE, untied embedding and LM head, no positional encoding."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .attnres import BlockState, DepthMix
from .batch import K3Batch, segment_ids
from .config import K3Config
from .dtypes import autocast_dtype
from .head import IGNORE_INDEX, LMHead
from .init import Locate, Normal, Rule, fill_, parameter_key, random_seed
from .kda import KimiDeltaAttention
from .mla import GatedMLA
from .mlp import SiTUGLUMLP
from .moe import LatentMoE
from .norms import RMSNorm
from .vision import MoonViT


def _forked_rng():
    """Forks the CPU generator and, when building on an accelerator, that device's."""
    device = torch.get_default_device()
    if device.type in ("cpu", "meta"):
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device], device_type=device.type)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: K3Config, index: int):
        super().__init__()
        self.index = index
        self.kind = cfg.layer_types()[index]
        self.attn = KimiDeltaAttention(cfg) if self.kind == "kda" else GatedMLA(cfg)
        if cfg.is_moe_layer(index):
            self.mlp = LatentMoE(cfg)
        else:
            self.mlp = SiTUGLUMLP(cfg.hidden_size, cfg.dense_intermediate, cfg.situ_beta_gate,
                                  cfg.situ_beta_up)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        # Layer 0 sees only the embedding before its attention: nothing to mix there.
        self.attn_mix = DepthMix(cfg.hidden_size, cfg.norm_eps) if index > 0 else None
        self.mlp_mix = DepthMix(cfg.hidden_size, cfg.norm_eps)

    def forward(self, blocks: Sequence[torch.Tensor], partial: torch.Tensor | None,
                cu_seqlens: torch.Tensor | None, segments: torch.Tensor | None,
                token_mask: torch.Tensor) -> torch.Tensor:
        """blocks: the completed AttnRes blocks (the embedding first); partial: the current
        block's running sum (None right after a block completed). Returns the new partial."""
        sources = [*blocks] if partial is None else [*blocks, partial]
        h = sources[-1] if self.attn_mix is None else self.attn_mix(sources)
        out = self.attn(self.attn_norm(h), cu_seqlens, segments)
        partial = out if partial is None else partial + out
        h = self.mlp_norm(self.mlp_mix([*blocks, partial]))
        if isinstance(self.mlp, LatentMoE):
            b, t, d = h.shape
            out = self.mlp(h.reshape(b * t, d), token_mask.reshape(b * t)).view(b, t, d)
        else:
            out = self.mlp(h)
        return partial + out


def embedded_in_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """The token embeddings in autocast's dtype (bf16 under bf16 autocast): they are the first
    AttnRes block, which every layer reads and which each micro-batch in flight keeps, as the
    other blocks (sums of bf16 layer outputs) are kept."""
    dtype = autocast_dtype(x.device.type)
    return x if dtype is None else x.to(dtype)


@dataclass
class K3Output:
    loss_sum: torch.Tensor  # summed token cross-entropy (fp32); divide by the global token count
    num_tokens: torch.Tensor  # tokens that carry a loss in this micro-batch
    logits: torch.Tensor | None = None


class K3Model(nn.Module):
    """Embedding (+ vision), decoder layers, LM head with the loss.

    `layers` is a ModuleDict keyed by the layer index, so a pipeline stage that keeps some of
    them keeps their parameter names. Every parameter and buffer gets its value from
    `init_weights(seed)`, each element a function of the seed, the parameter's name and its
    index (model/init.py): a model built on the meta device, materialised with `to_empty` and
    initialised equals an eagerly built one with the same seed, and so does any part of it a
    parallel layout keeps on one rank. `seed` None: drawn from torch's global generator.
    """

    def __init__(self, cfg: K3Config, seed: int | None = None):
        super().__init__()
        self.cfg = cfg
        # The constructors' own inits are overwritten by init_weights: let them draw from a
        # forked RNG, so that the global generator moves by init_weights' seed alone.
        with _forked_rng():
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i)
                                         for i in range(cfg.num_layers)})
            self.head = LMHead(cfg)
            self.vision = (MoonViT(cfg.vision, cfg.hidden_size, cfg.norm_eps)
                           if cfg.vision is not None else None)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, locate: Locate | None = None) -> int:
        """Every parameter from its rule (`init_rule`), zero Quantile Balancing state. `locate`
        (parallel layouts) says which part of each parameter this process holds: `locate(name,
        param)` -> (the local tensor to write, the logical shape, the global index of its
        elements along each dimension, or None for all of them). Returns the seed (drawn from
        torch's global generator when None)."""
        seed = random_seed() if seed is None else seed
        for name, param in self.named_parameters():
            local, shape, index = (locate(name, param) if locate is not None
                                   else (param.data, param.shape, None))
            fill_(local, self.init_rule(name), parameter_key(seed, name), shape, index)
        for moe in self.moe_layers():
            if moe.balancer is not None:
                moe.balancer.reset_parameters()
        return seed

    def init_rule(self, name: str) -> Rule:
        """What parameter `name` starts as: the vision tower's rule for its own, a module's
        `init_rules()` where it declares them (norms, gates, convolutions, AttnRes queries,
        experts, router), Normal(0, init_std) for the language model's linear and embedding
        weights."""
        if name.startswith("vision."):
            return self.vision.init_rule(name[len("vision."):])
        module_name, _, leaf = name.rpartition(".")
        module = self.get_submodule(module_name)
        if hasattr(module, "init_rules"):
            return module.init_rules()[leaf]
        # nn.Linear, nn.Embedding, or a linear another backend put in its place (TE's).
        linear = isinstance(module, nn.Embedding) or hasattr(module, "in_features")
        if linear and leaf == "weight":
            return Normal(self.cfg.init_std)
        raise ValueError(f"no initial-value rule for parameter {name}")

    def embed_inputs(self, batch: K3Batch) -> torch.Tensor:
        """Token embeddings with the projected vision tokens written over the placeholders."""
        x = embedded_in_compute_dtype(self.embed(batch.tokens))
        if batch.vision is None or self.vision is None:
            return x
        b, t, d = x.shape
        vis = self.vision(batch.vision.patches, batch.vision.grid_thw).to(x.dtype)
        if batch.vision.output_rows is not None:
            vis = vis.index_select(0, batch.vision.output_rows)
        flat = x.reshape(b * t, d).index_copy(0, batch.vision.token_positions, vis)
        return flat.view(b, t, d)

    def run_layers(self, state: BlockState, batch: K3Batch,
                   layers: Sequence[DecoderLayer] | None = None) -> None:
        """`layers` (default: every decoder layer this model holds; a pipeline stage passes its
        own) in order, on the state's blocks and partial."""
        b, t = batch.tokens.shape
        cu = batch.cu_seqlens
        segments = segment_ids(cu, b * t).view(b, t) if cu is not None else None
        token_mask = batch.tokens != self.cfg.pad_token_id
        for layer in self.layers.values() if layers is None else layers:
            state.start_layer(layer.index)
            # A tuple snapshot: a checkpointed layer recomputes from the blocks it was given.
            state.partial = layer(tuple(state.blocks), state.partial, cu, segments, token_mask)

    def forward(self, batch: K3Batch, return_logits: bool = False) -> K3Output:
        state = BlockState(self.embed_inputs(batch), self.cfg.attnres_block_size)
        self.run_layers(state, batch)
        loss_sum, logits = self.head(state.sources(), batch.labels, return_logits)
        num_tokens = (batch.labels != IGNORE_INDEX).sum()
        return K3Output(loss_sum, num_tokens, logits)

    def moe_layers(self) -> list[LatentMoE]:
        return [layer.mlp for layer in self.layers.values() if isinstance(layer.mlp, LatentMoE)]

    def mla_layers(self) -> list[GatedMLA]:
        return [layer.attn for layer in self.layers.values() if isinstance(layer.attn, GatedMLA)]
