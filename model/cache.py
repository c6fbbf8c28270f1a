"""What incremental decoding keeps between calls (docs/model.md, "Decoding"): per KDA layer its
recurrent state and the short convolutions' last inputs, per MLA layer the compressed latent of
every position, and per row the positions and documents seen. AttnRes and the MoE keep nothing:
both work per token."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

Copy = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class KDACache:
    state: torch.Tensor  # [B, H, K, V] fp32 (float64 in a float64 model)
    # The q, k and v convolutions' last `kernel - 1` inputs [B, kernel - 1, H * head_dim] of the
    # row's current document, oldest first; zeros where it has fewer (a zero input adds nothing).
    conv_tails: list[torch.Tensor]
    # Since the first call with checkpoints (DecodeCache.rewind): the state [B, n, H, K, V] and
    # the tails [B, n, kernel - 1, C] after each recorded position, the first entry the ones
    # before it; one entry per call.
    checkpoint_states: list[torch.Tensor] = field(default_factory=list)
    checkpoint_tails: list[list[torch.Tensor]] = field(default_factory=list)

    def copied(self, copy: Copy, slots: int) -> KDACache:
        return KDACache(copy(self.state), [copy(tail) for tail in self.conv_tails])

    def record(self, states: torch.Tensor, tails: list[torch.Tensor]) -> None:
        """The states [B, t, H, K, V] and tails [B, t, kernel - 1, C] after each of a call's
        positions (the ones before it first, at the first recorded call)."""
        if not self.checkpoint_states:
            self.checkpoint_states.append(self.state[:, None])
            self.checkpoint_tails.append([tail[:, None] for tail in self.conv_tails])
        self.checkpoint_states.append(states)
        self.checkpoint_tails.append(tails)

    def rewind(self, keep: torch.Tensor) -> None:
        rows = torch.arange(keep.shape[0], device=keep.device)
        self.state = torch.cat(self.checkpoint_states, dim=1)[rows, keep]
        self.conv_tails = [torch.cat(tails, dim=1)[rows, keep]
                           for tails in zip(*self.checkpoint_tails)]
        self.checkpoint_states, self.checkpoint_tails = [], []


@dataclass
class MLACache:
    # kv_a's output [B, capacity, kv_lora_rank + qk_rope_head_dim] (the latent, then the shared
    # key part) of every position; the first DecodeCache.slots are written.
    latent: torch.Tensor

    def copied(self, copy: Copy, slots: int) -> MLACache:
        return MLACache(copy(self.latent[:, :slots]))

    def rewind(self, keep: torch.Tensor) -> None:
        """Nothing to restore: the dropped positions' slots become padding (DecodeCache)."""

    def reserve(self, capacity: int) -> None:
        self.latent = _grown(self.latent, capacity, 0.0)


@dataclass
class DecodeCache:
    """Every row holds the same number of positions, `slots` (a host int: no sync to plan a
    call); a row's padding positions (shorter prompts of one call) are slots too, with document
    -1, which no query attends. `model.new_cache(batch_size)` makes one."""

    layers: dict[str, KDACache | MLACache]  # keyed like model.layers
    tokens_seen: torch.Tensor  # [B] int64: tokens each row has taken, padding not counted
    document: torch.Tensor  # [B] int64 id of each row's current document (0 at first)
    slot_documents: torch.Tensor  # [B, capacity] int64 document of each slot, -1: padding
    max_slots: int  # the model's max_seq_len
    slots: int = 0
    # Since the first call with checkpoints: the slots before it and tokens_seen [B, n] after
    # each recorded position (the first entry before it).
    checkpoint_slots: int | None = None
    checkpoint_tokens: list[torch.Tensor] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return self.tokens_seen.shape[0]

    def reserve(self, slots: int) -> None:
        """Room for `slots` positions per row; the buffers at least double when they grow, so
        appending token by token copies each position O(1) times."""
        capacity = self.slot_documents.shape[1]
        if slots <= capacity:
            return
        capacity = min(max(slots, 2 * capacity), self.max_slots)
        self.slot_documents = _grown(self.slot_documents, capacity, -1)
        for layer in self.layers.values():
            if isinstance(layer, MLACache):
                layer.reserve(capacity)

    def record(self, tokens_seen: torch.Tensor) -> None:
        """tokens_seen [B, t] after each position of a call with checkpoints, which starts at
        `slots` (called before the call's slots are added)."""
        if self.checkpoint_slots is None:
            self.checkpoint_slots = self.slots
            self.checkpoint_tokens.append(self.tokens_seen[:, None])
        self.checkpoint_tokens.append(tokens_seen)

    def rewind(self, keep: torch.Tensor) -> None:
        """Keeps the first keep[b] positions of row b recorded since the first call with
        checkpoints (`model.decode(..., checkpoints=True)`) and drops the rest: each row's KDA
        states and convolution tails return to where they were after its kept ones, the dropped
        positions' slots become padding (document -1, never attended; they still count
        towards max_seq_len). Speculative decoding keeps each row's accepted drafts this way
        without recomputing them. Ends the recording."""
        if self.checkpoint_slots is None:
            raise RuntimeError("rewind: no decode call with checkpoints=True since the last "
                               "rewind")
        recorded = self.slots - self.checkpoint_slots
        keep = torch.as_tensor(keep, device=self.tokens_seen.device).long()
        if keep.shape != (self.batch_size,):
            raise ValueError(f"keep must hold one count per row ({self.batch_size}), got "
                             f"{list(keep.shape)}")
        if keep.device.type == "cpu" and not bool(((keep >= 0) & (keep <= recorded)).all()):
            raise ValueError(f"keep must lie in [0, {recorded}] (the positions recorded), got "
                             f"{keep.tolist()}")
        positions = torch.arange(recorded, device=keep.device)
        window = self.slot_documents[:, self.checkpoint_slots:self.slots]
        window.masked_fill_(positions >= keep[:, None], -1)
        rows = torch.arange(self.batch_size, device=keep.device)
        self.tokens_seen = torch.cat(self.checkpoint_tokens, dim=1)[rows, keep]
        for layer in self.layers.values():
            layer.rewind(keep)
        self.checkpoint_slots, self.checkpoint_tokens = None, []

    def snapshot(self) -> CacheSnapshot:
        """A detached copy of everything the cache holds now (the written slots only), to resume
        from with `model.new_cache(batch_size, from_snapshot=...)`."""
        return CacheSnapshot(self.copied(self.batch_size))

    def copied(self, batch_size: int) -> DecodeCache:
        """A copy with `batch_size` rows: the same rows, or every row a copy of a 1-row cache."""
        def copy(x: torch.Tensor) -> torch.Tensor:
            return x.detach().expand(batch_size, *x.shape[1:]).clone()

        layers = {name: layer.copied(copy, self.slots) for name, layer in self.layers.items()}
        return DecodeCache(layers, copy(self.tokens_seen), copy(self.document),
                           copy(self.slot_documents[:, :self.slots]), self.max_slots, self.slots)


@dataclass(frozen=True)
class CacheSnapshot:
    """A decode cache's contents at one point, never decoded into: `new_cache(batch_size,
    from_snapshot=snap)` resumes from a copy of it (several caches may resume from one)."""

    cache: DecodeCache

    @property
    def batch_size(self) -> int:
        return self.cache.batch_size

    @property
    def slots(self) -> int:
        return self.cache.slots


def _grown(buffer: torch.Tensor, capacity: int, fill) -> torch.Tensor:
    """buffer [B, n, ...] with `capacity` positions along dim 1, the new ones `fill`."""
    grown = buffer.new_full((buffer.shape[0], capacity, *buffer.shape[2:]), fill)
    grown[:, :buffer.shape[1]] = buffer
    return grown
