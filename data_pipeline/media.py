"""Pipeline steps for pictures: decode (quarantining what does not decode), then, after the
geometry filters, resize onto the patch grid and re-encode as PNG.

A document holds pictures: an image document one picture of one frame, a video document one
picture of several frames, a conversation one single-frame picture per image part (none for a
conversation without images). Between the two steps a document carries its decoded pictures in
metadata["_pictures"] (a list of frame lists) and metadata["raw_sizes"] = [width, height] of
each original picture (its first frame); after NormalizeMedia its media are the PNG frames of
its pictures in order and metadata["grid_thws"] = one [frames, patch rows, patch cols] per
picture.
"""

from __future__ import annotations

from datatrove.data import DocumentsPipeline, Media
from datatrove.pipeline.base import PipelineStep

from .config import ImageConfig
from .imaging import (
    MediaError,
    decode_frames,
    decode_image,
    encode_png,
    grid_size,
    resize,
    sample_frame_indices,
)
from .records import LedgerWriter


def _decode(media: list[Media], modality: str, max_frames: int) -> list[list]:
    """The document's pictures, each a list of frames."""
    if modality == "image":
        return [[decode_image(media[0].media_bytes)]]
    if modality == "chat":
        return [[decode_image(m.media_bytes)] for m in media]
    if len(media) == 1:  # a video file: frames sampled inside it
        return [decode_frames(media[0].media_bytes, max_frames)]
    return [[decode_image(media[i].media_bytes)
             for i in sample_frame_indices(len(media), max_frames)]]


class DecodeMedia(PipelineStep):
    name = "decode media"
    type = "MEDIA"

    def __init__(self, image: ImageConfig, output_dir: str):
        super().__init__()
        self.image = image
        self.output_dir = output_dir

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        with LedgerWriter(self.output_dir, "decode_media", outcome="quarantined") as ledger:
            for doc in data:
                modality = doc.metadata["modality"]
                if not doc.media:  # text, or a conversation without images
                    yield doc
                    continue
                with self.track_time():
                    try:
                        pictures = _decode(doc.media, modality, self.image.max_frames)
                    except MediaError as e:
                        doc.metadata.update(k3_reason=e.reason, k3_detail=e.detail)
                        ledger.write(doc, rank)
                        self.stat_update(f"quarantined_{e.reason}")
                        continue
                doc.metadata["_pictures"] = pictures
                doc.metadata["raw_sizes"] = [list(frames[0].size) for frames in pictures]
                yield doc


class NormalizeMedia(PipelineStep):
    """Every frame of a picture resized to one grid that fits image.max_pixels (each picture of
    a conversation on its own grid)."""

    name = "normalize media"
    type = "MEDIA"

    def __init__(self, image: ImageConfig):
        super().__init__()
        self.image = image

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        p = self.image.patch_size
        for doc in data:
            pictures = doc.metadata.pop("_pictures", None)
            if pictures is not None:
                with self.track_time():
                    media_type = doc.media[0].type
                    doc.media, grids = [], []
                    for frames in pictures:
                        size = grid_size(*frames[0].size, self.image.max_pixels, self.image.unit)
                        doc.media += [Media(id=f"{doc.id}#frame{len(doc.media) + i}",
                                            type=media_type, url=doc.id,
                                            media_bytes=encode_png(resize(f, size)))
                                      for i, f in enumerate(frames)]
                        grids.append([len(frames), size[1] // p, size[0] // p])
                    doc.metadata["grid_thws"] = grids
            yield doc
