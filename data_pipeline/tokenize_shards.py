"""The tokenize stage: tokenizer training (one task) and tokenization into shards (every task).

Token layout of a document:
    text   <text tokens> <eod>
    image  <image> x n  <caption tokens> <eod>
    video  <video> <image> x n  <caption tokens> <eod>
    chat   the conversation rendered with the chat template and tokenized (chat.encode_chat),
           each picture's one <image> expanded to <image> x n; no <eod>. Its loss mask (the
           assistant's tokens; never a placeholder) goes beside the tokens (shards.py)
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
from tokenizers import Tokenizer

from model.errors import ConfigError
from model.vision.layout import vision_token_count

from .chat import encode_chat, load_chat_template
from .config import DataConfig, TokenizerConfig, resolve_path
from .conversations import refusal_reason
from .dedup import load_duplicates
from .filters import VISUAL
from .longdoc import generate_long_document
from .records import LedgerWriter
from .shards import Picture, ShardWriter
from .tokenizer import (
    EOD_ID,
    IMAGE_ID,
    RESERVED_TOKENS,
    VIDEO_ID,
    check_chat_special_tokens,
    load_tokenizer,
    train_tokenizer,
)
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


def check_tokenizer_inputs(cfg: DataConfig, path: str = "data") -> None:
    """Before a run reads anything: a given tokenizer (tokenizer.path) loads, and with chat
    sources the chat template loads and the given tokenizer holds the chat tokens it uses (an
    SFT run takes the pre-training run's tokenizer, which must reserve them)."""
    given = cfg.tokenizer.path
    if given is not None and not Path(resolve_path(given)).is_file():
        raise ConfigError(f"{path}.tokenizer.path={given!r} is invalid: no such file "
                          f"({Path(resolve_path(given)).resolve()})")
    tok = load_tokenizer(resolve_path(given)) if given is not None else None
    try:
        template = chat_template_of(cfg)
    except ConfigError as e:
        raise ConfigError(f"{path}.chat_template={cfg.chat_template!r} is invalid: {e}") from e
    if template is not None and tok is not None:
        check_chat_special_tokens(tok, f"{path}.tokenizer.path={given!r}",
                                  [t for t in RESERVED_TOKENS if t in template])


def chat_template_of(cfg: DataConfig) -> str | None:
    """The text of data.chat_template (null: the K3 default); None without chat sources."""
    if not any(s.modality == "chat" for s in cfg.sources):
        return None
    return load_chat_template(None if cfg.chat_template is None
                              else resolve_path(cfg.chat_template))


def document_tokens(doc: Document, text_ids: list[int],
                    cfg: DataConfig) -> tuple[list[int], list[int]]:
    """(token ids, offset of each picture's placeholders) of a text, image or video document."""
    modality = doc.metadata["modality"]
    if modality == "text":
        return text_ids + [EOD_ID], []
    (n,) = vision_token_count(doc.metadata["grid_thws"], cfg.image.vision)
    prefix = [VIDEO_ID] if modality == "video" else []
    return prefix + [IMAGE_ID] * n + text_ids + [EOD_ID], [len(prefix)]


def chat_tokens(doc: Document, tok: Tokenizer, chat_template: str,
                cfg: DataConfig) -> tuple[list[int], list[bool], list[int]]:
    """(token ids, loss mask, offset of each picture's placeholders) of a conversation: its
    encode_chat ids with each <image> expanded to its picture's placeholders (mask False).
    Raises ValueError as encode_chat does, or when the template did not render one <image> per
    picture."""
    meta = doc.metadata
    ids, mask = encode_chat(meta["messages"], tok, chat_template, meta["tools"])
    counts = vision_token_count(meta.get("grid_thws", []), cfg.image.vision)
    if ids.count(IMAGE_ID) != len(counts):
        raise ValueError(f"the chat template rendered {ids.count(IMAGE_ID)} <image> tokens for "
                         f"the conversation's {len(counts)} pictures")
    out_ids: list[int] = []
    out_mask: list[bool] = []
    offsets: list[int] = []
    pictures = iter(counts)
    for token, learned in zip(ids, mask):
        if token == IMAGE_ID:
            n = next(pictures)
            offsets.append(len(out_ids))
            out_ids += [IMAGE_ID] * n
            out_mask += [False] * n
        else:
            out_ids.append(token)
            out_mask.append(learned)
    return out_ids, out_mask, offsets


def pictures_of(doc: Document, offsets: list[int]) -> list[Picture]:
    """(placeholder offset, grid_thw, PNG frames) of each of the document's pictures."""
    out, first = [], 0
    for offset, grid in zip(offsets, doc.metadata.get("grid_thws", [])):
        out.append((offset, grid, [m.media_bytes for m in doc.media[first:first + grid[0]]]))
        first += grid[0]
    return out


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

        def writer(source: str, modality: str, folder: str = "shards") -> ShardWriter:
            if (folder, source) not in writers:
                prefix = Path(self.output_dir) / folder / source / f"{rank:05d}"
                writers[folder, source] = ShardWriter(prefix, vocab, masked=modality == "chat")
            return writers[folder, source]

        seq_len = self.cfg.pack.seq_len
        chat_template = chat_template_of(self.cfg)
        with LedgerWriter(self.output_dir, "tokenize") as ledger:
            for batch in batched(data, ENCODE_BATCH):
                written = []
                with self.track_time("batch"):
                    # conversations are rendered one by one, the other texts in one call
                    encoded = iter(tok.encode_batch(
                        [d.text for d in batch if d.metadata["modality"] != "chat"],
                        add_special_tokens=False))
                    for doc in batch:
                        meta = doc.metadata
                        mask = None
                        if meta["modality"] != "chat":
                            ids, offsets = document_tokens(doc, next(encoded).ids, self.cfg)
                        else:
                            try:
                                ids, mask, offsets = chat_tokens(doc, tok, chat_template,
                                                                 self.cfg)
                            except ValueError as e:  # e.g. a special token of this tokenizer
                                meta.update(k3_outcome="quarantined",
                                            k3_reason=refusal_reason(e), k3_detail=str(e))
                                ledger.write(doc, rank)
                                continue
                        if meta["modality"] in VISUAL and len(ids) > seq_len:
                            meta.update(k3_reason="vision_doc_exceeds_seq_len",
                                        k3_detail=f"{len(ids)} tokens > {seq_len}")
                            ledger.write(doc, rank)
                            continue
                        media = [m.media_bytes for m in doc.media]
                        held_out = is_held_out(doc.text, media, self.cfg.validation_fraction)
                        folder = VALIDATION_DIR if held_out else "shards"
                        writer(meta["source"], meta["modality"], folder).add(
                            doc.id, meta["origin"], meta["modality"], np.asarray(ids),
                            pictures_of(doc, offsets), doc.text,
                            {"file": meta.get("file"), "line": meta.get("line"),
                             "record_id": meta.get("orig_id")}, mask)
                        self.stat_update("tokens", value=len(ids))
                        written.append(doc)
                yield from written
        long_docs = self.cfg.long_docs
        if long_docs.num_docs:
            for i in range(rank, long_docs.num_docs, world_size):
                sample = generate_long_document(tok, seq_len, long_docs.seed * 100003 + i,
                                                long_docs.hops, long_docs.distractor_chains)
                writer(SYNTHETIC_SOURCE, "text").add(f"{SYNTHETIC_SOURCE}/{i}", "synthetic",
                                                     "text", np.asarray(sample.tokens))
        for w in writers.values():
            w.finalize(seq_len, self.cfg.pack.max_docs_per_row, self.cfg.chat_overflow)
