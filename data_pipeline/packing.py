"""Packing documents into fixed-length rows without crossing document boundaries.

A pack plan is an int64 array [P, 4] of pieces (row, sequence, offset, length), ordered by row
and, within a row, by position. A text document longer than the row is split into row-sized
pieces (each piece is its own document in cu_seqlens); a document with image placeholders and a
conversation are never split. A conversation longer than the row is truncated to its first
seq_len tokens or dropped (fit_conversations) before packing. Rows are filled
best-fit-decreasing, so the plan depends only on the lengths (and, for conversations, on
where their loss tokens and pictures are).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np


def split_pieces(lengths: np.ndarray, splittable: np.ndarray,
                 seq_len: int) -> list[tuple[int, int, int]]:
    """(seq, offset, length) pieces of at most seq_len tokens."""
    pieces = []
    for seq, (n, can_split) in enumerate(zip(lengths.tolist(), splittable.tolist())):
        if n > seq_len and not can_split:
            raise ValueError(f"sequence {seq} has {n} tokens with image placeholders, more than "
                             f"the row length {seq_len}; it cannot be split")
        for offset in range(0, n, seq_len):
            pieces.append((seq, offset, min(seq_len, n - offset)))
    return pieces


def fit_conversations(lengths: np.ndarray, seq_len: int, overflow: str,
                      truncatable: Callable[[int, int], bool]) -> tuple[np.ndarray, int, int]:
    """(packed lengths, truncated, dropped) of conversations: one that fits the row is packed
    whole; a longer one keeps its first seq_len tokens where overflow is "truncate" and
    truncatable(seq, seq_len) allows it (the cut leaves a loss token and splits no picture),
    else it is dropped (length 0, which pack_rows leaves out)."""
    out = np.array(lengths, dtype=np.int64)
    truncated = dropped = 0
    for seq in np.flatnonzero(out > seq_len).tolist():
        if overflow == "truncate" and truncatable(seq, seq_len):
            out[seq], truncated = seq_len, truncated + 1
        else:
            out[seq], dropped = 0, dropped + 1
    return out, truncated, dropped


def pack_rows(lengths: np.ndarray, splittable: np.ndarray, seq_len: int,
              max_docs_per_row: int) -> np.ndarray:
    """Best-fit-decreasing plan; each row holds at most max_docs_per_row - 1 pieces so that a
    padding slot always remains."""
    if max_docs_per_row < 2:
        raise ValueError(f"max_docs_per_row={max_docs_per_row} must be >= 2")
    pieces = [p for p in split_pieces(np.asarray(lengths), np.asarray(splittable), seq_len)
              if p[2] > 0]
    pieces.sort(key=lambda p: (-p[2], p[0], p[1]))
    cap = max_docs_per_row - 1
    smallest = pieces[-1][2] if pieces else 0
    rows: list[list[tuple[int, int, int]]] = []
    free: list[int] = []
    open_rows: list[tuple[int, int]] = []  # sorted (free tokens, row)
    for piece in pieces:
        n = piece[2]
        at = bisect.bisect_left(open_rows, (n, -1))
        if at < len(open_rows):
            _, row = open_rows.pop(at)
        else:
            row = len(rows)
            rows.append([])
            free.append(seq_len)
        rows[row].append(piece)
        free[row] -= n
        if free[row] >= smallest and len(rows[row]) < cap:
            bisect.insort(open_rows, (free[row], row))
    plan = [(r, *p) for r, row in enumerate(rows) for p in row]
    return np.asarray(plan, dtype=np.int64).reshape(-1, 4)


def row_offsets(plan: np.ndarray) -> np.ndarray:
    """[R + 1] start of each row's pieces in the plan."""
    num_rows = int(plan[-1, 0]) + 1 if len(plan) else 0
    return np.searchsorted(plan[:, 0], np.arange(num_rows + 1)).astype(np.int64)
