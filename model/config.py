"""Typed configuration of the K3 architecture, its presets and its validation.

Every field name here is also the Hydra config key (`configs/model/*.yaml` mirror these
dataclasses), so an error message can name the field a user has to change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .errors import ConfigError  # re-exported: callers import it from model.config too

# The special-token ids every preset shares with the data pipeline, whose tokenizer fixes them
# (data_pipeline/tokenizer.py: <pad>=0, <image>=3); k3-train checks them against the manifest.
PAD_TOKEN_ID = 0
IMAGE_TOKEN_ID = 3


def _fail(path: str, value, valid: str) -> None:
    raise ConfigError(f"{path}={value!r} is invalid: {valid}")


def _positive(path: str, value: int | float) -> None:
    if not value > 0:
        _fail(path, value, "must be > 0")


def _choice(path: str, value, choices) -> None:
    if value not in choices:
        _fail(path, value, f"must be one of {sorted(choices)}")


@dataclass
class KDAConfig:
    """Kimi Delta Attention."""

    num_heads: int = 96
    head_dim: int = 128  # d_k = d_v
    conv_kernel: int = 4
    gate: str = "lower_bound"
    gate_lower_bound: float = -5.0
    decay_rank: int = 128  # low-rank width of the decay logit projection
    chunk_size: int = 64
    # auto: fla on CUDA when installed, a registered CPU kernel (model/ops/cpu), else the torch
    # chunk form
    backend: str = "auto"

    def validate(self, path: str = "model.kda") -> None:
        for name in ("num_heads", "head_dim", "conv_kernel", "decay_rank", "chunk_size"):
            _positive(f"{path}.{name}", getattr(self, name))
        _choice(f"{path}.gate", self.gate, {"lower_bound", "kimi_linear"})
        _choice(f"{path}.backend", self.backend, {"auto", "torch", "fla"})
        if not self.gate_lower_bound < 0:
            _fail(f"{path}.gate_lower_bound", self.gate_lower_bound, "must be < 0 (a log decay)")
        if self.chunk_size % 16:
            _fail(f"{path}.chunk_size", self.chunk_size, "must be a multiple of 16 (the sub-tile)")


@dataclass
class MLAConfig:
    """Gated multi-head latent attention without positional encoding."""

    num_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # name kept from DeepSeek/Kimi configs; NoPE: never rotated
    v_head_dim: int = 128
    backend: str = "auto"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def validate(self, path: str = "model.mla") -> None:
        for name in ("num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim"):
            _positive(f"{path}.{name}", getattr(self, name))
        _choice(f"{path}.backend", self.backend, {"auto", "sdpa", "reference"})


@dataclass
class MoEConfig:
    """Stable LatentMoE with Quantile Balancing."""

    num_experts: int = 896
    top_k: int = 16
    num_shared_experts: int = 2
    latent_dim: int = 3584
    expert_intermediate: int = 3072
    router_scale: float = 1.0
    balancer: str = "quantile"
    qb_estimator: str = "histogram"
    qb_bins: int = 1000
    dispatch: str = "grouped_mm"
    slot_alignment: int = 1  # pad each expert's slot group to a multiple of this

    def validate(self, path: str = "model.moe") -> None:
        for name in ("num_experts", "top_k", "latent_dim", "expert_intermediate", "qb_bins",
                     "slot_alignment"):
            _positive(f"{path}.{name}", getattr(self, name))
        if self.num_shared_experts < 0:
            _fail(f"{path}.num_shared_experts", self.num_shared_experts, "must be >= 0")
        if self.top_k >= self.num_experts:
            _fail(f"{path}.top_k", self.top_k,
                  f"must be < num_experts={self.num_experts} (Quantile Balancing uses top-(k+1))")
        _choice(f"{path}.balancer", self.balancer, {"quantile", "none"})
        _choice(f"{path}.qb_estimator", self.qb_estimator, {"exact", "histogram"})
        _choice(f"{path}.dispatch", self.dispatch, {"grouped_mm", "loop"})


@dataclass
class VisionConfig:
    """MoonViT-V2 encoder and its projector into the language model."""

    hidden_size: int = 1024
    num_layers: int = 27
    num_heads: int = 12
    head_dim: int = 128
    intermediate_size: int = 4096
    patch_size: int = 14
    in_channels: int = 3
    pos_table_size: int = 64  # learned (size x size) table, bilinear-interpolated per image
    time_table_size: int = 4  # frames per video chunk, pooled in time
    merge_size: int = 2  # 2x2 space-to-depth merge before the projector
    projector_hidden: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.patch_size * self.patch_size

    def validate(self, path: str = "model.vision") -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "head_dim", "intermediate_size",
                     "patch_size", "in_channels", "pos_table_size", "time_table_size",
                     "merge_size", "projector_hidden"):
            _positive(f"{path}.{name}", getattr(self, name))
        if self.head_dim % 4:
            _fail(f"{path}.head_dim", self.head_dim, "must be divisible by 4 (2-D RoPE halves)")


@dataclass
class K3Config:
    """The whole multimodal model. Defaults are the published K3 shape (`k3_full`)."""

    name: str = "k3_full"
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_layers: int = 93
    mla_every: int = 4  # 1-based layers 4, 8, ... are MLA; the last layer is always MLA
    num_dense_layers: int = 1  # leading layers with a dense SiTU-GLU MLP instead of MoE
    dense_intermediate: int = 33792
    norm_eps: float = 1e-5
    attnres_block_size: int = 12  # counted in decoder layers (not sublayers)
    situ_beta_gate: float = 4.0
    situ_beta_up: float = 25.0
    max_seq_len: int = 1048576
    image_token_id: int = IMAGE_TOKEN_ID  # placeholder replaced by projected vision tokens
    pad_token_id: int = PAD_TOKEN_ID  # padding tokens: no loss, excluded from Quantile Balancing
    init_std: float = 0.006
    # Tokens per chunk of the LM head + cross entropy (fp32 logits held: chunk x vocab); 0 = the
    # whole micro-batch at once (the reference, and the vocabulary-parallel path).
    loss_chunk_tokens: int = 1024
    kda: KDAConfig = field(default_factory=KDAConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    vision: VisionConfig | None = field(default_factory=VisionConfig)

    def layer_types(self) -> list[str]:
        """'kda' or 'mla' per decoder layer (0-based list)."""
        return ["mla" if (i + 1) % self.mla_every == 0 or i == self.num_layers - 1 else "kda"
                for i in range(self.num_layers)]

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.num_dense_layers

    @property
    def num_attnres_blocks(self) -> int:
        return -(-self.num_layers // self.attnres_block_size)

    def validate(self, path: str = "model") -> K3Config:
        for name in ("vocab_size", "hidden_size", "num_layers", "mla_every", "dense_intermediate",
                     "attnres_block_size", "max_seq_len", "situ_beta_gate", "situ_beta_up",
                     "norm_eps", "init_std"):
            _positive(f"{path}.{name}", getattr(self, name))
        if self.loss_chunk_tokens < 0:
            _fail(f"{path}.loss_chunk_tokens", self.loss_chunk_tokens,
                  "must be >= 0 (0: no chunking)")
        if not 0 <= self.num_dense_layers <= self.num_layers:
            _fail(f"{path}.num_dense_layers", self.num_dense_layers,
                  f"must be in [0, num_layers={self.num_layers}]")
        for name in ("image_token_id", "pad_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                _fail(f"{path}.{name}", getattr(self, name),
                      f"must be a token id in [0, vocab_size={self.vocab_size})")
        self.kda.validate(f"{path}.kda")
        self.mla.validate(f"{path}.mla")
        self.moe.validate(f"{path}.moe")
        if self.vision is not None:
            self.vision.validate(f"{path}.vision")
        return self


def k3_full() -> K3Config:
    """The published shape: about 2.78T parameters, 104.2B active per token."""
    return K3Config().validate()


def k3_small() -> K3Config:
    """About 1B total parameters: every mechanism, fits one GPU."""
    return K3Config(
        name="k3_small", vocab_size=32768, hidden_size=1024, num_layers=16,
        dense_intermediate=4096, attnres_block_size=4, max_seq_len=65536, init_std=0.02,
        kda=KDAConfig(num_heads=8, head_dim=128, decay_rank=64),
        mla=MLAConfig(num_heads=8, q_lora_rank=384, kv_lora_rank=128, qk_nope_head_dim=64,
                      qk_rope_head_dim=32, v_head_dim=64),
        moe=MoEConfig(num_experts=48, top_k=4, num_shared_experts=2, latent_dim=512,
                      expert_intermediate=768),
        vision=VisionConfig(hidden_size=384, num_layers=6, num_heads=6, head_dim=64,
                            intermediate_size=1536, projector_hidden=1024),
    ).validate()


def k3_tiny() -> K3Config:
    """Trains on two CPU cores in minutes; still 3 KDA : 1 MLA, final MLA, 2 AttnRes blocks,
    a dense first layer, latent MoE with shared experts and QB, and a small MoonViT-V2."""
    return K3Config(
        name="k3_tiny", vocab_size=2048, hidden_size=64, num_layers=8,
        dense_intermediate=128, attnres_block_size=4, max_seq_len=4096, init_std=0.02,
        kda=KDAConfig(num_heads=2, head_dim=32, decay_rank=16, chunk_size=32),
        mla=MLAConfig(num_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=16),
        moe=MoEConfig(num_experts=8, top_k=2, num_shared_experts=2, latent_dim=32,
                      expert_intermediate=64, qb_bins=1000),
        vision=VisionConfig(hidden_size=64, num_layers=2, num_heads=2, head_dim=32,
                            intermediate_size=128, pos_table_size=16, projector_hidden=128),
    ).validate()


def k3_tiny_draft() -> K3Config:
    """A draft for k3_tiny's speculative decoding (the same vocabulary and tokenizer): two
    layers (a dense KDA one, a latent MoE MLA one), each as wide as k3_tiny's."""
    tiny = k3_tiny()
    return replace(tiny, name="k3_tiny_draft", num_layers=2).validate()


PRESETS = {"k3_tiny": k3_tiny, "k3_tiny_draft": k3_tiny_draft, "k3_small": k3_small,
           "k3_full": k3_full}


def preset(name: str) -> K3Config:
    if name not in PRESETS:
        _fail("model.name", name, f"must be one of {sorted(PRESETS)}")
    return PRESETS[name]()


def replace(cfg, **changes):
    """dataclasses.replace that re-validates a K3Config."""
    out = dataclasses.replace(cfg, **changes)
    return out.validate() if isinstance(out, K3Config) else out
