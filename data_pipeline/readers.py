"""Readers for raw sources, as datatrove readers (each task reads its shard of the files).

Every record a reader meets is counted; records that cannot become a document (malformed JSON,
non-UTF-8 text, no or empty text, a missing image or caption, an unreadable file) go to the
quarantine ledger with the reason instead of raising. Counts per task are written to
<output_dir>/counts/read/<source>/<rank>.json.
"""

from __future__ import annotations

import json
import posixpath
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from datatrove.data import Document, DocumentsPipeline, Media, MediaType
from datatrove.pipeline.readers.base import BaseDiskReader
from tqdm import tqdm

from .config import SourceConfig, resolve_path
from .records import LedgerWriter, ledger_doc, write_json

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
VIDEO_EXTENSIONS = (".gif", ".webp", ".apng")


class RecordProblem(Exception):
    """A record that must be quarantined (reason, detail)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


def decode_text(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecordProblem("non_utf8", f"{what}: {e}") from None


def check_text(text, what: str) -> str:
    if not isinstance(text, str):
        raise RecordProblem("missing_text", f"{what} is {type(text).__name__}, not a string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # lone surrogates from \\ud800-style JSON escapes
        raise RecordProblem("non_utf8", f"{what}: {e}") from None
    if not text.strip():
        raise RecordProblem("empty_document", f"{what} is empty")
    return text


@dataclass
class RawRecord:
    """One input record: `build()` returns its Document or raises RecordProblem; `raw` is kept
    for the quarantine excerpt."""

    key: str | int
    nbytes: int
    build: Callable[[], Document]
    raw: bytes | str | None = None


class K3Reader(BaseDiskReader):
    """Shared plumbing: file sharding over tasks, ids, metadata, counting and quarantine.
    Subclasses implement `records(filepath)` yielding RawRecords."""

    type = "READER"
    default_glob: str | None = None

    def __init__(self, source: SourceConfig, source_index: int, output_dir: str,
                 progress: bool = False):
        super().__init__(resolve_path(source.path), glob_pattern=source.glob or self.default_glob,
                         doc_progress=progress, text_key=source.text_key, id_key=source.id_key)
        self.source = source
        self.source_index = source_index
        self.output_dir = output_dir
        self.name = f"{source.name} ({source.format})"

    def doc_id(self, filepath: str, key: str | int) -> str:
        return f"{self.source.name}/{filepath}#{key}"

    def order_key(self, filepath: str, position: int) -> str:
        return f"{self.source_index:03d}|{filepath}|{position:09d}"

    def make_document(self, filepath: str, key: str | int, text: str, nbytes: int,
                      media: list[Media] | None = None, orig_id=None,
                      position: int | None = None) -> Document:
        """`position`: the record's index in its file (defaults to an integer key)."""
        order = self.order_key(filepath, key if position is None else position)
        return Document(text=text, id=self.doc_id(filepath, key), media=media or [], metadata={
            "source": self.source.name, "modality": self.source.modality, "order": order,
            "orig_id": orig_id, "origin": "input", "bytes": nbytes,
            "rephrase": self.source.rephrase})

    def read_file(self, filepath: str) -> DocumentsPipeline:
        for record in self.records(filepath):
            self.records_read += 1
            self.bytes_read += record.nbytes
            try:
                yield record.build()
            except RecordProblem as p:
                self.ledger.write(ledger_doc(self.doc_id(filepath, record.key), self.source.name,
                                             "quarantined", p.reason, p.detail, record.raw,
                                             record.nbytes), self.rank)

    def records(self, filepath: str) -> Iterator[RawRecord]:
        raise NotImplementedError

    def accepts(self, filepath: str) -> bool:
        """Whether a listed file holds records (e.g. not the caption file of an image)."""
        return True

    def run(self, data: DocumentsPipeline = None, rank: int = 0,
            world_size: int = 1) -> DocumentsPipeline:
        if data:
            yield from data
        files = [f for f in self.data_folder.list_files(glob_pattern=self.glob_pattern)
                 if self.accepts(f)]
        self.rank = rank
        self.records_read = 0
        self.bytes_read = 0
        with LedgerWriter(self.output_dir, f"read_{self.source.name}",
                          outcome="quarantined") as self.ledger, \
                tqdm(desc=f"read {self.source.name}", unit="doc", disable=not self.doc_progress,
                     leave=False) as bar:
            for filepath in files[rank::world_size]:
                self.stat_update("input_files")
                for doc in self.read_file(filepath):
                    self.update_doc_stats(doc)
                    yield doc
                    bar.update()
        write_json(_counts_path(self.output_dir, self.source.name, rank),
                   {"records": self.records_read, "bytes": self.bytes_read})


def _counts_path(output_dir: str, source: str, rank: int) -> Path:
    return Path(output_dir) / "counts" / "read" / source / f"{rank:05d}.json"


def _raise(problem: RecordProblem) -> Callable[[], Document]:
    def fn():
        raise problem
    return fn


class JsonlTextReader(K3Reader):
    """One JSON object per line; blank lines are not records."""

    def records(self, filepath: str) -> Iterator:
        with self.data_folder.open(filepath, "rb") as f:
            for index, raw in enumerate(f):
                if raw.strip():
                    yield RawRecord(index, len(raw),
                                    lambda r=raw, i=index: self._line(filepath, i, r), raw)

    def _line(self, filepath: str, index: int, raw: bytes) -> Document:
        line = decode_text(raw, f"line {index + 1}")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise RecordProblem("malformed_json", f"line {index + 1}: {e}") from None
        if not isinstance(obj, dict):
            raise RecordProblem("malformed_json", f"line {index + 1} is not a JSON object")
        text = check_text(obj.get(self.text_key), f"field {self.text_key!r}")
        return self.make_document(filepath, index, text, len(raw), orig_id=obj.get(self.id_key))


class ParquetTextReader(K3Reader):
    """One row per record; an unreadable file is one quarantined record."""

    def records(self, filepath: str) -> Iterator:
        import pyarrow.parquet as pq

        try:
            with self.data_folder.open(filepath, "rb") as f:
                table = pq.read_table(f)
        except Exception as e:
            yield RawRecord(0, 0, _raise(RecordProblem("unreadable_file",
                                                       f"{type(e).__name__}: {e}")))
            return
        texts = (table.column(self.text_key).to_pylist() if self.text_key in table.column_names
                 else [None] * table.num_rows)
        ids = (table.column(self.id_key).to_pylist() if self.id_key in table.column_names
               else [None] * table.num_rows)
        for index, (text, orig_id) in enumerate(zip(texts, ids)):
            nbytes = len(text.encode("utf-8", "surrogatepass")) if isinstance(text, str) else 0
            yield RawRecord(index, nbytes, lambda t=text, i=index, o=orig_id, n=nbytes:
                            self._row(filepath, i, t, n, o),
                            text if isinstance(text, str) else None)

    def _row(self, filepath: str, index: int, text, nbytes: int, orig_id) -> Document:
        text = check_text(text, f"column {self.text_key!r}")
        return self.make_document(filepath, index, text, nbytes, orig_id=orig_id)


def _caption(raw: bytes | None, what: str) -> str:
    if raw is None:
        raise RecordProblem("missing_caption", what)
    return check_text(decode_text(raw, what), what)


def _media(data: bytes, media_type: int, url: str) -> Media:
    return Media(id=url, type=media_type, url=url, media_bytes=data)


class WebDatasetImageReader(K3Reader):
    """WebDataset tar shards: members `<key>.<ext>` grouped by key; the image is the member with
    an image extension, the caption `<key>.txt` (or "caption" in `<key>.json`)."""

    default_glob = "*.tar"

    def records(self, filepath: str) -> Iterator:
        key, members, position = None, {}, 0
        try:
            with self.data_folder.open(filepath, "rb") as f, tarfile.open(fileobj=f,
                                                                          mode="r|") as tar:
                for info in tar:
                    if not info.isfile():
                        continue
                    base = posixpath.basename(info.name)
                    member_key, _, ext = base.partition(".")
                    if member_key != key and key is not None:
                        yield self._sample(filepath, key, members, position)
                        members, position = {}, position + 1
                    key = member_key
                    members[ext.lower()] = tar.extractfile(info).read()
        except (tarfile.TarError, OSError, EOFError) as e:
            # the rest of the shard cannot be enumerated: one quarantined record for it
            yield RawRecord(f"{key}+rest", 0, _raise(RecordProblem(
                "unreadable_file", f"tar shard broken after key {key!r}: {e}")))
            return
        if key is not None:
            yield self._sample(filepath, key, members, position)

    def _sample(self, filepath: str, key: str, members: dict[str, bytes], position: int):
        nbytes = sum(len(v) for v in members.values())
        return RawRecord(key, nbytes,
                         lambda: self._document(filepath, key, members, nbytes, position))

    def _document(self, filepath: str, key: str, members: dict[str, bytes], nbytes: int,
                  position: int):
        image = next((members[e[1:]] for e in IMAGE_EXTENSIONS if e[1:] in members), None)
        if image is None:
            raise RecordProblem("missing_image", f"no image member for key {key!r}")
        caption = members.get("txt")
        if caption is None and "json" in members:
            try:
                caption = json.loads(members["json"]).get("caption", "").encode("utf-8")
            except (json.JSONDecodeError, AttributeError) as e:
                raise RecordProblem("malformed_json", f"{key}.json: {e}") from None
        text = _caption(caption, f"caption of {key!r}")
        return self.make_document(filepath, key, text, nbytes,
                                  [_media(image, MediaType.IMAGE, f"{filepath}#{key}")], key,
                                  position)


def _read_sibling(reader: K3Reader, path: str) -> bytes | None:
    if not reader.data_folder.isfile(path):
        return None
    with reader.data_folder.open(path, "rb") as f:
        return f.read()


class _CaptionedFileReader(K3Reader):
    """One media file per record; its caption is the same-stem `.txt` file."""

    extensions: tuple[str, ...] = ()
    media_type: MediaType = MediaType.IMAGE

    def accepts(self, filepath: str) -> bool:
        return filepath.lower().endswith(self.extensions)

    def records(self, filepath: str) -> Iterator:
        with self.data_folder.open(filepath, "rb") as f:
            data = f.read()
        yield RawRecord(0, len(data), lambda: self._document(filepath, data))

    def _document(self, filepath: str, data: bytes) -> Document:
        caption = _read_sibling(self, posixpath.splitext(filepath)[0] + ".txt")
        text = _caption(caption, f"caption of {filepath}")
        return self.make_document(filepath, 0, text, len(data),
                                  [_media(data, self.media_type, filepath)])


class ImageFolderReader(_CaptionedFileReader):
    """A folder of images with captions."""

    extensions = IMAGE_EXTENSIONS
    media_type = MediaType.IMAGE


class FrameFolderReader(K3Reader):
    """One folder per video: frame images (in name order) and `caption.txt`."""

    default_glob = "*/caption.txt"

    def records(self, filepath: str) -> Iterator:
        folder = posixpath.dirname(filepath)
        frames = sorted(p for p in self.data_folder.list_files(folder, recursive=False)
                        if p.lower().endswith(IMAGE_EXTENSIONS))
        media = []
        for p in frames:
            with self.data_folder.open(p, "rb") as f:
                media.append(_media(f.read(), MediaType.VIDEO, p))
        with self.data_folder.open(filepath, "rb") as f:
            caption = f.read()
        nbytes = len(caption) + sum(len(m.media_bytes) for m in media)
        yield RawRecord(0, nbytes, lambda: self._document(filepath, caption, media, nbytes))

    def _document(self, filepath: str, caption: bytes, media: list[Media], nbytes: int):
        folder = posixpath.dirname(filepath)
        if not media:
            raise RecordProblem("missing_image", f"no frames in {folder}")
        text = _caption(caption, f"caption of {folder}")
        return self.make_document(filepath, 0, text, nbytes, media)


class VideoFileReader(_CaptionedFileReader):
    """Animated image files (GIF, animated WebP/PNG) with captions; frames are sampled later."""

    extensions = VIDEO_EXTENSIONS
    media_type = MediaType.VIDEO


READERS = {"jsonl": JsonlTextReader, "parquet": ParquetTextReader,
           "webdataset": WebDatasetImageReader, "image_folder": ImageFolderReader,
           "frame_folder": FrameFolderReader, "video_files": VideoFileReader}


def build_reader(source: SourceConfig, source_index: int, output_dir: str,
                 progress: bool) -> K3Reader:
    return READERS[source.format](source, source_index, output_dir, progress)
