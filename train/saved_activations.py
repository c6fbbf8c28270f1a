"""The bytes autograd keeps for backward after a forward pass, counted over distinct storages
with saved-tensor hooks (parameters and buffers excluded), plus the inputs that checkpointed
layers hold for their recomputation.

On real tensors this is a measurement; on the meta device it is a count at any size without
allocating anything, which is how `k3-plan` sizes activations: the real modules are traced, so
the plan counts what the code saves (the torch paths: fla's KDA kernel and flash attention on a
GPU save less than the torch fallbacks traced here).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_leaves

from model.batch import K3Batch, cu_seqlens_from_lengths
from model.config import K3Config
from model.head import LMHead
from model.k3 import DecoderLayer, K3Model
from parallel.activation_checkpointing import is_checkpointed


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # meta tensors have no data pointer; the storage has an id


class SavedBytes:
    """`with SavedBytes(exclude) as saved: ...` counts every storage saved for backward inside
    the block once; `hold(...)` adds tensors kept alive some other way (checkpoint inputs).
    The saved tensors stay alive with the graph, so storage ids are not reused meanwhile."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {_key(t) for t in exclude}
        self._sizes: dict[int, int] = {}
        self._hooks = saved_tensors_hooks(self._pack, lambda t: t)

    def hold(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            key = _key(t)
            if key not in self._excluded:
                self._sizes[key] = t.untyped_storage().nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.hold([t])
        return t

    @property
    def bytes(self) -> int:
        return sum(self._sizes.values())

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _model_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def measure_saved_bytes(model: K3Model, batch: K3Batch) -> int:
    """Bytes kept for backward by `model(batch)`; layers checkpointed by
    parallel/activation_checkpointing.py count the inputs they hold instead of their internals."""
    saved = SavedBytes(_model_tensors(model))
    hooks = [layer.register_forward_pre_hook(
        lambda _, args: saved.hold(t for t in tree_leaves(args) if isinstance(t, torch.Tensor)))
        for layer in model.layers.values() if is_checkpointed(layer)]
    try:
        with saved:
            out = model(batch)
    finally:
        for hook in hooks:
            hook.remove()
    del out  # the graph (and with it what was saved) is freed here
    return saved.bytes


def _sources_at(cfg: K3Config, layer: int) -> tuple[int, bool]:
    """Completed AttnRes blocks a layer sees (after its start_layer) and whether a partial sum
    comes in with them."""
    return layer // cfg.attnres_block_size + 1, layer % cfg.attnres_block_size != 0


def _meta_batch(cfg: K3Config, micro_batch: int, seq_len: int) -> K3Batch:
    tokens = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")
    cu = cu_seqlens_from_lengths([[seq_len]] * micro_batch, seq_len).to("meta")
    return K3Batch(tokens, tokens, cu)


def traced_layer_bytes(cfg: K3Config, micro_batch: int, seq_len: int,
                       dtype: torch.dtype = torch.bfloat16) -> list[int]:
    """Saved bytes of each decoder layer (training mode, one micro-batch), traced on the meta
    device. A layer's bytes are its attention and MLP's (by kind and MLP: traced once each) plus
    what its depth mixes keep for its number of AttnRes sources, which is the same whatever the
    attention and MLP: that part is traced once per source count on the first KDA layer's kind
    (the cheaper trace) as a difference, so a model of many blocks costs a trace per kind and
    one per source count, not one per combination."""
    trace = _LayerTracer(cfg, micro_batch, seq_len, dtype)
    reference = 1 if cfg.num_layers > 1 else 0  # a layer with depth mixes before both sublayers
    cores: dict[tuple, tuple[tuple[int, bool], int]] = {}  # kind -> (its first sources, bytes)
    per_layer = []
    for index in range(cfg.num_layers):
        sources = _sources_at(cfg, index)
        if index == 0:  # no mix before its attention: unlike any other
            per_layer.append(trace(index, sources))
            continue
        kind = (cfg.layer_types()[index], cfg.is_moe_layer(index))
        if kind not in cores:
            cores[kind] = (sources, trace(index, sources))
        first_sources, core = cores[kind]
        per_layer.append(core + trace(reference, sources) - trace(reference, first_sources))
    return per_layer


class _LayerTracer:
    """trace(index, (blocks, with_partial)) -> the saved bytes of layer `index`'s kind run on
    that many AttnRes sources (memoised)."""

    def __init__(self, cfg: K3Config, micro_batch: int, seq_len: int, dtype: torch.dtype):
        self.cfg, self.dtype = cfg, dtype
        self.batch = _meta_batch(cfg, micro_batch, seq_len)
        self.hidden = (micro_batch, seq_len, cfg.hidden_size)
        self.token_mask = self.batch.tokens != cfg.pad_token_id
        self.traced: dict[tuple, int] = {}

    def __call__(self, index: int, sources: tuple[int, bool]) -> int:
        key = (index, sources)
        if key not in self.traced:
            self.traced[key] = self._trace(index, *sources)
        return self.traced[key]

    def _trace(self, index: int, blocks: int, with_partial: bool) -> int:
        with torch.device("meta"):
            layer = DecoderLayer(self.cfg, index).to(self.dtype)
            sources = [torch.empty(self.hidden, dtype=self.dtype) for _ in range(blocks + 1)]
        segments = torch.zeros(self.hidden[:2], dtype=torch.long, device="meta")
        # The depth mixes keep their sources; a completed block is one storage that every later
        # mix keeps, counted once: here in the layer that first sees it (a block's first layer,
        # for the block completed just before it; layer 0 for the embedding).
        earlier_blocks = sources[:blocks if with_partial else blocks - 1]
        with SavedBytes([*_model_tensors(layer), *earlier_blocks]) as saved:
            layer(sources[:blocks], sources[-1] if with_partial else None, self.batch.cu_seqlens,
                  segments, self.token_mask)
        return saved.bytes


def traced_head_bytes(cfg: K3Config, micro_batch: int, seq_len: int,
                      dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """(embedding, head) saved bytes of one micro-batch, traced on the meta device: the token
    ids the embedding keeps, and the output mix over every AttnRes block, final norm and
    (chunked) loss of the last stage."""
    batch = _meta_batch(cfg, micro_batch, seq_len)
    with torch.device("meta"):
        embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size).to(dtype)
        head = LMHead(cfg).to(dtype)
        sources = [torch.empty(micro_batch, seq_len, cfg.hidden_size, dtype=dtype)
                   for _ in range(cfg.num_attnres_blocks + 1)]
    with SavedBytes(_model_tensors(embed)) as embedding:
        embed(batch.tokens)
    with SavedBytes([*_model_tensors(head), *sources[:-1]]) as loss:  # blocks: in the layers
        head(sources, batch.labels)
    return embedding.bytes, loss.bytes


def checkpointed_inputs_bytes(cfg: K3Config, micro_batch: int, seq_len: int, num_layers: int,
                              dtype_bytes: int = 2) -> int:
    """What checkpointed layers hold: each layer's output (one hidden state per layer, the
    embedding counting for the first), the document ids the short convolutions mask with
    (int64) and the padding mask Quantile Balancing reads (bool)."""
    tokens = micro_batch * seq_len
    return tokens * (num_layers * cfg.hidden_size * dtype_bytes + 8 + 1)
