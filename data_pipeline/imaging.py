"""Pixels: decoding with a reason on failure, resizing onto the patch grid, frame sampling and
perceptual signatures for dedup. Placeholder counts and patch vectors are the model's own
(model.vision: vision_token_count, patchify_video).
"""

from __future__ import annotations

import io
import math
import re

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


def decode_frames(data: bytes, max_frames: int | None = None) -> list[Image.Image]:
    """All frames of an image or animated image (GIF, WebP, APNG) as RGB; at most `max_frames`,
    sampled uniformly over the clip."""
    if not data:
        raise MediaError("undecodable_image", "zero bytes")
    try:
        with Image.open(io.BytesIO(data)) as img:
            frames = [f.convert("RGB") for f in ImageSequence.Iterator(img)]
    except Exception as e:  # Pillow raises many types for broken files
        # without the buffer's address, so that reruns write the same quarantine file
        message = re.sub(r" at 0x[0-9a-fA-F]+", "", str(e))
        raise MediaError("undecodable_image", f"{type(e).__name__}: {message}") from None
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

