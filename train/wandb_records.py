"""Reads the records of an offline W&B run file (`run-<id>.wandb`).

The installed wandb has no Python reader for its transaction log, so this decodes it: a 7-byte
header (":W&B", a 2-byte magic, a version byte), then 32 KiB blocks of LevelDB-style log records
(CRC32 4 bytes, length 2 bytes little-endian, type 1 byte: full/first/middle/last), whose payloads
are `wandb_internal_pb2.Record` protobuf messages. Used by tests and for quick inspection of runs
on machines without W&B access.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

from wandb.proto import wandb_internal_pb2

HEADER = 7
BLOCK = 32 * 1024
RECORD_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> Iterator[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run file (missing ':W&B' header)")
    pos, pending = HEADER, b""
    while pos + RECORD_HEADER <= len(data):
        block_left = BLOCK - (pos % BLOCK)
        if block_left < RECORD_HEADER:  # zero padding at the end of a block
            pos += block_left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + RECORD_HEADER])
        if kind == 0 and length == 0:  # preallocated, unwritten space
            break
        chunk = data[pos + RECORD_HEADER:pos + RECORD_HEADER + length]
        pos += RECORD_HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""


def read_records(path: str | Path) -> list:
    """All protobuf Records of a run file, in write order."""
    out = []
    for payload in _payloads(Path(path).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        out.append(record)
    return out


def read_history(path: str | Path) -> list[dict]:
    """The logged history rows (`run.log` calls) as dicts of decoded values."""
    rows = []
    for record in read_records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        rows.append(row)
    return rows


def run_id(path: str | Path) -> str | None:
    for record in read_records(path):
        if record.WhichOneof("record_type") == "run":
            return record.run.run_id
    return None


def branch_point(path: str | Path) -> tuple[str, float] | None:
    """(run id, step) the run file rewinds to (`wandb.init(resume_from=...)`), None if none."""
    for record in read_records(path):
        if record.WhichOneof("record_type") == "run" and record.run.HasField("branch_point"):
            return record.run.branch_point.run, record.run.branch_point.value
    return None


def run_history(paths: list[str | Path]) -> list[dict]:
    """The history a sequence of run files of one run adds up to once synced: a file that rewinds
    to step s drops the rows past s before adding its own."""
    rows: list[dict] = []
    for path in paths:
        rewind = branch_point(path)
        if rewind is not None:
            rows = [r for r in rows if r["_step"] <= rewind[1]]
        rows += read_history(path)
    return rows
