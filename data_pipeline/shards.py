"""Shards: one per (source, task), files sharing the prefix shards/<source>/<task>:

    .bin / .idx      Megatron indexed dataset (written by megatron-core's builder, read by
                     IndexedTokens); one sequence (and one Megatron document) per kept document,
                     <eod> included
    .docs.jsonl      per sequence: id, origin, modality, tokens and, for documents read from
                     an input record, its file, line and record_id (as in the ledger)
    .tar             WebDataset shard of the pixels: <key>.png (image) or <key>.<frame>.png
                     (video frames), <key>.txt caption, <key>.json {id, grid_thw}
    .media.npy       int64 [M, 7]: sequence, placeholder offset, t, h, w, first frame, frames
    .frames.npy      int64 [F, 2]: byte offset and size of each frame's PNG inside the .tar
    .pack<T>x<S>.npy pack plan for rows of T tokens with S document slots (packing.py)
    .json            counts
"""

from __future__ import annotations

import io
import json
import struct
import tarfile
from pathlib import Path

import numpy as np

from .packing import pack_rows
from .records import write_json

MEDIA_COLUMNS = ("seq", "token_offset", "t", "h", "w", "first_frame", "num_frames")


def pack_plan_path(prefix: str | Path, seq_len: int, max_docs_per_row: int) -> Path:
    return Path(f"{prefix}.pack{seq_len}x{max_docs_per_row}.npy")


def _tar_add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


class ShardWriter:
    def __init__(self, prefix: Path, vocab_size: int):
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

        self.prefix = prefix
        prefix.parent.mkdir(parents=True, exist_ok=True)
        self.builder = IndexedDatasetBuilder(f"{prefix}.bin",
                                             dtype=DType.optimal_dtype(vocab_size))
        self.docs = open(f"{prefix}.docs.jsonl", "w", encoding="utf-8")
        self.tar: tarfile.TarFile | None = None
        self.media: list[tuple[int, ...]] = []
        self.frame_names: list[str] = []
        self.lengths: list[int] = []
        self.counts = {"docs": 0, "tokens": 0, "input_docs": 0, "images": 0, "videos": 0}

    def add(self, doc_id: str, origin: str, modality: str, tokens: np.ndarray,
            placeholder_offset: int = 0, grid_thw: list[int] | None = None,
            frames: list[bytes] = (), caption: str = "", record: dict | None = None) -> None:
        """`record`: where the document was read (file, line, record_id)."""
        import torch

        seq = len(self.lengths)
        self.builder.add_item(torch.from_numpy(np.asarray(tokens, dtype=np.int64)))
        self.builder.end_document()
        self.lengths.append(len(tokens))
        self.docs.write(json.dumps({"id": doc_id, "origin": origin, "modality": modality,
                                    "tokens": len(tokens), **(record or {})}) + "\n")
        self.counts["docs"] += 1
        self.counts["tokens"] += len(tokens)
        self.counts["input_docs"] += origin == "input"
        if frames:
            self._add_pixels(seq, doc_id, modality, placeholder_offset, grid_thw, frames, caption)

    def _add_pixels(self, seq: int, doc_id: str, modality: str, placeholder_offset: int,
                    grid_thw: list[int], frames: list[bytes], caption: str) -> None:
        if self.tar is None:
            self.tar = tarfile.open(f"{self.prefix}.tar", "w", format=tarfile.USTAR_FORMAT)
        key = f"{seq:09d}"
        names = ([f"{key}.png"] if modality == "image"
                 else [f"{key}.{i:03d}.png" for i in range(len(frames))])
        for name, data in zip(names, frames):
            _tar_add(self.tar, name, data)
        _tar_add(self.tar, f"{key}.txt", caption.encode("utf-8"))
        _tar_add(self.tar, f"{key}.json", json.dumps({"id": doc_id,
                                                      "grid_thw": grid_thw}).encode("utf-8"))
        self.media.append((seq, placeholder_offset, *grid_thw, len(self.frame_names),
                           len(frames)))
        self.frame_names += names
        self.counts["images" if modality == "image" else "videos"] += 1

    def finalize(self, seq_len: int, max_docs_per_row: int) -> dict:
        """Closes the files, writes the indexes and the pack plan; returns the counts."""
        self.builder.finalize(f"{self.prefix}.idx")
        self.docs.close()
        frames = np.zeros((0, 2), dtype=np.int64)
        if self.tar is not None:
            self.tar.close()
            with tarfile.open(f"{self.prefix}.tar") as tar:
                where = {m.name: (m.offset_data, m.size) for m in tar.getmembers()}
            frames = np.array([where[n] for n in self.frame_names], dtype=np.int64).reshape(-1, 2)
        media = np.array(self.media, dtype=np.int64).reshape(-1, len(MEDIA_COLUMNS))
        np.save(f"{self.prefix}.media.npy", media)
        np.save(f"{self.prefix}.frames.npy", frames)
        lengths = np.array(self.lengths, dtype=np.int64)
        splittable = np.ones(len(lengths), dtype=bool)
        splittable[media[:, 0]] = False
        plan = pack_rows(lengths, splittable, seq_len, max_docs_per_row)
        np.save(pack_plan_path(self.prefix, seq_len, max_docs_per_row), plan)
        rows = int(plan[-1, 0]) + 1 if len(plan) else 0
        self.counts.update(rows=rows, seq_len=seq_len, max_docs_per_row=max_docs_per_row)
        write_json(Path(f"{self.prefix}.json"), self.counts)
        return self.counts


class IndexedTokens:
    """The sequences of a Megatron indexed dataset (.idx version 1 and .bin), read through two
    numpy memory maps. megatron-core's IndexedDataset reads the same files (tests compare the
    two), but importing it imports the package's whole model-parallel stack, about 150 MiB
    resident in every training process that reads data."""

    _MAGIC = b"MMIDIDX\x00\x00"
    _HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents
    _DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
               7: np.float32, 8: np.uint16}

    def __init__(self, prefix: str | Path):
        index_path = f"{prefix}.idx"
        with open(index_path, "rb") as f:
            magic, version, code, count, _ = self._HEADER.unpack(f.read(self._HEADER.size))
        if magic != self._MAGIC or version != 1 or code not in self._DTYPES:
            raise ValueError(f"{index_path} is not a Megatron indexed dataset (version 1): "
                             f"header {magic!r}, version {version}, dtype code {code}")
        index = np.memmap(index_path, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(index, np.int32, count, self._HEADER.size)
        self._pointers = np.frombuffer(index, np.int64, count,
                                       self._HEADER.size + self.sequence_lengths.nbytes)
        dtype = np.dtype(self._DTYPES[code])
        bin_path = f"{prefix}.bin"
        self._tokens = (np.memmap(bin_path, mode="r", dtype=dtype)
                        if Path(bin_path).stat().st_size else np.empty(0, dtype))

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def get(self, seq: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens offset .. offset + length of sequence seq (to its end without length): a view
        of the memory map."""
        if length is None:
            length = int(self.sequence_lengths[seq]) - offset
        start = int(self._pointers[seq]) // self._tokens.itemsize + offset
        return self._tokens[start:start + length]


class ShardReader:
    """Random access to one shard: token slices, vision items and their decoded frames. Opens
    files lazily so that it can be pickled into loader worker processes."""

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        self._dataset = None
        self.media = np.load(f"{self.prefix}.media.npy")
        self.frames = np.load(f"{self.prefix}.frames.npy")
        self._media_by_seq = {int(row[0]): row for row in self.media}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_dataset": None}

    @property
    def dataset(self):
        if self._dataset is None:
            self._dataset = IndexedTokens(self.prefix)
        return self._dataset

    @property
    def sequence_lengths(self) -> np.ndarray:
        return np.asarray(self.dataset.sequence_lengths, dtype=np.int64)

    def splittable(self) -> np.ndarray:
        out = np.ones(len(self.dataset), dtype=bool)
        out[self.media[:, 0]] = False
        return out

    def tokens(self, seq: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        # a copy: the dataset's arrays view its memory map, which closes with the dataset
        return np.array(self.dataset.get(seq, offset, length), dtype=np.int64)

    def vision_item(self, seq: int) -> np.ndarray | None:
        """The MEDIA_COLUMNS row of a sequence's image/video, or None for text."""
        return self._media_by_seq.get(seq)

    def frame_pixels(self, item: np.ndarray) -> np.ndarray:
        """uint8 [T, H, W, 3] frames of a vision item."""
        from .imaging import decode_image

        first, count = int(item[5]), int(item[6])
        out = []
        with open(f"{self.prefix}.tar", "rb") as f:
            for offset, size in self.frames[first:first + count]:
                f.seek(int(offset))
                out.append(np.asarray(decode_image(f.read(int(size)))))
        return np.stack(out)

    def plan(self, seq_len: int, max_docs_per_row: int) -> np.ndarray:
        """The stored pack plan when one was written for this layout, else computed (the same
        function wrote it, so both agree)."""
        path = pack_plan_path(self.prefix, seq_len, max_docs_per_row)
        if path.exists():
            return np.load(path)
        return pack_rows(self.sequence_lengths, self.splittable(), seq_len, max_docs_per_row)
