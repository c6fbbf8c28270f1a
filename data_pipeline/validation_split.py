"""The held-out validation split: a document goes to it when the hash of its content falls below
`data.validation_fraction`, so the split is the same on every re-run, for any number of tasks or
workers, and a duplicate can never sit on both sides (dedup keeps one copy, and copies hash
alike). Held-out documents are written as shards under <output_dir>/validation/<source>/ and
listed under "validation" in the manifest; the training loader never reads them."""

from __future__ import annotations

import hashlib

VALIDATION_DIR = "validation"


def is_held_out(text: str, media: list[bytes], fraction: float) -> bool:
    h = hashlib.sha256(text.encode("utf-8"))
    for blob in media:
        h.update(blob)
    return int.from_bytes(h.digest()[:8], "big") < fraction * 2**64
