"""Gated multi-head latent attention without positional encoding."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .cache import MLACache
from .config import K3Config
from .dtypes import upcast
from .norms import RMSNorm
from .ops.attention import doc_causal_attention, offset_doc_causal_attention

if TYPE_CHECKING:
    from .decode import DecodeStep


class GatedMLA(nn.Module):
    """Low-rank q and kv, a k_rope slice shared by all heads (never rotated: NoPE), softmax
    attention over documents, and a sigmoid output gate.

    Weight layouts QK-Clip and Per-Head Muon rely on: q_b rows per head are
    [q_nope | q_rope], kv_b rows per head are [k_nope | v].
    """

    cache_type = MLACache

    def __init__(self, cfg: K3Config):
        super().__init__()
        mc = cfg.mla
        d, h = cfg.hidden_size, mc.num_heads
        self.num_heads = h
        self.nope, self.rope, self.v_dim = mc.qk_nope_head_dim, mc.qk_rope_head_dim, mc.v_head_dim
        self.kv_lora_rank = mc.kv_lora_rank
        self.scale = mc.qk_head_dim ** -0.5
        self.backend = mc.backend
        self.q_a = nn.Linear(d, mc.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(mc.q_lora_rank, cfg.norm_eps)
        self.q_b = nn.Linear(mc.q_lora_rank, h * mc.qk_head_dim, bias=False)
        self.kv_a = nn.Linear(d, mc.kv_lora_rank + mc.qk_rope_head_dim, bias=False)
        self.kv_a_norm = RMSNorm(mc.kv_lora_rank, cfg.norm_eps)
        self.kv_b = nn.Linear(mc.kv_lora_rank, h * (mc.qk_nope_head_dim + mc.v_head_dim),
                              bias=False)
        self.gate_proj = nn.Linear(d, h * mc.v_head_dim, bias=False)
        self.o_proj = nn.Linear(h * mc.v_head_dim, d, bias=False)
        # Per-head max pre-softmax logit of the last forward, for QK-Clip (None until recorded).
        self.record_max_logit = False
        self.max_logit: torch.Tensor | None = None
        # Context-parallel seam (filled from parallel/): kv_exchange(latent) -> (the latents of
        # the keys this rank's queries may see, [rows, keys, C] with rows dividing the query
        # rows, and an attention with doc_causal_attention's signature over them).
        self.kv_exchange = None

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None,
                segments: torch.Tensor | None = None) -> torch.Tensor:
        q = self._queries(x)
        latent, attend = self.kv_a(x), doc_causal_attention
        if self.kv_exchange is not None:  # the compressed latent crosses ranks, not K and V
            latent, attend = self.kv_exchange(latent)
        out = attend(q, *self._keys_values(latent), cu_seqlens, scale=self.scale,
                     backend=self.backend, return_max_logit=self.record_max_logit)
        if self.record_max_logit:
            out, max_logit = out
            self.max_logit = max_logit if self.max_logit is None else torch.maximum(
                self.max_logit, max_logit)
        return self._gated_output(out, x)

    def decode(self, x: torch.Tensor, cache: MLACache, step: DecodeStep) -> torch.Tensor:
        """forward for the positions of one decode call (model/decode.py): their latents join
        the cached ones, and their queries attend to every slot of their document up to their
        own (the absorbed form: attention over the latents)."""
        latent = self.kv_a(x)
        end = step.offset + step.t
        cache.latent[:, step.offset:end] = latent
        backend = "reference" if self.backend == "reference" else "blockwise"
        # The absorbed form: kv_b's key and value halves move to the query and the output, so
        # each call attends over the normalised latents themselves (one shared head of
        # kv_lora_rank + rope) instead of expanding K and V from every cached position.
        ckv, k_rope = cache.latent[:, :end].to(latent.dtype).split([self.kv_lora_rank,
                                                                     self.rope], dim=-1)
        c = self.kv_a_norm(ckv)
        w_k, w_v = self.kv_b.weight.view(-1, self.nope + self.v_dim, self.kv_lora_rank).split(
            [self.nope, self.v_dim], dim=1)
        q_nope, q_rope = self._queries(x).split([self.nope, self.rope], dim=-1)
        heads = w_k.shape[0]
        q = torch.cat([torch.einsum("bthn,hnr->bthr", q_nope, w_k), q_rope], dim=-1)
        k = torch.cat([c, k_rope], dim=-1)[:, :, None].expand(-1, -1, heads, -1)
        out = offset_doc_causal_attention(q, k, c[:, :, None].expand(-1, -1, heads, -1),
                                          step.query_documents, step.key_documents,
                                          step.offset, self.scale, backend)
        out = torch.einsum("bthr,hvr->bthv", out, w_v.to(out.dtype))
        return self._gated_output(out, x)

    def new_cache(self, batch_size: int) -> MLACache:
        """No latents yet for `batch_size` rows (the buffer grows with DecodeCache.reserve)."""
        weight = self.kv_a.weight
        return MLACache(weight.new_zeros(batch_size, 0, weight.shape[0]))

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        # Head counts come from the projections (-1): a head-sharded q_b/kv_b runs unchanged.
        return self.q_b(self.q_a_norm(self.q_a(x))).view(*x.shape[:2], -1, self.nope + self.rope)

    def _keys_values(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K [B, T, H, nope + rope] and V [B, T, H, v_dim] expanded from latents [B, T, C]."""
        ckv, k_rope = latent.split([self.kv_lora_rank, self.rope], dim=-1)
        # The exchanged latents may serve several query rows each (context parallelism's pieces
        # of one row): their own batch dimension.
        kv = self.kv_b(self.kv_a_norm(ckv)).view(*latent.shape[:2], -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(-1, -1, kv.shape[2], -1)], dim=-1)
        return k, v

    def _gated_output(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The gated output projection of the attention's out [B, T, H, v_dim] (fp32)."""
        gate = torch.sigmoid(upcast(self.gate_proj(x))).view(out.shape)
        return self.o_proj((gate * upcast(out)).reshape(*x.shape[:2], -1).to(x.dtype))
