"""One call of incremental decoding (docs/model.md, "Decoding"): where its positions go in the
cache, and what the layers need from that (which documents the positions belong to, where
padding is, which inputs the convolutions keep, which KDA state each document starts from).

A call takes t positions per row. Row b's first lengths[b] are tokens, the rest padding: kept
out of the KDA state (no decay, no write), the convolution tails and attention (document -1).
With cu_seqlens (K3Batch's convention over the call's B*t positions: every row start is a
boundary) a row holds several documents: the first continues the row's cached document (unless
the row is `fresh`: a prefill cut into pieces at a document's start), each later one starts
afresh, and the last is the one later calls continue. Everything is planned on the device: no
host sync, no shape that depends on the data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .batch import VisionInput, segment_ids
from .cache import CacheSnapshot, DecodeCache

Lengths = torch.Tensor | Sequence[int] | None


@dataclass
class DecodeStep:
    """Where one call's positions went (`extend`), as the layers' `decode` reads it."""

    offset: int  # slots each row held before the call
    lengths: torch.Tensor  # [B] int64 tokens of each row in the call
    valid: torch.Tensor | None  # [B, t] bool, True for tokens; None: no padding
    cu_seqlens: torch.Tensor | None  # [N + 1] over the B*t positions; None: one document per row
    fresh: torch.Tensor | None  # [B] bool: the row's first token starts a document; None: none
    query_documents: torch.Tensor  # [B, t] document id of each position, -1 for padding
    key_documents: torch.Tensor  # [B, offset + t] document id of every slot up to the call's end
    # [B, width + t] each convolution input's document counted from the row's first in the call
    # (the cached tail first, in document 0); None without cu_seqlens: one document throughout.
    conv_segments: torch.Tensor | None
    last_document: torch.Tensor | None  # [B] that count at each row's last token (0: no token)
    checkpoints: bool = False  # the layers record their state after each position (rewind)

    @property
    def t(self) -> int:
        return self.query_documents.shape[1]

    def token_mask(self) -> torch.Tensor:
        return self.query_documents >= 0

    def without_padding(self, g: torch.Tensor,
                        beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KDA's log decay g [B, t, H, K] and beta [B, t, H] with 0 at padding: the state passes
        a padding position unchanged."""
        if self.valid is None:
            return g, beta
        return (torch.where(self.valid[..., None, None], g, 0.0),
                torch.where(self.valid[..., None], beta, 0.0))

    def last_inputs(self, inputs: torch.Tensor, width: int) -> torch.Tensor:
        """A convolution's new tail: the last `width` inputs of each row's current document
        from inputs [B, width + t, C] (the old tail, then the call's), zeros before its start."""
        index = self.lengths[:, None] + torch.arange(width, device=inputs.device)
        tail = inputs.gather(1, index[..., None].expand(-1, -1, inputs.shape[-1]))
        if self.conv_segments is None:
            return tail
        current = self.conv_segments.gather(1, index) == self.last_document[:, None]
        return tail * current[..., None]

    def position_windows(self, inputs: torch.Tensor, width: int) -> torch.Tensor:
        """A convolution's tail after each position [B, t, width, C] from inputs
        [B, width + t, C] (one document per row): the last `width` inputs up to it, a padding
        position's those of the row's last token."""
        upto = torch.minimum(torch.arange(1, self.t + 1, device=inputs.device),
                             self.lengths[:, None])
        index = (upto[..., None] + torch.arange(width, device=inputs.device)).flatten(1)
        windows = inputs.gather(1, index[..., None].expand(-1, -1, inputs.shape[-1]))
        return windows.view(inputs.shape[0], self.t, width, inputs.shape[-1])

    def row_initial_states(self, state: torch.Tensor) -> torch.Tensor:
        """The KDA state [B, H, K, V] each row starts from with one document per row: the
        cached one, zeros for a fresh row."""
        if self.fresh is None:
            return state
        return torch.where(self.fresh.view(-1, 1, 1, 1), 0.0, state)

    def document_initial_states(self, state: torch.Tensor) -> torch.Tensor:
        """The KDA state each of the call's documents starts from [N, H, K, V]: its row's cached
        state for a document at a row start (it continues the cached one) of a row that is not
        fresh, else zeros."""
        t = self.t
        starts = self.cu_seqlens[:-1]
        rows = (starts // t).clamp(max=state.shape[0] - 1)  # an empty last document: any row
        continues = starts % t == 0
        if self.fresh is not None:
            continues = continues & ~self.fresh[rows]
        return torch.where(continues.view(-1, 1, 1, 1), state.index_select(0, rows), 0.0)

    def row_final_states(self, document_states: torch.Tensor,
                         state: torch.Tensor) -> torch.Tensor:
        """Each row's state after the call [B, H, K, V] from its documents' final states: that
        of the document holding its last token (padding after it changed nothing), or the cached
        one for a row without tokens."""
        rows = torch.arange(state.shape[0], device=state.device)
        last_token = rows * self.t + self.lengths - 1
        document = torch.searchsorted(self.cu_seqlens, last_token, right=True) - 1
        has_tokens = (self.lengths > 0).view(-1, 1, 1, 1)
        return torch.where(has_tokens, document_states.index_select(0, document.clamp(min=0)),
                           state)


def extend(cache: DecodeCache, t: int, lengths: Lengths, cu_seqlens: torch.Tensor | None,
           conv_width: int, fresh: torch.Tensor | None = None,
           checkpoints: bool = False) -> DecodeStep:
    """Records a call's t positions per row in `cache` (slots, their documents, tokens seen, the
    current documents) and returns where they went; the layers then write their own parts.
    `fresh` [B] bool: rows whose first position starts a document; `checkpoints`: the tokens
    seen after each position are recorded for DecodeCache.rewind."""
    B, device = cache.batch_size, cache.document.device
    positions = torch.arange(t, device=device)
    if lengths is None:
        lengths, valid = torch.full((B,), t, device=device), None
    else:
        lengths = torch.as_tensor(lengths, device=device).long()
        valid = positions < lengths[:, None]
    last_token = (lengths - 1).clamp(min=0)[:, None]
    has_tokens = lengths > 0
    if fresh is not None:  # a row without tokens keeps its document
        fresh = fresh.to(device) & has_tokens
    if cu_seqlens is None and fresh is None:
        conv_segments = last_document = None
        documents = cache.document[:, None].expand(B, t)
    else:
        # Each position's document counted from the one the row's cache holds (0).
        local = positions.new_zeros(B, t)
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.to(device)
            local = segment_ids(cu_seqlens, B * t).view(B, t)
            local = local - local[:, :1]
        if fresh is not None:
            local = local + fresh[:, None].long()
        conv_segments = torch.cat([local.new_zeros(B, conv_width), local], dim=1)
        last_document = torch.where(has_tokens, local.gather(1, last_token).squeeze(1), 0)
        documents = cache.document[:, None] + local
    query_documents = documents if valid is None else torch.where(valid, documents, -1)
    if checkpoints:
        cache.record(cache.tokens_seen[:, None] + torch.minimum(positions + 1, lengths[:, None]))
    offset = cache.slots
    cache.reserve(offset + t)
    cache.slot_documents[:, offset:offset + t] = query_documents
    cache.slots += t
    cache.tokens_seen = cache.tokens_seen + lengths
    cache.document = torch.where(has_tokens, documents.gather(1, last_token).squeeze(1),
                                 cache.document)
    return DecodeStep(offset, lengths, valid, cu_seqlens, fresh, query_documents,
                      cache.slot_documents[:, :offset + t], conv_segments, last_document,
                      checkpoints)


def piece(lengths: Lengths, cu_seqlens: torch.Tensor | None, B: int, t: int, start: int,
          stop: int) -> tuple[Lengths, torch.Tensor | None, torch.Tensor | None]:
    """The lengths, document bounds and fresh rows of positions start:stop of a call's t per
    row, as a call of its own: the same documents cut at the piece's edges. A document cut at
    the piece's start continues the cached one, as in the whole call; one that starts there
    makes its row fresh. Bounds outside the piece land on its rows' edges: empty documents."""
    if lengths is not None:
        lengths = (torch.as_tensor(lengths) - start).clamp(0, stop - start)
    fresh = None
    if cu_seqlens is not None:
        if start > 0:
            row_starts = torch.arange(B, device=cu_seqlens.device) * t + start
            fresh = (cu_seqlens[None, :] == row_starts[:, None]).any(1)
        width = stop - start
        cu_seqlens = cu_seqlens // t * width + (cu_seqlens % t).clamp(start, stop) - start
    return lengths, cu_seqlens, fresh


def check_inputs(model, tokens: torch.Tensor, cache, lengths: Lengths,
                 cu_seqlens: torch.Tensor | None, vision: VisionInput | None,
                 checkpoints: bool = False) -> None:
    """Clear errors, naming the argument, for inputs a decode call cannot take. Values are
    checked where they are on the host (no sync for device tensors)."""
    if isinstance(cache, CacheSnapshot):
        raise TypeError("cache is a CacheSnapshot: decode into model.new_cache(batch_size, "
                        "from_snapshot=snapshot), which leaves the snapshot as it is")
    if not isinstance(cache, DecodeCache):
        raise TypeError(f"cache must be a DecodeCache from model.new_cache(batch_size), got "
                        f"{type(cache).__name__}")
    check_layers(model, cache, "cache")
    if tokens.dim() != 2 or tokens.is_floating_point() or tokens.shape[1] < 1:
        raise ValueError(f"tokens must be integer ids [batch, t] with t >= 1, got "
                         f"{tokens.dtype} {list(tokens.shape)}")
    B, t = tokens.shape
    if B != cache.batch_size:
        raise ValueError(f"tokens has {B} rows but the cache holds {cache.batch_size} "
                         f"(model.new_cache(batch_size={cache.batch_size}))")
    if cache.slots + t > model.cfg.max_seq_len:
        raise ValueError(f"tokens: {t} more positions would make the cache's {cache.slots} "
                         f"{cache.slots + t}, past model.max_seq_len={model.cfg.max_seq_len} "
                         f"(padding positions count)")
    if lengths is not None:
        _check_lengths(torch.as_tensor(lengths), B, t)
    if cu_seqlens is not None:
        _check_cu_seqlens(cu_seqlens, B, t)
    if checkpoints and cu_seqlens is not None:
        raise ValueError("checkpoints=True takes one document per row: give no cu_seqlens "
                         "(a rewind keeps positions of the row's current document)")
    if vision is not None and model.vision is None:
        raise ValueError("vision was given but the model has no vision tower (model.vision)")


def check_layers(model, cache: DecodeCache, name: str) -> None:
    """`cache` (a cache or a snapshot's) was made for this model's layers."""
    expected = {i: layer.attn.cache_type for i, layer in model.layers.items()}
    found = {i: type(layer) for i, layer in cache.layers.items()}
    if found != expected:
        raise ValueError(f"{name} was made for other layers than this model's: "
                         f"{_kinds(found)} vs {_kinds(expected)}")


def _kinds(types: dict) -> str:
    return " ".join(f"{i}:{t.__name__}" for i, t in types.items())


def _check_lengths(lengths: torch.Tensor, B: int, t: int) -> None:
    if lengths.shape != (B,) or lengths.is_floating_point():
        raise ValueError(f"lengths must be {B} integer token counts (one per row), got "
                         f"{lengths.dtype} {list(lengths.shape)}")
    if lengths.device.type == "cpu" and not bool(((lengths >= 0) & (lengths <= t)).all()):
        raise ValueError(f"lengths must lie in [0, t={t}], got {lengths.tolist()}")


def _check_cu_seqlens(cu_seqlens: torch.Tensor, B: int, t: int) -> None:
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < B + 1 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be integer document bounds [N + 1] with N >= {B} "
                         f"(every row starts one), got {cu_seqlens.dtype} "
                         f"{list(cu_seqlens.shape)}")
    if cu_seqlens.device.type != "cpu":
        return
    bounds = cu_seqlens.tolist()
    row_starts = set(range(0, B * t + 1, t))
    if (bounds[0] != 0 or bounds[-1] != B * t or bounds != sorted(bounds)
            or not row_starts <= set(bounds)):
        raise ValueError(f"cu_seqlens must rise from 0 to B*t={B * t} through every multiple of "
                         f"t={t} (K3Batch's layout over the call's positions), got {bounds}")
