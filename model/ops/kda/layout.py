"""Where the tokens of the chunk form go: a buffer of whole chunks of C tokens ([B, H, NC, C, *]),
with packed documents either each starting on a chunk boundary (_docs_layout: per-document
states in or out) or sharing chunks and kept apart by masks (_segment_masks: training's case),
and the states entering and leaving the documents."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.batch import segment_ids
from model.dtypes import compute_dtype, upcast

# Tokens per sub-tile of the chunk form's scores (chunk sizes are multiples of it).
SUB_TILE = 16


@dataclass
class _ChunkLayout:
    """Where each token goes in a buffer of whole chunks, and where each document starts.

    token_index [T]: position of each token in the padded buffer of num_chunks * C tokens (None:
    token t at position t). For packed documents also, per chunk, whether it starts a document
    and which one, and per document its last chunk (clamped to 0) and whether it has any token.
    """

    token_index: torch.Tensor | None
    num_chunks: int
    chunk_doc: torch.Tensor | None = None
    chunk_starts_doc: torch.Tensor | None = None
    doc_last_chunk: torch.Tensor | None = None
    doc_nonempty: torch.Tensor | None = None


def _rows_layout(T: int, chunk: int) -> _ChunkLayout:
    return _ChunkLayout(None, -(-T // chunk))


def _docs_layout(cu_seqlens: torch.Tensor, T: int, chunk: int) -> _ChunkLayout:
    """Each document starts on a chunk boundary. With N documents the chunks needed,
    sum ceil(len_n / C) < T / C + N, fit in ceil(T / C) + N - 1: a static count."""
    device = cu_seqlens.device
    cu_seqlens = cu_seqlens.long()
    N = cu_seqlens.shape[0] - 1
    num_chunks = -(-T // chunk) + N - 1
    doc_chunks = (cu_seqlens[1:] - cu_seqlens[:-1] + chunk - 1) // chunk
    chunk_end = doc_chunks.cumsum(0)
    chunk_start = chunk_end - doc_chunks
    doc = segment_ids(cu_seqlens, T)
    token_index = chunk_start[doc] * chunk + torch.arange(T, device=device) - cu_seqlens[doc]
    chunk_ids = torch.arange(num_chunks, device=device)
    # A document without tokens owns no chunk: searchsorted(right) skips it.
    chunk_doc = torch.searchsorted(chunk_end, chunk_ids, right=True).clamp(max=N - 1)
    return _ChunkLayout(
        token_index=token_index,
        num_chunks=num_chunks,
        chunk_doc=chunk_doc,
        chunk_starts_doc=chunk_ids == chunk_start[chunk_doc],
        doc_last_chunk=(chunk_end - 1).clamp(min=0),
        doc_nonempty=doc_chunks > 0,
    )


def _to_chunks(x: torch.Tensor, layout: _ChunkLayout, chunk: int) -> torch.Tensor:
    """[B, T, H, ...] -> [B, H, num_chunks, C, ...] fp32 or wider, zeros where no token lands:
    a view of x, or of its padded or cast copy (token-major). No chunk-major copy of the whole
    input: the bounded form copies one block of chunks at a time (it stays in cache), and a
    32 MiB buffer at T = 16K would be fresh memory, page-faulted in on every step."""
    B, T, H, *rest = x.shape
    padded_T = layout.num_chunks * chunk
    if layout.token_index is not None:
        x = x.new_zeros(B, padded_T, H, *rest).index_copy(1, layout.token_index, x)
    elif T < padded_T:
        x = torch.cat([x, x.new_zeros(B, padded_T - T, H, *rest)], dim=1)
    x = x.to(compute_dtype(x.dtype)).unflatten(1, (layout.num_chunks, chunk))
    return x.permute(0, 3, 1, 2, *range(4, x.dim()))


def _from_chunks(x: torch.Tensor, layout: _ChunkLayout, T: int) -> torch.Tensor:
    """[B, H, num_chunks, C, V] -> [B, T, H, V] (a view for rows: the state pass stores its
    output token-major)."""
    x = x.permute(0, 2, 3, 1, 4).flatten(1, 2)
    return x[:, :T] if layout.token_index is None else x.index_select(1, layout.token_index)


@dataclass
class _SegmentMasks:
    """Documents sharing chunks ([rows, 1, NC, C, *] bool, like the chunks [B, H, NC, C, *]):
    `same` pairs of one document, `continues` tokens whose document began before the chunk
    (they see the carried state), `in_last` tokens of the chunk's last document (they make the
    state carried on)."""

    same: torch.Tensor
    continues: torch.Tensor
    in_last: torch.Tensor


def _segment_masks(cu_seqlens: torch.Tensor, T: int, chunk: int, rows: int) -> _SegmentMasks:
    """The masks of the T packed tokens, split into `rows` rows of whole chunks (or one row)."""
    num_chunks = -(-T // chunk)
    seg = segment_ids(cu_seqlens.long(), T)
    # Padding after T (k = beta = 0: no effect on the state) counts as the last document.
    seg = torch.cat([seg, seg[-1:].expand(num_chunks * chunk - T)]).view(num_chunks, chunk)
    before = torch.cat([seg.new_full((1,), -1), seg[:-1, -1]])  # document before each chunk
    masks = (seg.unsqueeze(-1) == seg.unsqueeze(-2), (seg == before.unsqueeze(-1)).unsqueeze(-1),
             (seg == seg[:, -1:]).unsqueeze(-1))
    return _SegmentMasks(*(m.view(rows, 1, num_chunks // rows, *m.shape[1:]) for m in masks))


def _carried_in(qc, vc, initial_state, layout):
    """What the state pass starts from: the state entering the first chunk [B, H, K, V], and for
    packed documents the initial state of each chunk's document (None: zeros) and whether each
    chunk starts one."""
    B, H, _, _, K = qc.shape
    state = qc.new_zeros(B, H, K, vc.shape[-1])
    starts = inits = None
    if layout.chunk_doc is None:
        if initial_state is not None:
            state = upcast(initial_state)
    else:  # a chunk that starts a document loads that document's initial state
        starts = layout.chunk_starts_doc
        if initial_state is not None:
            inits = upcast(initial_state).index_select(0, layout.chunk_doc).unsqueeze(1)
    return state, inits, starts


def _doc_final_states(chunk_end_states, initial_state, layout):
    """The state after each document's last chunk ([N, H, K, V]); a document without tokens
    keeps its initial state."""
    final = chunk_end_states.index_select(2, layout.doc_last_chunk)[0].transpose(0, 1)
    if initial_state is None:
        before = final.new_zeros(())
    else:
        before = upcast(initial_state)
    return torch.where(layout.doc_nonempty.view(-1, 1, 1, 1), final, before)
