"""MoonViT-V2 vision encoder and projector."""

from model.vision.encoder import MoonViTEncoder, interpolate_pos_table
from model.vision.layout import VisionLayout, build_layout, vision_token_count
from model.vision.moonvit import MoonViT
from model.vision.patches import pack_visuals, patchify_image, patchify_video
from model.vision.projector import VisionProjector, merge_tokens, pool_chunks

__all__ = [
    "MoonViT", "MoonViTEncoder", "VisionLayout", "VisionProjector", "build_layout",
    "interpolate_pos_table", "merge_tokens", "pack_visuals", "patchify_image", "patchify_video",
    "pool_chunks", "vision_token_count",
]
