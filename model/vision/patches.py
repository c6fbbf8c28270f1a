"""Pixels to NaViT patches, as the data pipeline builds them (layout: model/batch.py).

A patch vector is channel-major (c, y, x) within the patch, so the encoder's Linear patch
embedding equals a stride-p Conv2d whose weight is the Linear weight viewed as [out, C, p, p].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model.config import VisionConfig


def patchify_video(video: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[F, C, H, W] -> [F * h * w, C * p * p]: each frame's patches row-major, frames in order."""
    frames, channels, height, width = video.shape
    if height % patch_size or width % patch_size:
        raise ValueError(f"frame size {height}x{width} is not a multiple of patch {patch_size}")
    h, w = height // patch_size, width // patch_size
    grid = video.reshape(frames, channels, h, patch_size, w, patch_size)
    return grid.permute(0, 2, 4, 1, 3, 5).reshape(frames * h * w, channels * patch_size**2)


def patchify_image(image: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[C, H, W] -> [h * w, C * p * p], row-major."""
    return patchify_video(image.unsqueeze(0), patch_size)


def pack_visuals(visuals: Sequence[torch.Tensor],
                 cfg: VisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Images [C, H, W] and videos [F, C, H, W] -> (patches [P, C*p*p], grid_thw [I, 3]).

    H and W must be multiples of patch_size * merge_size so that the 2x2 merge tiles the grid.
    """
    unit = cfg.patch_size * cfg.merge_size
    patches, grids = [], []
    for i, visual in enumerate(visuals):
        video = visual.unsqueeze(0) if visual.dim() == 3 else visual
        if video.dim() != 4 or video.shape[1] != cfg.in_channels:
            raise ValueError(f"visual {i}: shape {tuple(visual.shape)} is neither [C, H, W] nor "
                             f"[F, C, H, W] with C={cfg.in_channels}")
        frames, _, height, width = video.shape
        if height % unit or width % unit:
            raise ValueError(f"visual {i}: size {height}x{width} is not a multiple of "
                             f"patch_size * merge_size = {unit}")
        patches.append(patchify_video(video, cfg.patch_size))
        grids.append((frames, height // cfg.patch_size, width // cfg.patch_size))
    return torch.cat(patches), torch.tensor(grids, dtype=torch.long)
