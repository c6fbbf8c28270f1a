"""Model FLOPs per token, counted analytically from the config (the same numbers `k3-plan`
prints): 2 FLOPs per weight a token passes through (routed experts: top_k of num_experts), plus
the attention cores, times 3 for forward + backward. Element-wise work (norms, activations,
gates) is not counted, as in Megatron's and PaLM's MFU convention, nor are the depthwise short
convolutions (element-wise multiply-adds, 0.03% of a K3 layer). The vision encoder's FLOPs
depend on the image mix, not on the text token count: `vision_forward_flops` counts them per
batch from grid_thw. Pipeline stages balance `layer_forward_flops_per_token`; the training
loop's MFU adds the vision FLOPs to the text's.
"""

from __future__ import annotations

from .config import K3Config
from .ops.kda import SUB_TILE
from .vision.layout import grids_from, num_chunks


def _weights_per_token(cfg: K3Config) -> dict[str, int]:
    """Weights a text token multiplies with in one sublayer of each kind."""
    d = cfg.hidden_size
    k, m, e = cfg.kda, cfg.mla, cfg.moe
    kda = (3 * d * k.num_heads * k.head_dim  # q, k, v
           + d * k.num_heads  # beta
           + d * k.decay_rank + k.decay_rank * k.num_heads * k.head_dim  # decay logit
           + 2 * d * k.num_heads * k.head_dim)  # output gate, output projection
    mla = (d * m.q_lora_rank + m.q_lora_rank * m.num_heads * m.qk_head_dim
           + d * (m.kv_lora_rank + m.qk_rope_head_dim)
           + m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
           + 2 * d * m.num_heads * m.v_head_dim)
    dense = 3 * d * cfg.dense_intermediate
    expert = 3 * e.latent_dim * e.expert_intermediate
    moe = (d * e.num_experts  # router
           + 2 * d * e.latent_dim  # latent down and up
           + 3 * d * e.num_shared_experts * e.expert_intermediate
           + e.top_k * expert)
    return {"kda": kda, "mla": mla, "dense": dense, "moe": moe, "head": d * cfg.vocab_size}


def _attention_core_flops(cfg: K3Config, seq_len: int, causal: bool) -> dict[str, float]:
    """Forward FLOPs per token of each attention core for documents of length seq_len.

    MLA: q.k and p.v over the visible context (on average (T+1)/2 tokens when causal, T when
    counting a dense masked kernel). KDA (the chunk form K3's bounded gate takes, chunk C, head
    dims K and V; model/ops/kda.py): the factorised intra-chunk scores of q and k rows of each
    16-row tile against the chunk's keys up to the tile's end (4Ke, with e = C (n + 1) / (2n)
    keys per row on average for n = C/16 tiles), W = A (k exp(G)) (2CK), U = A v and the
    intra-chunk output (2CV each) and the three state products (6KV); the unit-triangular
    inverse (C^2 per token) is a solve, which FLOP counters and MFU conventions leave out.
    """
    m, k = cfg.mla, cfg.kda
    ctx = (seq_len + 1) / 2 if causal else seq_len
    mla = 2 * m.num_heads * (m.qk_head_dim + m.v_head_dim) * ctx
    c, dk, dv = k.chunk_size, k.head_dim, k.head_dim
    tiles = c // SUB_TILE
    keys_per_row = c * (tiles + 1) / (2 * tiles)
    kda = k.num_heads * (4 * keys_per_row * dk + 2 * c * dk + 4 * c * dv + 6 * dk * dv)
    return {"mla": mla, "kda": kda}


def layer_forward_flops_per_token(cfg: K3Config, seq_len: int,
                                  causal: bool = True) -> list[float]:
    """Forward FLOPs per token of each decoder layer (KDA or MLA, dense MLP or MoE): the cost
    a pipeline split balances."""
    weights, core = _weights_per_token(cfg), _attention_core_flops(cfg, seq_len, causal)
    return [2 * weights[kind] + core[kind] + 2 * weights["moe" if cfg.is_moe_layer(i) else "dense"]
            for i, kind in enumerate(cfg.layer_types())]


def head_forward_flops_per_token(cfg: K3Config) -> int:
    """The LM head's projection (the last pipeline stage runs it after its layers)."""
    return 2 * _weights_per_token(cfg)["head"]


def _linear_weights_per_token(cfg: K3Config) -> int:
    """Weights of the language model a text token multiplies with (input embedding excluded)."""
    w = _weights_per_token(cfg)
    total = sum(w[kind] for kind in cfg.layer_types())
    total += sum(w["moe" if cfg.is_moe_layer(i) else "dense"] for i in range(cfg.num_layers))
    return total + w["head"]


def attention_flops_per_token(cfg: K3Config, seq_len: int, causal: bool = True) -> int:
    """Forward FLOPs of the attention cores per token (see _attention_core_flops)."""
    core = _attention_core_flops(cfg, seq_len, causal)
    return int(sum(core[kind] for kind in cfg.layer_types()))


def forward_flops_per_token(cfg: K3Config, seq_len: int, causal: bool = True) -> int:
    return 2 * _linear_weights_per_token(cfg) + attention_flops_per_token(cfg, seq_len, causal)


def training_flops_per_token(cfg: K3Config, seq_len: int) -> int:
    """Forward + backward (backward = 2x forward)."""
    return 3 * forward_flops_per_token(cfg, seq_len)


def vision_forward_flops(cfg: K3Config, grid_thw) -> int:
    """Forward FLOPs of MoonViT on the images and videos of one batch (grid_thw [I, 3], host
    rows): the patch embedding, each block's q/k/v/o projections, MLP and attention core (every
    patch against its whole segment: an image, or a video chunk of up to time_table_size frames),
    and the projector on the merged tokens. Position-table interpolation and pooling are
    element-wise and not counted."""
    v = cfg.vision
    width = v.num_heads * v.head_dim
    patches = segment_squares = merged = 0
    for t, h, w in grids_from(grid_thw):
        patches += t * h * w
        full, rest = divmod(t, v.time_table_size)
        segment_squares += (full * v.time_table_size**2 + rest**2) * (h * w) ** 2
        merged += num_chunks(t, v) * (h // v.merge_size) * (w // v.merge_size)
    # Multiply-adds, 2 FLOPs each.
    embed = patches * v.patch_dim * v.hidden_size
    block = (patches * (4 * v.hidden_size * width + 2 * v.hidden_size * v.intermediate_size)
             + 2 * width * segment_squares)  # q.k and p.v
    projector = merged * (v.merge_size**2 * v.hidden_size + cfg.hidden_size) * v.projector_hidden
    return 2 * (embed + v.num_layers * block + projector)


def vision_training_flops(cfg: K3Config, micro_batches) -> int:
    """Forward + backward (3x forward, as for the text) FLOPs of MoonViT over the images and
    videos of these micro-batches (K3Batch; their grid_thw on the host, as the loader yields)."""
    return 3 * sum(vision_forward_flops(cfg, mb.vision.grid_thw) for mb in micro_batches
                   if mb.vision is not None)
