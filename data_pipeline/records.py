"""Record accounting: every input record ends as kept, filtered (reason), duplicate (reason) or
quarantined (reason). Records that leave the pipeline are written to a ledger, one JSONL file per
stage and task under <output_dir>/ledger/<stage>/; kept records are the documents in the shards.

Document metadata keys used across the stages:
    source, modality ("text" | "image" | "video" | "chat"), order (global sort key: source
    index, file, record index; decides which copy of a duplicate is kept), orig_id (the record's
    own id field), file and line (where the record was read), origin ("input" for raw records,
    "rephrased" / "synthetic" for documents the pipeline made), bytes (raw size); for pictures
    raw_sizes and grid_thws (media.py); for a conversation messages and tools (the record's).

A ledger line: id, source, file, line, record_id, origin, stage, outcome, reason, detail, raw
(an excerpt of a record that could not be parsed), bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO

from datatrove.data import Document
from datatrove.pipeline.writers.disk_base import DiskWriter

from . import logs  # noqa: F401  (quiet datatrove task logs, in workers and jobs too)

RAW_EXCERPT_BYTES = 200


def excerpt(raw: bytes | str | None) -> str | None:
    """A printable prefix of a bad record, for people reading the quarantine."""
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "backslashreplace")
    return raw[:RAW_EXCERPT_BYTES].decode("utf-8", "backslashreplace")


def ledger_doc(doc_id: str, source: str, outcome: str, reason: str, detail: str | None = None,
               raw: bytes | str | None = None, nbytes: int = 0, file: str | None = None,
               line: int | None = None, orig_id=None) -> Document:
    """A stand-in Document for a record that never became a document (e.g. a malformed line)."""
    return Document(text="", id=doc_id, metadata={
        "source": source, "k3_outcome": outcome, "k3_reason": reason, "k3_detail": detail,
        "k3_raw": excerpt(raw), "bytes": nbytes, "origin": "input", "file": file,
        "line": line, "orig_id": orig_id})


class LedgerWriter(DiskWriter):
    """Writes one ledger line per document it is given (datatrove filters call it as their
    exclusion_writer, with metadata["filter_reason"] set)."""

    name = "ledger"
    type = "ACCOUNTING"

    def __init__(self, output_dir: str, stage: str, outcome: str = "filtered"):
        super().__init__(f"{output_dir}/ledger/{stage}", output_filename="${rank}.jsonl",
                         compression=None, mode="wt")
        self.stage = stage
        self.outcome = outcome

    def _default_adapter(self, document: Document) -> dict:
        meta = document.metadata
        return {
            "id": document.id,
            "source": meta.get("source"),
            "file": meta.get("file"),
            "line": meta.get("line"),
            "record_id": meta.get("orig_id"),
            "origin": meta.get("origin", "input"),
            "stage": self.stage,
            "outcome": meta.get("k3_outcome", self.outcome),
            "reason": meta.get("k3_reason") or meta.get("filter_reason") or self.stage,
            "detail": meta.get("k3_detail"),
            "raw": meta.get("k3_raw"),
            "bytes": meta.get("bytes", 0),
        }

    def _write(self, document: dict, file_handler: IO, filename: str) -> None:
        file_handler.write(json.dumps(document) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_ledger(output_dir: str | Path) -> list[dict]:
    """All ledger records of a run, in a stable order."""
    root = Path(output_dir) / "ledger"
    return [rec for path in sorted(root.glob("*/*.jsonl")) for rec in read_jsonl(path)]


def write_json(path: Path, obj) -> None:
    """Write-then-rename, so a reader never sees half a file (the manifest marks completion)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
    tmp.replace(path)
