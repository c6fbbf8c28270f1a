"""The K3 multimodal model: MoonViT-V2 tokens merged into a hybrid KDA/MLA decoder with Block
Attention Residuals and latent MoE, untied embedding and LM head, no positional encoding."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .attnres import BlockState, DepthMix
from .batch import K3Batch, VisionInput, segment_ids
from .cache import CacheSnapshot, DecodeCache, KDACache, MLACache
from .config import K3Config
from .decode import DecodeStep, Lengths, check_inputs, check_layers, extend, piece
from .dtypes import autocast_dtype
from .head import LMHead
from .init import Locate, Normal, Rule, fill_, parameter_key, random_seed
from .kda import KimiDeltaAttention
from .mla import GatedMLA
from .mlp import SiTUGLUMLP
from .moe import LatentMoE, QuantileBalancer, statistics_paused
from .norms import RMSNorm
from .vision import MoonViT


def _forked_rng():
    """Forks the CPU generator and, when building on an accelerator, that device's."""
    device = torch.get_default_device()
    if device.type in ("cpu", "meta"):
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device], device_type=device.type)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: K3Config, index: int):
        super().__init__()
        self.index = index
        self.kind = cfg.layer_types()[index]
        self.attn = KimiDeltaAttention(cfg) if self.kind == "kda" else GatedMLA(cfg)
        if cfg.is_moe_layer(index):
            self.mlp = LatentMoE(cfg)
        else:
            self.mlp = SiTUGLUMLP(cfg.hidden_size, cfg.dense_intermediate, cfg.situ_beta_gate,
                                  cfg.situ_beta_up)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        # Layer 0 sees only the embedding before its attention: nothing to mix there.
        self.attn_mix = DepthMix(cfg.hidden_size, cfg.norm_eps) if index > 0 else None
        self.mlp_mix = DepthMix(cfg.hidden_size, cfg.norm_eps)

    def forward(self, blocks: Sequence[torch.Tensor], partial: torch.Tensor | None,
                cu_seqlens: torch.Tensor | None, segments: torch.Tensor | None,
                token_mask: torch.Tensor) -> torch.Tensor:
        """blocks: the completed AttnRes blocks (the embedding first); partial: the current
        block's running sum (None right after a block completed). Returns the new partial."""
        out = self.attn(self._attention_input(blocks, partial), cu_seqlens, segments)
        return self._with_mlp(blocks, partial, out, token_mask)

    def decode(self, blocks: Sequence[torch.Tensor], partial: torch.Tensor | None,
               cache: KDACache | MLACache, step: DecodeStep) -> torch.Tensor:
        """forward for the positions of one decode call, the attention continuing `cache`."""
        out = self.attn.decode(self._attention_input(blocks, partial), cache, step)
        return self._with_mlp(blocks, partial, out, step.token_mask())

    def _attention_input(self, blocks, partial) -> torch.Tensor:
        sources = [*blocks] if partial is None else [*blocks, partial]
        h = sources[-1] if self.attn_mix is None else self.attn_mix(sources)
        return self.attn_norm(h)

    def _with_mlp(self, blocks, partial, attn_out, token_mask) -> torch.Tensor:
        """The new partial: the attention's output and the MLP's on its mix added."""
        partial = attn_out if partial is None else partial + attn_out
        h = self.mlp_norm(self.mlp_mix([*blocks, partial]))
        if isinstance(self.mlp, LatentMoE):
            b, t, d = h.shape
            out = self.mlp(h.reshape(b * t, d), token_mask.reshape(b * t)).view(b, t, d)
        else:
            out = self.mlp(h)
        return partial + out


def embedded_in_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """The token embeddings in autocast's dtype (bf16 under bf16 autocast): they are the first
    AttnRes block, which every layer reads and which each micro-batch in flight keeps, as the
    other blocks (sums of bf16 layer outputs) are kept."""
    dtype = autocast_dtype(x.device.type)
    return x if dtype is None else x.to(dtype)


@dataclass
class K3Output:
    # summed token cross-entropy (fp32; each weighted by batch.loss_weights where given): divide
    # by the global count of loss units
    loss_sum: torch.Tensor
    num_tokens: torch.Tensor  # loss units of this micro-batch (K3Batch.loss_units)
    logits: torch.Tensor | None = None


class K3Model(nn.Module):
    """Embedding (+ vision), decoder layers, LM head with the loss.

    `layers` is a ModuleDict keyed by the layer index, so a pipeline stage that keeps some of
    them keeps their parameter names. Every parameter and buffer gets its value from
    `init_weights(seed)`, each element a function of the seed, the parameter's name and its
    index (model/init.py): a model built on the meta device, materialised with `to_empty` and
    initialised equals an eagerly built one with the same seed, and so does any part of it a
    parallel layout keeps on one rank. `seed` None: drawn from torch's global generator.
    """

    def __init__(self, cfg: K3Config, seed: int | None = None):
        super().__init__()
        self.cfg = cfg
        # The constructors' own inits are overwritten by init_weights: let them draw from a
        # forked RNG, so that the global generator moves by init_weights' seed alone.
        with _forked_rng():
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i)
                                         for i in range(cfg.num_layers)})
            self.head = LMHead(cfg)
            self.vision = (MoonViT(cfg.vision, cfg.hidden_size, cfg.norm_eps)
                           if cfg.vision is not None else None)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, locate: Locate | None = None) -> int:
        """Every parameter from its rule (`init_rule`), zero Quantile Balancing state. `locate`
        (parallel layouts) says which part of each parameter this process holds: `locate(name,
        param)` -> (the local tensor to write, the logical shape, the global index of its
        elements along each dimension, or None for all of them). Returns the seed (drawn from
        torch's global generator when None)."""
        seed = random_seed() if seed is None else seed
        for name, param in self.named_parameters():
            local, shape, index = (locate(name, param) if locate is not None
                                   else (param.data, param.shape, None))
            fill_(local, self.init_rule(name), parameter_key(seed, name), shape, index)
        for moe in self.moe_layers():
            if moe.balancer is not None:
                moe.balancer.reset_parameters()
        return seed

    def init_rule(self, name: str) -> Rule:
        """What parameter `name` starts as: the vision tower's rule for its own, a module's
        `init_rules()` where it declares them (norms, gates, convolutions, AttnRes queries,
        experts, router), Normal(0, init_std) for the language model's linear and embedding
        weights."""
        if name.startswith("vision."):
            return self.vision.init_rule(name[len("vision."):])
        module_name, _, leaf = name.rpartition(".")
        module = self.get_submodule(module_name)
        if hasattr(module, "init_rules"):
            return module.init_rules()[leaf]
        # nn.Linear, nn.Embedding, or a linear another backend put in its place (TE's).
        linear = isinstance(module, nn.Embedding) or hasattr(module, "in_features")
        if linear and leaf == "weight":
            return Normal(self.cfg.init_std)
        raise ValueError(f"no initial-value rule for parameter {name}")

    def embed_inputs(self, batch: K3Batch) -> torch.Tensor:
        """Token embeddings with the projected vision tokens written over the placeholders."""
        return self.embed_tokens(batch.tokens, batch.vision)

    def embed_tokens(self, tokens: torch.Tensor, vision: VisionInput | None) -> torch.Tensor:
        x = embedded_in_compute_dtype(self.embed(tokens))
        if vision is None or self.vision is None:
            return x
        b, t, d = x.shape
        flat = x.reshape(b * t, d).index_copy(0, vision.token_positions,
                                              self.vision_tokens(vision, x.dtype))
        return flat.view(b, t, d)

    def vision_tokens(self, vision: VisionInput, dtype: torch.dtype) -> torch.Tensor:
        """The vision tower's output tokens [N, d] that go where vision.token_positions say."""
        vis = self.vision(vision.patches, vision.grid_thw).to(dtype)
        if vision.output_rows is not None:
            vis = vis.index_select(0, vision.output_rows)
        return vis

    def run_layers(self, state: BlockState, batch: K3Batch,
                   layers: Sequence[DecoderLayer] | None = None) -> None:
        """`layers` (default: every decoder layer this model holds; a pipeline stage passes its
        own) in order, on the state's blocks and partial."""
        b, t = batch.tokens.shape
        cu = batch.cu_seqlens
        segments = segment_ids(cu, b * t).view(b, t) if cu is not None else None
        token_mask = batch.tokens != self.cfg.pad_token_id
        self._each_layer(state, layers, lambda layer, blocks, partial: layer(
            blocks, partial, cu, segments, token_mask))

    def _each_layer(self, state: BlockState, layers: Sequence[DecoderLayer] | None,
                    run: Callable[[DecoderLayer, tuple, torch.Tensor | None], torch.Tensor]
                    ) -> None:
        for layer in self.layers.values() if layers is None else layers:
            state.start_layer(layer.index)
            # A tuple snapshot: a checkpointed layer recomputes from the blocks it was given.
            state.partial = run(layer, tuple(state.blocks), state.partial)

    def forward(self, batch: K3Batch, return_logits: bool = False) -> K3Output:
        state = BlockState(self.embed_inputs(batch), self.cfg.attnres_block_size)
        self.run_layers(state, batch)
        loss_sum, logits = self.head(state.sources(), batch.labels, return_logits,
                                     batch.loss_weights)
        return K3Output(loss_sum, batch.loss_units(), logits)

    def new_cache(self, batch_size: int,
                  from_snapshot: CacheSnapshot | None = None) -> DecodeCache:
        """An empty decode cache for `batch_size` rows, or a copy of a snapshot's contents (a
        1-row snapshot fills every row). docs/model.md, "Decoding"."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} is invalid: must be an int >= 1")
        if from_snapshot is not None:
            if not isinstance(from_snapshot, CacheSnapshot):
                raise TypeError(f"from_snapshot must be a CacheSnapshot (cache.snapshot()), got "
                                f"{type(from_snapshot).__name__}")
            check_layers(self, from_snapshot.cache, "from_snapshot")
            if from_snapshot.batch_size not in (1, batch_size):
                raise ValueError(f"batch_size={batch_size} does not match from_snapshot's "
                                 f"{from_snapshot.batch_size} rows (a 1-row snapshot fills any "
                                 f"batch)")
            return from_snapshot.cache.copied(batch_size)
        rows = torch.zeros(batch_size, dtype=torch.long, device=self.embed.weight.device)
        layers = {i: layer.attn.new_cache(batch_size) for i, layer in self.layers.items()}
        return DecodeCache(layers, rows, rows.clone(), rows.new_empty(batch_size, 0),
                           self.cfg.max_seq_len)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: DecodeCache,
               lengths: Lengths = None, cu_seqlens: torch.Tensor | None = None,
               vision: VisionInput | None = None, last_only: bool = False,
               checkpoints: bool = False) -> torch.Tensor:
        """fp32 (float64 in a float64 model) logits [B, t, V] of tokens [B, t] after what
        `cache` holds, which then holds these positions too. t > 1 is a prefill. lengths [B]:
        each row's tokens, the rest of its t positions padding (default: all t); cu_seqlens:
        documents over the B*t positions as in K3Batch, the first of each row continuing its
        cached one; vision: the prompt's images as in K3Batch; last_only: the logits at each
        row's last token only [B, 1, V] (a prefill's next-token logits; unspecified for a row
        without tokens); checkpoints: the KDA states after each position are recorded, so that
        `cache.rewind(keep)` can keep any prefix of each row's positions since the first such
        call (one document per row). Quantile Balancing routes with its bias as it is and
        gathers no statistics. docs/model.md, "Decoding"."""
        check_inputs(self, tokens, cache, lengths, cu_seqlens, vision, checkpoints)
        with statistics_paused(self.balancers()):
            return self._decode_embedded(self.embed_tokens(tokens, vision), cache, lengths,
                                         cu_seqlens, last_only=last_only,
                                         checkpoints=checkpoints)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, cache: DecodeCache, snapshot_every: int,
                lengths: Lengths = None, cu_seqlens: torch.Tensor | None = None,
                vision: VisionInput | None = None
                ) -> tuple[torch.Tensor, list[CacheSnapshot]]:
        """`decode`, also returning a snapshot of the cache after every `snapshot_every`
        positions (each as `decode` of exactly those positions would leave it), so that a
        prompt sharing a prefix resumes without recomputing it. The call runs as pieces of
        `snapshot_every` positions, the vision tower once."""
        if not isinstance(snapshot_every, int) or snapshot_every < 1:
            raise ValueError(f"snapshot_every={snapshot_every!r} is invalid: must be an int >= 1")
        check_inputs(self, tokens, cache, lengths, cu_seqlens, vision)
        B, t = tokens.shape
        logits, snapshots = [], []
        with statistics_paused(self.balancers()):
            x = self.embed_tokens(tokens, vision)
            for start in range(0, t, snapshot_every):
                stop = min(start + snapshot_every, t)
                logits.append(self._decode_embedded(
                    x[:, start:stop], cache, *piece(lengths, cu_seqlens, B, t, start, stop)))
                if stop - start == snapshot_every:
                    snapshots.append(cache.snapshot())
        return torch.cat(logits, dim=1), snapshots

    def _decode_embedded(self, x: torch.Tensor, cache: DecodeCache, lengths: Lengths,
                         cu_seqlens: torch.Tensor | None,
                         fresh: torch.Tensor | None = None,
                         last_only: bool = False, checkpoints: bool = False) -> torch.Tensor:
        width = self.cfg.kda.conv_kernel - 1
        step = extend(cache, x.shape[1], lengths, cu_seqlens, width, fresh, checkpoints)
        state = BlockState(x, self.cfg.attnres_block_size)
        self._each_layer(state, None, lambda layer, blocks, partial: layer.decode(
            blocks, partial, cache.layers[str(layer.index)], step))
        positions = (step.lengths - 1).clamp(min=0) if last_only else None
        return self.head.decode_logits(state.sources(), positions)

    def balancers(self) -> list[QuantileBalancer]:
        return [moe.balancer for moe in self.moe_layers() if moe.balancer is not None]

    def moe_layers(self) -> list[LatentMoE]:
        return [layer.mlp for layer in self.layers.values() if isinstance(layer.mlp, LatentMoE)]

    def mla_layers(self) -> list[GatedMLA]:
        return [layer.attn for layer in self.layers.values() if isinstance(layer.attn, GatedMLA)]
