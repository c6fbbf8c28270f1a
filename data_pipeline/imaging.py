"""Pixels: decoding with a reason on failure, resizing onto the patch grid, frame sampling,
perceptual signatures for dedup, and patch vectors for the loader.

Placeholder counts follow MoonViT-V2 (SPEC 6): an image of h x w patches gives (h/m)*(w/m)
merged tokens; a video of t frames gives ceil(t/frames_per_chunk) chunks of that many.
model/vision/layout.py's vision_token_count computes the same number from grid_thw; this copy
keeps the pipeline free of model imports (tests/test_data_units.py checks the two agree).
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image, ImageSequence

PHASH_SIZE = 32  # grey thumbnail side for the DCT
COLOR_GRID = 8  # cells per side of the mean-colour grid
COLOR_VALUES = 3 * COLOR_GRID * COLOR_GRID


class MediaError(ValueError):
    """Bytes that do not decode into a usable picture; `reason` is the quarantine reason."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def placeholder_count(frames: int, rows: int, cols: int, merge_size: int,
                      frames_per_chunk: int) -> int:
    chunks = -(-frames // frames_per_chunk)
    return chunks * (rows // merge_size) * (cols // merge_size)


def decode_frames(data: bytes, max_frames: int | None = None) -> list[Image.Image]:
    """All frames of an image or animated image (GIF, WebP, APNG) as RGB; at most `max_frames`,
    sampled uniformly over the clip."""
    if not data:
        raise MediaError("undecodable_image", "zero bytes")
    try:
        with Image.open(io.BytesIO(data)) as img:
            frames = [f.convert("RGB") for f in ImageSequence.Iterator(img)]
    except Exception as e:  # Pillow raises many types for broken files
        raise MediaError("undecodable_image", f"{type(e).__name__}: {e}") from None
    if max_frames is not None:
        frames = [frames[i] for i in sample_frame_indices(len(frames), max_frames)]
    return frames


def decode_image(data: bytes) -> Image.Image:
    return decode_frames(data)[0]


def sample_frame_indices(num_frames: int, max_frames: int) -> list[int]:
    if num_frames <= max_frames:
        return list(range(num_frames))
    return [round(i * (num_frames - 1) / (max_frames - 1)) for i in range(max_frames)] \
        if max_frames > 1 else [num_frames // 2]


def grid_size(width: int, height: int, max_pixels: int, unit: int) -> tuple[int, int]:
    """(W, H) in pixels, multiples of `unit`, W*H <= max_pixels, aspect ratio kept as far as the
    rounding allows; images are never upscaled beyond one unit per side."""
    scale = min(1.0, math.sqrt(max_pixels / (width * height)))
    w = max(unit, round(width * scale / unit) * unit)
    h = max(unit, round(height * scale / unit) * unit)
    while w * h > max_pixels:
        if w >= h:
            w -= unit
        else:
            h -= unit
    return w, h


def encode_png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


def resize(img: Image.Image, size: tuple[int, int]) -> Image.Image:
    return img if img.size == size else img.resize(size, Image.Resampling.BICUBIC)


def _dct_matrix(n: int) -> np.ndarray:
    k = np.arange(n)[:, None]
    x = np.arange(n)[None, :]
    return np.cos(np.pi * (2 * x + 1) * k / (2 * n))


_DCT = _dct_matrix(PHASH_SIZE)


def perceptual_signature(img: Image.Image) -> tuple[int, np.ndarray]:
    """(64-bit DCT perceptual hash of the luminance, mean colour of an 8x8 grid as 192 uint8).

    The hash sees structure but hardly colour (a red and a green disc hash alike), so a
    duplicate must also match the colour grid."""
    grey = np.asarray(img.convert("L").resize((PHASH_SIZE, PHASH_SIZE), Image.Resampling.BOX),
                      dtype=np.float64)
    low = (_DCT @ grey @ _DCT.T)[:8, :8].ravel()
    low = np.round(low, 3)  # flat pictures: exact zeros instead of float noise
    bits = low > np.median(low[1:])
    phash = int(np.packbits(bits).view(">u8")[0])
    cells = img.convert("RGB").resize((COLOR_GRID, COLOR_GRID), Image.Resampling.BOX)
    colors = np.asarray(cells, dtype=np.uint8).ravel()
    return phash, colors


def frames_to_patches(frames: np.ndarray, patch_size: int) -> np.ndarray:
    """uint8 frames [T, H, W, 3] -> float32 patches [T*h*w, 3*p*p] scaled to [-1, 1]; patches
    row-major per frame, each patch channel-major (c, y, x) as model/vision/patches.py."""
    t, height, width, c = frames.shape
    h, w = height // patch_size, width // patch_size
    x = frames.reshape(t, h, patch_size, w, patch_size, c).transpose(0, 1, 3, 5, 2, 4)
    return (x.reshape(t * h * w, c * patch_size * patch_size).astype(np.float32) / 127.5) - 1.0
