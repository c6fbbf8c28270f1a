"""The K3 multimodal model: MoonViT-V2 tokens merged into a hybrid KDA/MLA decoder with Block
Attention Residuals and latent MoE, untied embedding and LM head, no positional encoding."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attnres import BlockState, DepthMix
from .batch import K3Batch, segment_ids
from .config import K3Config
from .kda import KimiDeltaAttention
from .mla import GatedMLA
from .mlp import SiTUGLUMLP
from .moe import LatentMoE
from .norms import RMSNorm
from .vision import MoonViT

IGNORE_INDEX = -100


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

    def forward(self, state: BlockState, cu_seqlens: torch.Tensor | None,
                segments: torch.Tensor | None, token_mask: torch.Tensor) -> None:
        h = state.before_attention(self.index, self.attn_mix)
        state.add(self.attn(self.attn_norm(h), cu_seqlens, segments))
        h = self.mlp_norm(state.mix(self.mlp_mix))
        if isinstance(self.mlp, LatentMoE):
            b, t, d = h.shape
            out = self.mlp(h.reshape(b * t, d), token_mask.reshape(b * t)).view(b, t, d)
        else:
            out = self.mlp(h)
        state.add(out)


@dataclass
class K3Output:
    loss_sum: torch.Tensor  # summed token cross-entropy (fp32); divide by the global token count
    num_tokens: torch.Tensor  # tokens that carry a loss in this micro-batch
    logits: torch.Tensor | None = None


class K3Model(nn.Module):
    def __init__(self, cfg: K3Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.out_mix = DepthMix(cfg.hidden_size, cfg.norm_eps)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.vision = (MoonViT(cfg.vision, cfg.hidden_size, cfg.norm_eps)
                       if cfg.vision is not None else None)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) for the language model's matrices; the layers' own inits for
        norms, gates, convolutions and AttnRes queries (zero)."""
        for name, module in self.named_modules():
            if name.startswith("vision"):
                continue
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=self.cfg.init_std)

    def embed_inputs(self, batch: K3Batch) -> torch.Tensor:
        """Token embeddings with the projected vision tokens written over the placeholders."""
        x = self.embed(batch.tokens)
        if batch.vision is None or self.vision is None:
            return x
        b, t, d = x.shape
        vis = self.vision(batch.vision.patches, batch.vision.grid_thw).to(x.dtype)
        flat = x.reshape(b * t, d).index_copy(0, batch.vision.token_positions, vis)
        return flat.view(b, t, d)

    def hidden_states(self, batch: K3Batch) -> torch.Tensor:
        x = self.embed_inputs(batch)
        b, t, _ = x.shape
        cu = batch.cu_seqlens
        segments = segment_ids(cu, b * t).view(b, t) if cu is not None else None
        token_mask = batch.tokens != self.cfg.pad_token_id
        state = BlockState(x, self.cfg.attnres_block_size)
        for layer in self.layers:
            layer(state, cu, segments, token_mask)
        return self.final_norm(state.mix(self.out_mix))

    def forward(self, batch: K3Batch, return_logits: bool = False) -> K3Output:
        h = self.hidden_states(batch)
        logits = self.lm_head(h)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 or wider
        labels = batch.labels.reshape(-1)
        loss_sum = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels,
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        num_tokens = (labels != IGNORE_INDEX).sum()
        return K3Output(loss_sum, num_tokens, logits if return_logits else None)

    def moe_layers(self) -> list[LatentMoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, LatentMoE)]

    def mla_layers(self) -> list[GatedMLA]:
        return [layer.attn for layer in self.layers if isinstance(layer.attn, GatedMLA)]
