"""MoonViT-V2 encoder: patch embedding, learned position and time tables, pre-RMSNorm blocks with
2-D RoPE and block-diagonal (per image / per video chunk) attention over a NaViT-packed sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import VisionConfig
from model.norms import RMSNorm
from model.ops.attention import segment_attention
from model.vision.layout import VisionLayout
from model.vision.rope import apply_axial_rope, axial_rope_angles


def interpolate_pos_table(table: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Bilinear resize of the [S, S, C] table to a rows x cols grid -> [rows * cols, C]."""
    grid = table.permute(2, 0, 1).unsqueeze(0)
    resized = F.interpolate(grid, size=(rows, cols), mode="bilinear", align_corners=False)
    return resized[0].flatten(1).transpose(0, 1)


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        width = num_heads * head_dim
        self.q_proj = nn.Linear(hidden, width, bias=False)
        self.k_proj = nn.Linear(hidden, width, bias=False)
        self.v_proj = nn.Linear(hidden, width, bias=False)
        self.o_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor, angles: torch.Tensor, cu_seqlens: torch.Tensor,
                seqlens: tuple[int, ...] | None = None) -> torch.Tensor:
        """Non-causal attention within each image / video chunk of the packed [P, hidden] x:
        the packed sequence is one row of segment_attention, so no P x P mask is formed. With
        the segments' lengths (`seqlens`, host ints) it runs per group of equal-length segments
        where flash varlen cannot (CPU, fp32): no tile pairs two images."""
        heads = (x.shape[0], -1, self.head_dim)  # local heads when q/k/v are head-sharded
        q = apply_axial_rope(self.q_proj(x).view(heads), angles)
        k = apply_axial_rope(self.k_proj(x).view(heads), angles)
        v = self.v_proj(x).view(heads)
        o = segment_attention(q[None], k[None], v[None], cu_seqlens, self.head_dim ** -0.5,
                              causal=False, seqlens=seqlens)
        return self.o_proj(o[0].flatten(1).to(x.dtype))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate, bias=False)
        self.fc2 = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads, cfg.head_dim)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = VisionMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, angles: torch.Tensor, cu_seqlens: torch.Tensor,
                seqlens: tuple[int, ...] | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), angles, cu_seqlens, seqlens)
        return x + self.mlp(self.mlp_norm(x))


class MoonViTEncoder(nn.Module):
    """Packed patches [P, C*p*p] -> per-patch features [P, hidden] (after the final RMSNorm)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=False)
        size = cfg.pos_table_size
        self.pos_table = nn.Parameter(torch.empty(size, size, cfg.hidden_size))
        self.time_table = nn.Parameter(torch.empty(cfg.time_table_size, cfg.hidden_size))
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def position_embedding(self, layout: VisionLayout) -> torch.Tensor:
        """Interpolated table per frame (resized once per distinct frame size) plus the time
        table, each one gather (index_select: its backward is an index_add)."""
        tables = torch.cat([interpolate_pos_table(self.pos_table, h, w)
                            for h, w in layout.frame_sizes])
        return (tables.index_select(0, layout.position_index)
                + self.time_table.index_select(0, layout.frame_in_chunk))

    def forward(self, patches: torch.Tensor, layout: VisionLayout) -> torch.Tensor:
        if patches.shape[0] != layout.num_patches:
            raise ValueError(f"patches has {patches.shape[0]} rows, grid_thw describes "
                             f"{layout.num_patches}")
        x = self.patch_embed(patches.to(self.patch_embed.weight.dtype))
        x = x + self.position_embedding(layout).to(x.dtype)
        angles = axial_rope_angles(layout.rows, layout.cols, self.cfg.head_dim, self.cfg.rope_theta)
        for block in self.blocks:
            x = block(x, angles, layout.cu_seqlens, layout.seqlens)
        return self.final_norm(x)
