"""MoonViT-V2: packed patches and grid_thw in, projected LM tokens out."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from model.config import VisionConfig
from model.init import ONES, Normal, Rule, fill_, parameter_key, random_seed
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

    def init_rule(self, name: str) -> Rule:
        """Normal(0, init_std) for linears and the position/time tables, ones for norms; `name`
        relative to this module."""
        module_name, _, leaf = name.rpartition(".")
        module = self.get_submodule(module_name)
        if isinstance(module, RMSNorm):
            return ONES
        if isinstance(module, nn.Linear) or name in ("encoder.pos_table", "encoder.time_table"):
            return Normal(self.init_std)
        raise ValueError(f"no initial-value rule for vision parameter {name}")

    def init_weights(self, seed: int | None = None) -> None:
        """Every parameter from `init_rule` (model/init.py); nothing on the meta device."""
        if all(p.is_meta for p in self.parameters()):
            return
        seed = random_seed() if seed is None else seed
        for name, param in self.named_parameters():
            fill_(param.data, self.init_rule(name), parameter_key(seed, name), param.shape)

    def forward(self, patches: torch.Tensor,
                grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        """patches [P, C*p*p], grid_thw [I, 3] -> [V, lm_hidden]; V = sum(vision_token_count)."""
        layout = build_layout(grid_thw, self.cfg, patches.device)
        features = self.encoder(patches, layout)
        return self.projector(merge_tokens(pool_chunks(features, layout), layout.merge_index))
