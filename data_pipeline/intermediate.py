"""The curated documents handed from the curation stage to the tokenize stage: JSONL with the
document's text, metadata and media (PNG frames, base64). One file per curation task."""

from __future__ import annotations

import base64
import json
from typing import IO

from datatrove.data import Document, DocumentsPipeline, Media
from datatrove.pipeline.readers.base import BaseDiskReader
from datatrove.pipeline.writers.disk_base import DiskWriter


class CuratedWriter(DiskWriter):
    name = "curated documents"
    type = "WRITER"

    def __init__(self, work_dir: str):
        super().__init__(f"{work_dir}/curated", output_filename="${rank}.jsonl",
                         compression=None, mode="wt")

    def _default_adapter(self, document: Document) -> dict:
        return {"id": document.id, "text": document.text, "metadata": document.metadata,
                "media": [{"type": m.type, "png": base64.b64encode(m.media_bytes).decode("ascii")}
                          for m in document.media]}

    def _write(self, document: dict, file_handler: IO, filename: str) -> None:
        file_handler.write(json.dumps(document) + "\n")


def document_from_json(obj: dict) -> Document:
    media = [Media(id=f"{obj['id']}#frame{i}", type=m["type"], url=obj["id"],
                   media_bytes=base64.b64decode(m["png"])) for i, m in enumerate(obj["media"])]
    return Document(text=obj["text"], id=obj["id"], media=media, metadata=obj["metadata"])


class CuratedReader(BaseDiskReader):
    name = "curated documents"
    type = "READER"

    def __init__(self, work_dir: str, progress: bool = False):
        super().__init__(f"{work_dir}/curated", glob_pattern="*.jsonl", doc_progress=progress)

    def run(self, data: DocumentsPipeline = None, rank: int = 0,
            world_size: int = 1) -> DocumentsPipeline:
        if self.data_folder.exists("") and self.data_folder.list_files(glob_pattern="*.jsonl"):
            yield from super().run(data, rank, world_size)
        # else: no curated document at all (datatrove's reader raises on a missing folder)

    def read_file(self, filepath: str) -> DocumentsPipeline:
        with self.data_folder.open(filepath, "rt", encoding="utf-8") as f:
            for line in f:
                yield document_from_json(json.loads(line))
