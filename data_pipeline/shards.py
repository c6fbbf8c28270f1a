"""Shards: one per (source, task), files sharing the prefix shards/<source>/<task>:

    .bin / .idx      Megatron indexed dataset (written by megatron-core's builder, read by
                     IndexedTokens); one sequence (and one Megatron document) per kept document,
                     <eod> included (a conversation has none: cu_seqlens separates documents)
    .mask.bin / .idx chat shards only: the loss mask, a Megatron indexed dataset of uint8 with
                     the same sequence lengths, 1 on the assistant's tokens (the tokens that are
                     training targets), 0 elsewhere (image placeholders included)
    .docs.jsonl      per sequence: id, origin, modality, tokens and, for documents read from
                     an input record, its file, line and record_id (as in the ledger)
    .tar             WebDataset shard of the pixels: per picture <key>.png (an image or a
                     conversation's picture) or <key>.<frame>.png (video frames) and <key>.json
                     {id, grid_thw}, with <key> = the sequence (9 digits) for its first picture
                     and <sequence>_<i> for a conversation's further ones; <key>.txt caption
                     (a conversation's canonical text) with the first picture
    .media.npy       int64 [M, 7]: sequence, placeholder offset, t, h, w, first frame, frames;
                     one row per picture, a sequence's rows in placeholder order
    .frames.npy      int64 [F, 2]: byte offset and size of each frame's PNG inside the .tar
    .pack<T>x<S>.npy pack plan for rows of T tokens with S document slots (packing.py)
    .json            counts (tokens: stored, packed_tokens: in the rows at pack.seq_len); a
                     chat shard's also say how many conversations longer than the row were
                     truncated and dropped (data.chat_overflow) at pack.seq_len
"""

from __future__ import annotations

import io
import json
import struct
import tarfile
from pathlib import Path

import numpy as np

from .packing import fit_conversations, pack_rows
from .records import write_json
from .tokenizer import IMAGE_ID

MEDIA_COLUMNS = ("seq", "token_offset", "t", "h", "w", "first_frame", "num_frames")


def pack_plan_path(prefix: str | Path, seq_len: int, max_docs_per_row: int) -> Path:
    return Path(f"{prefix}.pack{seq_len}x{max_docs_per_row}.npy")


def _tar_add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


Picture = tuple[int, list[int], list[bytes]]  # placeholder offset, grid_thw, PNG frames


def _picture_key(seq: int, index: int) -> str:
    return f"{seq:09d}" if index == 0 else f"{seq:09d}_{index}"


class ShardWriter:
    def __init__(self, prefix: Path, vocab_size: int, masked: bool = False):
        """`masked`: the shard holds conversations, each with a loss mask."""
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

        self.prefix = prefix
        prefix.parent.mkdir(parents=True, exist_ok=True)
        self.builder = IndexedDatasetBuilder(f"{prefix}.bin",
                                             dtype=DType.optimal_dtype(vocab_size))
        self.masks = (IndexedDatasetBuilder(f"{prefix}.mask.bin", dtype=np.uint8) if masked
                      else None)
        self.docs = open(f"{prefix}.docs.jsonl", "w", encoding="utf-8")
        self.tar: tarfile.TarFile | None = None
        self.media: list[tuple[int, ...]] = []
        self.frame_names: list[str] = []
        self.lengths: list[int] = []
        self.counts = {"docs": 0, "tokens": 0, "input_docs": 0, "images": 0, "videos": 0}

    def add(self, doc_id: str, origin: str, modality: str, tokens: np.ndarray,
            pictures: list[Picture] = (), caption: str = "", record: dict | None = None,
            mask: np.ndarray | None = None) -> None:
        """`pictures` in placeholder order; `record`: where the document was read (file, line,
        record_id); `mask`: the loss mask of a conversation (one per token)."""
        import torch

        if (mask is None) != (self.masks is None) or (mask is not None
                                                      and len(mask) != len(tokens)):
            raise ValueError(f"{doc_id}: a shard of conversations needs one loss mask value "
                             f"per token, other shards none ({self.prefix})")
        seq = len(self.lengths)
        self.builder.add_item(torch.from_numpy(np.asarray(tokens, dtype=np.int64)))
        self.builder.end_document()
        if self.masks is not None:
            self.masks.add_item(torch.from_numpy(np.asarray(mask, dtype=np.uint8)))
            self.masks.end_document()
        self.lengths.append(len(tokens))
        self.docs.write(json.dumps({"id": doc_id, "origin": origin, "modality": modality,
                                    "tokens": len(tokens), **(record or {})}) + "\n")
        self.counts["docs"] += 1
        self.counts["tokens"] += len(tokens)
        self.counts["input_docs"] += origin == "input"
        for index, picture in enumerate(pictures):
            self._add_pixels(seq, index, doc_id, modality, picture, caption)

    def _add_pixels(self, seq: int, index: int, doc_id: str, modality: str, picture: Picture,
                    caption: str) -> None:
        placeholder_offset, grid_thw, frames = picture
        if self.tar is None:
            self.tar = tarfile.open(f"{self.prefix}.tar", "w", format=tarfile.USTAR_FORMAT)
        key = _picture_key(seq, index)
        names = ([f"{key}.{i:03d}.png" for i in range(len(frames))] if modality == "video"
                 else [f"{key}.png"])
        for name, data in zip(names, frames):
            _tar_add(self.tar, name, data)
        if index == 0:
            _tar_add(self.tar, f"{key}.txt", caption.encode("utf-8"))
        _tar_add(self.tar, f"{key}.json", json.dumps({"id": doc_id,
                                                      "grid_thw": grid_thw}).encode("utf-8"))
        self.media.append((seq, placeholder_offset, *grid_thw, len(self.frame_names),
                           len(frames)))
        self.frame_names += names
        self.counts["videos" if modality == "video" else "images"] += 1

    def finalize(self, seq_len: int, max_docs_per_row: int,
                 chat_overflow: str = "truncate") -> dict:
        """Closes the files, writes the indexes and the pack plan; returns the counts."""
        self.builder.finalize(f"{self.prefix}.idx")
        if self.masks is not None:
            self.masks.finalize(f"{self.prefix}.mask.idx")
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
        # the plan as the loader computes it, from the files just written
        reader = ShardReader(self.prefix, chat_overflow)
        plan = reader.compute_plan(seq_len, max_docs_per_row)
        np.save(pack_plan_path(self.prefix, seq_len, max_docs_per_row), plan)
        rows = int(plan[-1, 0]) + 1 if len(plan) else 0
        self.counts.update(rows=rows, seq_len=seq_len, max_docs_per_row=max_docs_per_row,
                           packed_tokens=int(plan[:, 3].sum()))
        if reader.is_chat:
            _, truncated, dropped = reader.fit(seq_len)
            self.counts.update(truncated=truncated, dropped=dropped)
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
    """Random access to one shard: token slices, loss masks, vision items and their decoded
    frames. Opens files lazily so that it can be pickled into loader worker processes.
    `chat_overflow` (data.chat_overflow): what packing does with a conversation longer than
    the row."""

    def __init__(self, prefix: str | Path, chat_overflow: str = "truncate"):
        self.prefix = str(prefix)
        self.chat_overflow = chat_overflow
        self._dataset = None
        self._masks = None
        self.is_chat = Path(f"{self.prefix}.mask.idx").exists()
        self.media = np.load(f"{self.prefix}.media.npy")
        self.frames = np.load(f"{self.prefix}.frames.npy")
        by_seq: dict[int, list[np.ndarray]] = {}
        for row in self.media:  # written in placeholder order
            by_seq.setdefault(int(row[0]), []).append(row)
        self._media_by_seq = {seq: np.stack(rows) for seq, rows in by_seq.items()}
        self._no_media = np.zeros((0, len(MEDIA_COLUMNS)), dtype=np.int64)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_dataset": None, "_masks": None}

    @property
    def dataset(self):
        if self._dataset is None:
            self._dataset = IndexedTokens(self.prefix)
        return self._dataset

    @property
    def masks(self) -> IndexedTokens:
        if self._masks is None:
            self._masks = IndexedTokens(f"{self.prefix}.mask")
        return self._masks

    @property
    def sequence_lengths(self) -> np.ndarray:
        return np.asarray(self.dataset.sequence_lengths, dtype=np.int64)

    def splittable(self) -> np.ndarray:
        """Text documents may be split over rows; documents with pictures and conversations
        may not."""
        out = np.full(len(self.dataset), not self.is_chat)
        out[self.media[:, 0]] = False
        return out

    def tokens(self, seq: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        # a copy: the dataset's arrays view its memory map, which closes with the dataset
        return np.array(self.dataset.get(seq, offset, length), dtype=np.int64)

    def mask(self, seq: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """The loss mask (bool) of a conversation's tokens offset .. offset + length."""
        return np.array(self.masks.get(seq, offset, length), dtype=bool)

    def vision_items(self, seq: int) -> np.ndarray:
        """The MEDIA_COLUMNS rows of a sequence's pictures in placeholder order ([0, 7] for
        text)."""
        return self._media_by_seq.get(seq, self._no_media)

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

    def truncatable(self, seq: int, length: int) -> bool:
        """Whether a conversation's first `length` tokens may stand for it: some of them (past
        the first, which is no target) are the assistant's, and the cut is not inside a
        picture's placeholders (every <image> of a conversation is one)."""
        if not self.mask(seq, 1, length - 1).any():
            return False
        return int(self.dataset.get(seq, length, 1)[0]) != IMAGE_ID or \
            length in self.vision_items(seq)[:, 1]

    def fit(self, seq_len: int) -> tuple[np.ndarray, int, int]:
        """(packed length of each sequence, conversations truncated, conversations dropped) for
        rows of seq_len tokens (packing.fit_conversations; other shards: their lengths)."""
        if not self.is_chat:
            return self.sequence_lengths, 0, 0
        return fit_conversations(self.sequence_lengths, seq_len, self.chat_overflow,
                                 self.truncatable)

    def compute_plan(self, seq_len: int, max_docs_per_row: int) -> np.ndarray:
        return pack_rows(self.fit(seq_len)[0], self.splittable(), seq_len, max_docs_per_row)

    def plan(self, seq_len: int, max_docs_per_row: int) -> np.ndarray:
        """The stored pack plan when one was written for this layout, else computed (the same
        function wrote it, so both agree)."""
        path = pack_plan_path(self.prefix, seq_len, max_docs_per_row)
        if path.exists():
            return np.load(path)
        return self.compute_plan(seq_len, max_docs_per_row)
