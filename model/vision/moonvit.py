"""MoonViT-V2: packed patches and grid_thw in, projected LM tokens out."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from model.config import VisionConfig
from model.norms import RMSNorm
from model.vision.encoder import MoonViTEncoder
from model.vision.layout import build_layout
from model.vision.projector import VisionProjector, merge_tokens, pool_chunks


class MoonViT(nn.Module):
    """Encoder + temporal pooling + 2x2 merge + projector.

    `norm_eps` is the language model's: it applies to the projector's output RMSNorm, which lives
    in the LM's hidden space; the encoder's norms use `cfg.norm_eps`.
    """

    def __init__(self, cfg: VisionConfig, lm_hidden: int, norm_eps: float = 1e-5,
                 init_std: float = 0.02):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.init_std = init_std
        self.encoder = MoonViTEncoder(cfg)
        self.projector = VisionProjector(cfg.merge_size**2 * cfg.hidden_size,
                                         cfg.projector_hidden, lm_hidden, norm_eps)
        self.init_weights()

    def init_weights(self) -> None:
        """Normal(0, init_std) for linears and the position/time tables, ones for norms."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=self.init_std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        nn.init.normal_(self.encoder.pos_table, std=self.init_std)
        nn.init.normal_(self.encoder.time_table, std=self.init_std)

    def forward(self, patches: torch.Tensor,
                grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        """patches [P, C*p*p], grid_thw [I, 3] -> [V, lm_hidden]; V = sum(vision_token_count)."""
        layout = build_layout(grid_thw, self.cfg, patches.device)
        features = self.encoder(patches, layout)
        return self.projector(merge_tokens(pool_chunks(features, layout), layout.merge_index))
