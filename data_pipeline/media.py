"""Pipeline steps for pictures: decode (quarantining what does not decode), then, after the
geometry filters, resize onto the patch grid and re-encode as PNG.

Between the two steps a document carries its decoded frames in metadata["_frames"]; after
NormalizeMedia its media are PNG frames and metadata["grid_thw"] = [frames, patch rows, patch
cols], metadata["raw_size"] = [width, height] of the original picture.
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


def _decode(media: list[Media], modality: str, max_frames: int):
    if modality == "image":
        return [decode_image(media[0].media_bytes)]
    if len(media) == 1:  # a video file: frames sampled inside it
        return decode_frames(media[0].media_bytes, max_frames)
    return [decode_image(media[i].media_bytes)
            for i in sample_frame_indices(len(media), max_frames)]


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
                if modality == "text":
                    yield doc
                    continue
                with self.track_time():
                    try:
                        frames = _decode(doc.media, modality, self.image.max_frames)
                    except MediaError as e:
                        doc.metadata.update(k3_reason=e.reason, k3_detail=e.detail)
                        ledger.write(doc, rank)
                        self.stat_update(f"quarantined_{e.reason}")
                        continue
                doc.metadata["_frames"] = frames
                doc.metadata["raw_size"] = list(frames[0].size)
                yield doc


class NormalizeMedia(PipelineStep):
    """Every frame of a document resized to one grid that fits image.max_pixels."""

    name = "normalize media"
    type = "MEDIA"

    def __init__(self, image: ImageConfig):
        super().__init__()
        self.image = image

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        p = self.image.patch_size
        for doc in data:
            frames = doc.metadata.pop("_frames", None)
            if frames is not None:
                with self.track_time():
                    size = grid_size(*frames[0].size, self.image.max_pixels, self.image.unit)
                    media_type = doc.media[0].type
                    doc.media = [Media(id=f"{doc.id}#frame{i}", type=media_type, url=doc.id,
                                       media_bytes=encode_png(resize(f, size)))
                                 for i, f in enumerate(frames)]
                    doc.metadata["grid_thw"] = [len(frames), size[1] // p, size[0] // p]
            yield doc
