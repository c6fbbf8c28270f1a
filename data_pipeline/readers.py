"""Readers for raw sources, as datatrove readers (each task reads its shard of the files).

Every record a reader meets is counted; records that cannot become a document (malformed JSON,
non-UTF-8 text, no or empty text, a missing image or caption, an unreadable file, a
conversation without messages, one the chat template refuses or with nothing to learn) go to
the quarantine ledger with the reason instead of raising. Counts per task are written to
<output_dir>/counts/read/<source>/<rank>.json. Which files are read: sources.py.

Each document (and each ledger line) names its record: metadata "file" (the path read), "line"
(1-based line of a JSONL file, row of a Parquet file, sample of a tar shard; null for a file
that is one record) and "orig_id" (the record's own `id_key` field, where it has one).
"""

from __future__ import annotations

import json
import os
import posixpath
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from datatrove.data import Document, DocumentsPipeline, Media, MediaType
from datatrove.pipeline.readers.base import BaseDiskReader
from tqdm import tqdm

from .chat import render_chat
from .config import SourceConfig, resolve_path
from .conversations import chat_text, image_parts, picture_digest, refusal_reason
from .records import LedgerWriter, ledger_doc, write_json
from .sources import IMAGE_EXTENSIONS, list_source_files


class RecordProblem(Exception):
    """A record that must be quarantined (reason, detail; its own id where it was read)."""

    def __init__(self, reason: str, detail: str = "", orig_id=None):
        super().__init__(reason)
        self.reason = reason
        self.detail = detail
        self.orig_id = orig_id


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
    line: int | None = None  # 1-based line / row / sample number in its file


class K3Reader(BaseDiskReader):
    """Shared plumbing: file sharding over tasks, ids, metadata, counting and quarantine.
    Subclasses implement `records(filepath)` yielding RawRecords."""

    type = "READER"
    default_text_key = "text"

    def __init__(self, source: SourceConfig, source_index: int, output_dir: str,
                 progress: bool = False):
        base, self.files = list_source_files(resolve_path(source.path), source.format,
                                             source.glob, f"data.sources[{source_index}].path")
        super().__init__(base, doc_progress=progress,
                         text_key=source.text_key or self.default_text_key, id_key=source.id_key)
        self.base = base
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
                      position: int | None = None, line: int | None = None) -> Document:
        """`position`: the record's index in its file (defaults to an integer key)."""
        order = self.order_key(filepath, key if position is None else position)
        return Document(text=text, id=self.doc_id(filepath, key), media=media or [], metadata={
            "source": self.source.name, "modality": self.source.modality, "order": order,
            "orig_id": orig_id, "origin": "input", "bytes": nbytes,
            "rephrase": self.source.rephrase, "file": self.path_of(filepath), "line": line})

    def path_of(self, filepath: str) -> str:
        return os.path.join(self.base, filepath)

    def read_file(self, filepath: str) -> DocumentsPipeline:
        for record in self.records(filepath):
            self.records_read += 1
            self.bytes_read += record.nbytes
            try:
                yield record.build()
            except RecordProblem as p:
                self.ledger.write(ledger_doc(
                    self.doc_id(filepath, record.key), self.source.name, "quarantined",
                    p.reason, p.detail, record.raw, record.nbytes, file=self.path_of(filepath),
                    line=record.line, orig_id=p.orig_id), self.rank)

    def records(self, filepath: str) -> Iterator[RawRecord]:
        raise NotImplementedError

    def run(self, data: DocumentsPipeline = None, rank: int = 0,
            world_size: int = 1) -> DocumentsPipeline:
        if data:
            yield from data
        files = self.files
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


def json_object(raw: bytes, index: int) -> dict:
    """The JSON object on line `index` (0-based) of a JSONL file."""
    line = decode_text(raw, f"line {index + 1}")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise RecordProblem("malformed_json", f"line {index + 1}: {e}") from None
    if not isinstance(obj, dict):
        raise RecordProblem("malformed_json", f"line {index + 1} is not a JSON object")
    return obj


class _JsonlReader(K3Reader):
    """One JSON object per line; blank lines are not records. Subclasses build the document
    from the line's object in `_document`."""

    def records(self, filepath: str) -> Iterator:
        with self.data_folder.open(filepath, "rb") as f:
            for index, raw in enumerate(f):
                if raw.strip():
                    yield RawRecord(index, len(raw),
                                    lambda r=raw, i=index: self._line(filepath, i, r), raw,
                                    line=index + 1)

    def _line(self, filepath: str, index: int, raw: bytes) -> Document:
        obj = json_object(raw, index)
        orig_id = obj.get(self.id_key)
        try:
            return self._document(filepath, index, obj, len(raw), orig_id)
        except RecordProblem as p:
            p.orig_id = orig_id
            raise

    def _document(self, filepath: str, index: int, obj: dict, nbytes: int, orig_id) -> Document:
        raise NotImplementedError

    def _read_beside(self, filepath: str, image, where: str) -> tuple[str, bytes]:
        """(path, bytes) of the picture file `image` names, relative to the JSONL file's folder
        (or absolute); a missing name or file is a missing_image problem."""
        if not isinstance(image, str) or not image:
            raise RecordProblem("missing_image", f"{where} is {image!r}, not a picture's path")
        path = os.path.normpath(os.path.join(os.path.dirname(self.path_of(filepath)), image))
        try:
            with open(path, "rb") as f:
                return path, f.read()
        except OSError as e:
            raise RecordProblem("missing_image", f"{where}: {image!r} -> {path}: "
                                                 f"{e.strerror}") from None


class JsonlTextReader(_JsonlReader):
    """Text in the `text_key` field of each line."""

    def _document(self, filepath: str, index: int, obj: dict, nbytes: int, orig_id) -> Document:
        text = check_text(obj.get(self.text_key), f"field {self.text_key!r}")
        return self.make_document(filepath, index, text, nbytes, orig_id=orig_id,
                                  line=index + 1)


class ImageTextReader(_JsonlReader):
    """Image-caption pairs, one per line: {"caption": ..., "image": "path", "metadata": {...}}
    with the image path relative to the JSONL file's folder (or absolute) and the optional
    metadata object kept in the document's metadata["record_metadata"]. A missing image is
    quarantined here, an undecodable one by DecodeMedia."""

    default_text_key = "caption"

    def __init__(self, source: SourceConfig, source_index: int, output_dir: str,
                 progress: bool = False):
        super().__init__(source, source_index, output_dir, progress)
        self.image_key = source.image_key

    def _document(self, filepath: str, index: int, obj: dict, nbytes: int, orig_id) -> Document:
        where = f"line {index + 1}"
        if obj.get(self.text_key) is None:
            raise RecordProblem("missing_caption", f"{where} has no {self.text_key!r}")
        text = check_text(obj[self.text_key], f"field {self.text_key!r} of {where}")
        path, data = self._read_beside(filepath, obj.get(self.image_key),
                                       f"{where}: {self.image_key!r}")
        metadata = obj.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise RecordProblem("malformed_json", f"{where}: 'metadata' is "
                                                  f"{type(metadata).__name__}, not an object")
        doc = self.make_document(filepath, index, text, nbytes + len(data),
                                 [_media(data, MediaType.IMAGE, path)], orig_id, line=index + 1)
        doc.metadata["record_metadata"] = metadata
        return doc


class ChatReader(_JsonlReader):
    """Conversations, one per line (conversations.py). A conversation is checked as the chat
    template renders it (chat.render_chat; its ValueError becomes the quarantine detail), its
    pictures are read (a path relative to the JSONL file's folder, or absolute) and become the
    document's media in placeholder order; the document's text is conversations.chat_text and
    metadata "messages" and "tools" hold the record's fields for tokenization."""

    def __init__(self, source: SourceConfig, source_index: int, output_dir: str,
                 progress: bool, chat_template: str):
        super().__init__(source, source_index, output_dir, progress)
        self.chat_template = chat_template

    def _document(self, filepath: str, index: int, obj: dict, nbytes: int, orig_id) -> Document:
        where = f"line {index + 1}"
        messages, tools = obj.get("messages"), obj.get("tools")
        if not isinstance(messages, list) or not messages:
            raise RecordProblem("no_messages", f"{where}: 'messages' is {messages!r:.80}, not a "
                                               "non-empty list of messages")
        try:
            render_chat(messages, self.chat_template, tools)
        except ValueError as e:
            raise RecordProblem(refusal_reason(e), f"{where}: {e}") from None
        media, digests = [], []
        for field, image in image_parts(messages):
            path, data = self._read_beside(filepath, image, f"{where}: {field}.image")
            media.append(_media(data, MediaType.IMAGE, path))
            digests.append(picture_digest(data))
        doc = self.make_document(filepath, index, chat_text(messages, digests),
                                 nbytes + sum(len(m.media_bytes) for m in media), media,
                                 orig_id, line=index + 1)
        doc.metadata.update(messages=messages, tools=tools)
        return doc


class ParquetTextReader(K3Reader):
    """One row per record; an unreadable file is one quarantined record."""

    def records(self, filepath: str) -> Iterator:
        import pyarrow.parquet as pq

        try:
            with self.data_folder.open(filepath, "rb") as f:
                table = pq.read_table(f)
        except Exception as e:
            yield RawRecord(0, 0, _raise(RecordProblem("unreadable_file",
                                                       f"{type(e).__name__}: {e}")), line=None)
            return
        texts = (table.column(self.text_key).to_pylist() if self.text_key in table.column_names
                 else [None] * table.num_rows)
        ids = (table.column(self.id_key).to_pylist() if self.id_key in table.column_names
               else [None] * table.num_rows)
        for index, (text, orig_id) in enumerate(zip(texts, ids)):
            nbytes = len(text.encode("utf-8", "surrogatepass")) if isinstance(text, str) else 0
            yield RawRecord(index, nbytes, lambda t=text, i=index, o=orig_id, n=nbytes:
                            self._row(filepath, i, t, n, o),
                            text if isinstance(text, str) else None, line=index + 1)

    def _row(self, filepath: str, index: int, text, nbytes: int, orig_id) -> Document:
        try:
            text = check_text(text, f"column {self.text_key!r}")
        except RecordProblem as p:
            p.orig_id = orig_id
            raise
        return self.make_document(filepath, index, text, nbytes, orig_id=orig_id,
                                  line=index + 1)


def _caption(raw: bytes | None, what: str) -> str:
    if raw is None:
        raise RecordProblem("missing_caption", what)
    return check_text(decode_text(raw, what), what)


def _media(data: bytes, media_type: int, url: str) -> Media:
    return Media(id=url, type=media_type, url=url, media_bytes=data)


class WebDatasetImageReader(K3Reader):
    """WebDataset tar shards: members `<key>.<ext>` grouped by key; the image is the member with
    an image extension, the caption `<key>.txt` (or "caption" in `<key>.json`)."""

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
                         lambda: self._document(filepath, key, members, nbytes, position),
                         line=position + 1)

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
                                  position, line=position + 1)


def _read_sibling(reader: K3Reader, path: str) -> bytes | None:
    if not reader.data_folder.isfile(path):
        return None
    with reader.data_folder.open(path, "rb") as f:
        return f.read()


class _CaptionedFileReader(K3Reader):
    """One media file per record; its caption is the same-stem `.txt` file."""

    media_type: MediaType = MediaType.IMAGE

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

    media_type = MediaType.IMAGE


class FrameFolderReader(K3Reader):
    """One folder per video: frame images (in name order) and `caption.txt`."""

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

    media_type = MediaType.VIDEO


READERS = {"jsonl": JsonlTextReader, "parquet": ParquetTextReader,
           "webdataset": WebDatasetImageReader, "image_folder": ImageFolderReader,
           "image_text": ImageTextReader,
           "frame_folder": FrameFolderReader, "video_files": VideoFileReader}


def build_reader(source: SourceConfig, source_index: int, output_dir: str, progress: bool,
                 chat_template: str | None = None) -> K3Reader:
    """`chat_template`: the template's text, for chat sources."""
    if source.modality == "chat":
        return ChatReader(source, source_index, output_dir, progress, chat_template)
    return READERS[source.format](source, source_index, output_dir, progress)
