"""The tokenize stage: tokenizer training (one task) and tokenization into shards (every task).

Token layout of a document:
    text   <text tokens> <eod>
    image  <image> x n  <caption tokens> <eod>
    video  <video> <image> x n  <caption tokens> <eod>
with n = the merged-token count of the picture's patch grid (model.vision.vision_token_count).
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from datatrove.utils.batching import batched

from model.vision.layout import vision_token_count

from .config import DataConfig, TokenizerConfig, resolve_path
from .dedup import load_duplicates
from .longdoc import generate_long_document
from .records import LedgerWriter
from .shards import ShardWriter
from .tokenizer import EOD_ID, IMAGE_ID, VIDEO_ID, load_tokenizer, train_tokenizer
from .validation_split import VALIDATION_DIR, is_held_out

SYNTHETIC_SOURCE = "synthetic_long"
ENCODE_BATCH = 256


def tokenizer_path(output_dir: str | Path) -> Path:
    return Path(output_dir) / "tokenizer.json"


def kept_texts(work_dir: str) -> Iterator[str]:
    """Texts of the curated documents that dedup keeps, in a fixed order."""
    dups = load_duplicates(work_dir)
    for path in sorted((Path(work_dir) / "curated").glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                obj = json.loads(line)
                if obj["id"] not in dups:
                    yield obj["text"]


class TokenizerStep(PipelineStep):
    """Trains the byte-level BPE on the kept corpus, or copies the configured tokenizer file.
    When no document was kept there is no tokenizer (and nothing to tokenize)."""

    name = "tokenizer"
    type = "TOKENIZE"

    def __init__(self, cfg: TokenizerConfig, output_dir: str, work_dir: str, progress: bool):
        super().__init__()
        self.cfg = cfg
        self.output_dir = output_dir
        self.work_dir = work_dir
        self.progress = progress

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        if data:
            yield from data
        target = tokenizer_path(self.output_dir)
        texts = kept_texts(self.work_dir)
        first = next(texts, None)
        if first is None:
            return
        with self.track_time():
            if self.cfg.path is not None:
                load_tokenizer(resolve_path(self.cfg.path))  # checks the special-token ids
                shutil.copyfile(resolve_path(self.cfg.path), target)
            else:
                tok = train_tokenizer(itertools.chain([first], texts), self.cfg.vocab_size,
                                      self.cfg.min_frequency, self.progress)
                tok.save(str(target))


def document_tokens(doc: Document, text_ids: list[int], cfg: DataConfig) -> tuple[list[int], int]:
    """(token ids, offset of the first image placeholder)."""
    modality = doc.metadata["modality"]
    if modality == "text":
        return text_ids + [EOD_ID], 0
    (n,) = vision_token_count([doc.metadata["grid_thw"]], cfg.image.vision)
    prefix = [VIDEO_ID] if modality == "video" else []
    return prefix + [IMAGE_ID] * n + text_ids + [EOD_ID], len(prefix)


class TokenizeToShards(PipelineStep):
    name = "tokenize to shards"
    type = "TOKENIZE"

    def __init__(self, cfg: DataConfig, output_dir: str):
        super().__init__()
        self.cfg = cfg
        self.output_dir = output_dir

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        if not tokenizer_path(self.output_dir).exists():  # TokenizerStep found nothing kept
            if next(iter(data), None) is not None:
                raise RuntimeError(f"documents to tokenize but no {tokenizer_path('.')}")
            return
        tok = load_tokenizer(tokenizer_path(self.output_dir))
        vocab = tok.get_vocab_size()
        writers: dict[tuple[str, str], ShardWriter] = {}

        def writer(source: str, folder: str = "shards") -> ShardWriter:
            if (folder, source) not in writers:
                prefix = Path(self.output_dir) / folder / source / f"{rank:05d}"
                writers[folder, source] = ShardWriter(prefix, vocab)
            return writers[folder, source]

        seq_len = self.cfg.pack.seq_len
        with LedgerWriter(self.output_dir, "tokenize") as ledger:
            for batch in batched(data, ENCODE_BATCH):
                written = []
                with self.track_time("batch"):
                    encoded = tok.encode_batch([d.text for d in batch], add_special_tokens=False)
                    for doc, enc in zip(batch, encoded):
                        ids, offset = document_tokens(doc, enc.ids, self.cfg)
                        if doc.metadata["modality"] != "text" and len(ids) > seq_len:
                            doc.metadata.update(k3_reason="vision_doc_exceeds_seq_len",
                                                k3_detail=f"{len(ids)} tokens > {seq_len}")
                            ledger.write(doc, rank)
                            continue
                        meta = doc.metadata
                        media = [m.media_bytes for m in doc.media]
                        held_out = is_held_out(doc.text, media, self.cfg.validation_fraction)
                        folder = VALIDATION_DIR if held_out else "shards"
                        writer(meta["source"], folder).add(
                            doc.id, meta["origin"], meta["modality"], np.asarray(ids), offset,
                            meta.get("grid_thw"), media, doc.text,
                            {"file": meta.get("file"), "line": meta.get("line"),
                             "record_id": meta.get("orig_id")})
                        self.stat_update("tokens", value=len(ids))
                        written.append(doc)
                yield from written
        long_docs = self.cfg.long_docs
        if long_docs.num_docs:
            for i in range(rank, long_docs.num_docs, world_size):
                sample = generate_long_document(tok, seq_len, long_docs.seed * 100003 + i,
                                                long_docs.hops, long_docs.distractor_chains)
                writer(SYNTHETIC_SOURCE).add(f"{SYNTHETIC_SOURCE}/{i}", "synthetic", "text",
                                             np.asarray(sample.tokens))
        for w in writers.values():
            w.finalize(seq_len, self.cfg.pack.max_docs_per_row)
