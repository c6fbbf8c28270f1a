"""What incremental decoding keeps between calls (docs/model.md, "Decoding"): per KDA layer its
recurrent state and the short convolutions' last inputs, per MLA layer the compressed latent of
every position, and per row the positions and documents seen. AttnRes and the MoE keep nothing:
both work per token."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Copy = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class KDACache:
    state: torch.Tensor  # [B, H, K, V] fp32 (float64 in a float64 model)
    # The q, k and v convolutions' last `kernel - 1` inputs [B, kernel - 1, H * head_dim] of the
    # row's current document, oldest first; zeros where it has fewer (a zero input adds nothing).
    conv_tails: list[torch.Tensor]

    def copied(self, copy: Copy, slots: int) -> KDACache:
        return KDACache(copy(self.state), [copy(tail) for tail in self.conv_tails])


@dataclass
class MLACache:
    # kv_a's output [B, capacity, kv_lora_rank + qk_rope_head_dim] (the latent, then the shared
    # key part) of every position; the first DecodeCache.slots are written.
    latent: torch.Tensor

    def copied(self, copy: Copy, slots: int) -> MLACache:
        return MLACache(copy(self.latent[:, :slots]))

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
