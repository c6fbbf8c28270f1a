"""k3-plan's collective bytes: what one rank hands to each collective in one optimizer step,
per op and per source, in the dry run's convention (train/step_probes.py: all_reduce's and
broadcast's tensor, all_gather's output, reduce_scatter's and all_to_all's input, send's and
recv's tensor), so `dry_run.json`'s `collective_bytes` can be read against it.

Counted for pipeline rank `pp_rank`'s stages (the first: it holds the embedding and vision
tower), from the model's shapes and the layout, per micro-batch and layer kind. With a the
activation bytes (2 under bf16), T the tokens a rank holds of a row (seq_len / context), B the
rows of a micro-batch, d the hidden size, A = B*T*d*a (one activation whole over the
tensor-parallel ranks), and each forward collective run again by activation checkpointing's
recomputation (rc = 1 with it; the collective after a layer's last saved tensor is not
recomputed: torch's recomputation stops there):

    tensor parallel    with sequence parallelism, each attention and dense MLP: all_gather
                       and reduce_scatter of A forward, again in the recomputation, and their
                       mirrors in backward; each MoE layer: the all_gather of its tokens'
                       outputs (its tokens are split across the ranks; with several local
                       rows also the sequence before the flattening, recomputed, and both in
                       backward); the embedding's fp32 output reduce-scattered (backward
                       all-gathered), the head's input all-gathered (backward
                       reduce-scattered). Without it: all_reduce of each module's partial
                       output (recomputed), and in backward of its input's and output's
                       partial gradients; the MoE's output gathered, in backward its input's
                       gradient gathered and its output's reduce-scattered; the embedding's
                       all-reduced. The replicated
                       parameters' partial gradients (norms, mixes, routers, latent
                       projections, shared experts): all_reduce, fp32, per micro-batch where
                       data parallelism reduces each one's, else once
    expert tensor      per MoE layer, the etp peers' tokens, expert ids and routing weights
                       all-gathered and their outputs reduce-scattered (parallel/moonep/
                       traffic.py), recomputed; backward the transposes
    MoonEP             per MoE layer, its dispatch's buffers (collective: all-gathers of every
                       rank's tokens and routes, the combine's fp32 reduce-scatter; symm_mem:
                       its static buffers, which the dry run hands to one all-to-all each),
                       the copied experts' relay (all_to_all), recomputed; backward the
                       gradients of each
    context parallel   per KDA layer the three convolutions' halos and KCP's fp32 state
                       summaries, per MLA layer the row's latents, all-gathered (recomputed),
                       reduce-scattered in backward
    pipeline           each micro-batch's boundary tensors (the partial sum and the AttnRes
                       blocks crossing it) to the next stage and their gradients back
    data parallel      data_parallel_bytes (below): FSDP2's gathers and reduce-scatters (per
                       micro-batch without the pipeline, whose schedule reduces once),
                       replicas' all-reduces, ZeRO-1's broadcasts, Quantile Balancing's counts
    Muon               each cut matrix's update to its owner and back (two all_to_alls of
                       its fp32 shard), gathered within the tensor-parallel ranks first where
                       another dimension (FSDP2's) is the exchange's

Scalars (loss tokens, gradient norms, QK-Clip's maxima) are left out: bytes, not megabytes.
FSDP2's padding of dim 0 to its shards is left out too.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from model.k3 import K3Model
from model.kda import KimiDeltaAttention
from model.mlp import SiTUGLUMLP
from model.moe.layer import LatentMoE
from parallel.apply import qb_count_dtype, stage_costs
from parallel.moonep.transport import copy_piece
from parallel.pipeline import crossing_blocks, prune_to_stages, rank_stages
from parallel.tensor_parallel import kda_shards, mla_shards, mlp_shards
from parallel.topology import Topology

from .optim.factory import head_blocks, param_role

FP32, INT32 = 4, 4


def activation_bytes_per_element(precision: str) -> int:
    return {"fp64": 8, "fp32": 4}.get(precision, 2)  # auto: k3-plan sizes GPUs (bf16)


def stage_model(cfg, layout: Topology, pp_rank: int = 0, model: K3Model | None = None
                ) -> tuple[K3Model, list[range], list[int]]:
    """The meta-device model (`model`, pruned in place, or a new one) pruned to pipeline rank
    `pp_rank`'s stages, with every stage's layers and the ids of the rank's (one stage of all
    the layers without the pipeline)."""
    if model is None:
        with torch.device("meta"):
            model = K3Model(cfg.model)
    if layout.pp == 1:
        return model, [range(cfg.model.num_layers)], [0]
    splits, ids = rank_stages(*stage_costs(cfg), layout.pp, pp_rank, layout.virtual_stages,
                              layout.pipeline_schedule)
    return prune_to_stages(model, splits, ids), splits, ids


def _add(out: dict, term: str, op: str, nbytes: float) -> None:
    if nbytes:
        out[term][op] += nbytes


def _layer_kinds(model: K3Model) -> dict[str, int]:
    kinds: dict[str, int] = defaultdict(int)
    for layer in model.layers.values():
        kinds["kda" if isinstance(layer.attn, KimiDeltaAttention) else "mla"] += 1
        kinds["moe" if isinstance(layer.mlp, LatentMoE) else "dense"] += 1
    return kinds


def tensor_parallel_sharded(model: K3Model) -> set[str]:
    """Names of the parameters the tensor-parallel plan shards (the rest are replicated on its
    ranks, the experts aside: they follow the expert layouts)."""
    sharded = {"embed.weight", "head.output.weight"}
    for index, layer in model.layers.items():
        plans = [("attn", kda_shards() if isinstance(layer.attn, KimiDeltaAttention)
                  else mla_shards())]
        if isinstance(layer.mlp, SiTUGLUMLP):
            plans.append(("mlp", mlp_shards()))
        for module, shards in plans:
            sharded |= {f"layers.{index}.{module}.{key}" for key in shards}
    return sharded


def _replicated_partial(model: K3Model, sequence_parallel: bool) -> tuple[int, int]:
    """Elements of the tensor-parallel replicated parameters whose gradients are partial sums
    over its ranks: all of them under sequence parallelism (every op sees a slice of the
    tokens); without it, those inside the head-parallel modules and the MoE (the norms and
    mixes between them see every token on every rank). The vision tower runs whole on every
    rank. Returns (elements, the routers' among them)."""
    sharded = tensor_parallel_sharded(model)
    total = routers = 0
    for name, p in model.named_parameters():
        if name in sharded or ".experts." in name or name.startswith(("vision.", "embed.")):
            continue
        between = name.startswith("head.") or any(
            f".{m}." in name for m in ("attn_norm", "mlp_norm", "attn_mix", "mlp_mix"))
        if sequence_parallel or not between:
            total += p.numel()
            routers += p.numel() if ".router." in name else 0
    return total, routers


def _tensor_parallel(out, model, layout, kinds, s) -> None:
    tp = layout.tp
    if tp == 1:
        return
    term, A = "tensor parallel", s["activation"]
    fp32_activation = s["tokens"] * s["hidden"] * max(s["a"], FP32)  # the embedding's output
    blocks = kinds["kda"] + kinds["mla"] + kinds["dense"]  # head-parallel modules
    passes = 2 + s["rc"]  # forward, recomputation, backward's mirror
    mb = s["micro_batches"]
    if layout.sequence_parallel:
        # The MoE's tokens: one row's sequence shards are contiguous runs of its flattened
        # tokens, so only the outputs are gathered; several local rows (micro-batches of
        # several, zig-zag's two pieces) gather the sequence before the flattening too, which
        # the recomputation repeats, and backward mirrors both.
        moe = 1 if s["local_rows"] == 1 else 2 + s["rc"] + 2
        _add(out, term, "all_gather", mb * A * (passes * blocks + moe * kinds["moe"]))
        _add(out, term, "reduce_scatter", mb * A * passes * blocks)
        if model.embed is not None:
            _add(out, term, "reduce_scatter", mb * fp32_activation)
            _add(out, term, "all_gather", mb * fp32_activation)
        if model.head is not None:
            _add(out, term, "all_gather", mb * A)
            _add(out, term, "reduce_scatter", mb * A)
    else:
        # Each head-parallel module's partial output all-reduced (recomputed), and in backward
        # both its input's and its output's partial gradients; the MoE's outputs gathered, in
        # backward its input's gradient gathered and its output's reduce-scattered.
        _add(out, term, "all_reduce", mb * A * (passes + 1) * blocks)
        _add(out, term, "all_gather", mb * A * 2 * kinds["moe"])
        _add(out, term, "reduce_scatter", mb * A * kinds["moe"])
        if model.embed is not None:
            _add(out, term, "all_reduce", 2 * mb * fp32_activation)
    # FSDP2 completes each micro-batch's in the dtype it gathered the parameters in (before
    # reducing them in fp32); the pipeline and the other modes the step's accumulated ones.
    partial, routers = _replicated_partial(model, layout.sequence_parallel)
    if s["per_micro_batch"]:
        _add(out, term, "all_reduce", mb * (s["gather_bytes"] * (partial - routers)
                                            + max(s["a"], FP32) * routers))
    else:
        _add(out, term, "all_reduce", max(s["a"], FP32) * partial)


def _experts(out, cfg, layout, kinds, s) -> None:
    """Expert tensor parallelism's exchange and MoonEP's dispatch, per MoE layer."""
    moe, n, R = cfg.model.moe, layout.etp, layout.ep
    mb_layers = s["micro_batches"] * kinds["moe"]
    forward_passes = 1 + s["rc"]
    a, K, L = s["a"], moe.top_k, moe.latent_dim
    own = s["tokens"] // layout.tp  # SplitTokens: each tensor-parallel rank its 1/tp
    if n > 1:
        term = "expert tensor parallel"
        _add(out, term, "all_gather", mb_layers * n * own * (
            forward_passes * (L * a + K * (INT32 + FP32)) + L * a))
        _add(out, term, "reduce_scatter", mb_layers * n * own * (
            forward_passes * L * a + L * a + K * FP32))
    if R == 1:
        return
    term, S = "MoonEP", own * n
    E, inter = moe.num_experts, moe.expert_intermediate // n
    relay = 2 * E * (copy_piece(2 * inter * L, R) + copy_piece(inter * L, R))
    counts = R * E * INT32
    _add(out, term, "all_to_all", mb_layers * relay * (forward_passes * a + FP32))
    if cfg.parallel.expert_dispatch == "dynamic":  # balanced routing: S*K rows each way
        rows = S * K * L * a
        _add(out, term, "all_to_all", mb_layers * 2 * rows * (forward_passes + 1))
        return
    _add(out, term, "all_gather", mb_layers * forward_passes * counts)
    if cfg.parallel.moonep.transport == "symm_mem":
        capacity = S * min(K, R)
        forward = S * K * (2 * INT32 + FP32) + capacity * L * (a + FP32)
        backward = S * K * FP32 + capacity * L * (a + FP32)
        _add(out, term, "all_to_all", mb_layers * (forward_passes * forward + backward))
        return
    _add(out, term, "all_gather", mb_layers * R * S * (
        forward_passes * (K * (INT32 + FP32) + L * a) + L * FP32))
    _add(out, term, "reduce_scatter", mb_layers * R * S * (
        forward_passes * L * FP32 + L * a + K * FP32))


def _context_parallel(out, cfg, layout, kinds, s) -> None:
    F = layout.cp
    if F == 1:
        return
    kda, mla, rows = cfg.model.kda, cfg.model.mla, s["rows"]
    pieces = 2 if layout.context_layout == "zigzag" else 1
    heads = kda.num_heads // layout.tp
    halo = 3 * F * pieces * rows * (kda.conv_kernel - 1) * heads * kda.head_dim * s["a"]
    summary = F * pieces * rows * heads * kda.head_dim * 2 * kda.head_dim * FP32
    latents = rows * cfg.stage.seq_len * (mla.kv_lora_rank + mla.qk_rope_head_dim) * s["a"]
    per_micro_batch = kinds["kda"] * (halo + summary) + kinds["mla"] * latents
    term, mb = "context parallel", s["micro_batches"]
    _add(out, term, "all_gather", mb * (1 + s["rc"]) * per_micro_batch)
    _add(out, term, "reduce_scatter", mb * per_micro_batch)


def _pipeline(out, cfg, layout, splits, ids, s) -> None:
    if layout.pp == 1:
        return
    per_tensor = s["activation"] / (layout.tp if layout.sequence_parallel else 1)
    stages, block = len(splits), cfg.model.attnres_block_size
    for stage in ids:
        for boundary in (stage, stage + 1):  # into this stage, out of it
            if 0 < boundary < stages:
                tensors = 1 + crossing_blocks(splits[boundary].start, block)
                for op in ("send", "recv"):  # activations one way, gradients the other
                    _add(out, "pipeline", op, s["micro_batches"] * tensors * per_tensor)


def _muon(out, model, layout, s) -> None:
    """Each matrix a mesh dimension cuts (FSDP2's shards of a matrix's rows, the
    tensor-parallel shards other than whole heads, the etp shards of the experts): its fp32
    update to its owner and back; within the tensor-parallel ranks first gathered where FSDP2
    also cuts it."""
    fsdp = layout.data_shard == "full"
    dense_shards = layout.dp_shard * layout.cp if fsdp else 1
    expert_shards = layout.edp // layout.dp_replicate if fsdp else 1
    # ZeRO-1: each matrix is orthogonalised by its owner only (one of the shard ranks).
    owners = (layout.dp_shard * layout.cp if layout.data_shard == "optimizer" else 1)
    sharded = tensor_parallel_sharded(model) if layout.tp > 1 else set()
    per_head = head_blocks(model)
    update = 8 if s["a"] == 8 else FP32
    for name, p in model.named_parameters():
        if param_role(name, p) != "matrix":
            continue
        if ".experts." in name:
            local = p.numel() / (layout.ep * layout.etp * expert_shards)
            # FSDP2 shards whole experts (the stack's dim 0): only etp cuts a matrix.
            if layout.etp > 1:
                _add(out, "Muon", "all_to_all", 2 * update * local / (
                    layout.edp // layout.dp_replicate if owners > 1 else 1))
            continue
        tp_cut = name in sharded and name not in per_head
        local = p.numel() / ((layout.tp if name in sharded else 1) * dense_shards)
        if dense_shards > 1:
            if tp_cut:
                _add(out, "Muon", "all_gather", update * local * layout.tp)
                local *= layout.tp
            _add(out, "Muon", "all_to_all", 2 * update * local)
        elif tp_cut:
            _add(out, "Muon", "all_to_all", 2 * update * local / owners)


def data_parallel_bytes(model: K3Model, layout: Topology, tokens_per_step: int = 0,
                        gather_bytes: int = 4, micro_batches: int = 1) -> dict[str, int]:
    """Bytes one rank passes to each data-parallel collective per optimizer step (the buffer of
    every call: all_reduce's and broadcast's tensor, all_gather's output, reduce_scatter's
    input; fp32 parameters and gradients). `model`: the built (meta-device) parameters of this
    rank's stages (collective_sizing.stage_model; the whole model without the pipeline), the
    first stage's holding the root parameters (embedding, vision tower; the last's the LM
    head); `gather_bytes`: gathered_bytes of the run. Each group of parameters reduced over its
    own ranks adds its terms: the dense ones (and the experts with them when they are whole on
    every rank) over the dp x cp ranks, the experts under expert or expert tensor parallelism
    over their expert-data ranks, as units of their own. With N a group's parameters on this
    rank (the tensor-parallel shards, the replicated ones whole), N_root those of the root
    unit, N_gathered those FSDP2 gathers in g = gather_bytes (all but the root's and the
    routers'; N_gathered = 0 when g = 4), S its shard ranks within a replica, G = 4N - (4 - g)
    N_gathered the bytes of one gather of all and m the micro-batches of the step:

        none        all_reduce 4N (after the last micro-batch's backward)
        optimizer   all_reduce 4N; broadcast 4N (owners send updated parameters within a
                    replica, when S > 1)
        full        when S > 1, without the pipeline: per micro-batch all_gather 2G - 4 N_root
                    (the non-root units gather again in backward) and reduce_scatter 4N; under
                    the pipeline (its schedule keeps a stage's parameters gathered through
                    backward and reduces once): all_gather (m + 1)(G - 4 N_root) + 4 N_root,
                    reduce_scatter 4N. HSDP adds all_reduce 4N / S per reduction
        QB counts   every MoE layer's statistics ([E, bins + 1]), one all_reduce, in int32 below
                    2**31 tokens a step (parallel.apply.qb_count_dtype)

    The loss-token count, gradient norms and max logits add a few hundred bytes to all_reduce;
    tensor-parallel traffic is not data-parallel and not counted here
    (collective_sizing.step_collective_bytes counts it)."""
    if layout.dp * layout.cp == 1:
        return {}
    split = tensor_parallel_sharded(model) if layout.tp > 1 else set()
    sizes = {name: p.numel() / (layout.tp if name in split else 1)
             for name, p in model.named_parameters()}
    experts = sum(n for name, n in sizes.items() if ".experts." in name) / (layout.ep
                                                                          * layout.etp)
    dense = sum(n for name, n in sizes.items() if ".experts." not in name)
    root = sum(n for name, n in sizes.items() if not name.startswith("layers."))
    routers = sum(n for name, n in sizes.items() if ".router." in name)
    # (parameters, ranks, shard ranks within a replica, root, routers) of each group
    dense_shards = layout.dp_shard * layout.cp
    if layout.ep * layout.etp > 1:
        shards = layout.edp // layout.dp_replicate
        if layout.data_shard == "full":
            # FSDP2 shards the stacks' expert dim, padded to a multiple of the shards: fewer
            # experts than shards gather (and reduce) padding rows too.
            local = model.cfg.moe.num_experts // layout.ep
            experts *= -(-local // shards) * shards / local
        groups = [(dense, layout.dp * layout.cp, dense_shards, root, routers),
                  (experts, layout.edp, shards, 0, 0)]
    else:
        groups = [(dense + experts, layout.dp * layout.cp, dense_shards, root, routers)]
    pipelined = layout.pp > 1
    reductions = 1 if pipelined else micro_batches
    out: dict[str, float] = defaultdict(float)
    for n, ranks, shards, n_root, n_routers in groups:
        if ranks == 1:
            continue
        if layout.data_shard == "full":
            if shards > 1:  # FSDP2 neither gathers nor reduce-scatters over one shard rank
                gather = 4 * n - (4 - gather_bytes) * (n - n_root - n_routers)
                out["all_gather"] += ((micro_batches + 1) * (gather - 4 * n_root) + 4 * n_root
                                      if pipelined else
                                      micro_batches * (2 * gather - 4 * n_root))
                out["reduce_scatter"] += reductions * 4 * n
            if layout.dp_replicate > 1:
                out["all_reduce"] += reductions * 4 * n / shards
            continue
        out["all_reduce"] += 4 * n
        if layout.data_shard == "optimizer" and shards > 1:
            out["broadcast"] += 4 * n
    dtype = qb_count_dtype(tokens_per_step)
    out[f"QB counts ({str(dtype).removeprefix('torch.')})"] = dtype.itemsize * sum(
        moe.balancer.local_statistics().numel() for moe in model.moe_layers()
        if moe.balancer is not None)
    return {k: round(v) for k, v in out.items()}


def step_collective_bytes(cfg, layout: Topology, stage: tuple, gather_bytes: int) -> dict:
    """{"total": {op: bytes}, "terms": {source: {op: bytes}}} of one optimizer step on a rank
    of a pipeline stage (module docstring). `cfg`: the TrainConfig; `stage`: stage_model's
    (model, splits, ids) of the rank; `gather_bytes`: the bytes per element FSDP2 gathers the
    layers in (sizing.gathered_bytes)."""
    model, splits, ids = stage
    kinds = _layer_kinds(model)
    rows, seq = cfg.stage.micro_batch_size, cfg.stage.seq_len
    a = activation_bytes_per_element(cfg.precision.name)
    tokens = rows * seq // layout.cp
    pieces = 2 if layout.cp > 1 and layout.context_layout == "zigzag" else 1
    s = {"rows": rows, "local_rows": rows * pieces, "tokens": tokens,
         "hidden": cfg.model.hidden_size, "a": a,
         "activation": tokens * cfg.model.hidden_size * a,
         "rc": 1 if cfg.activation_checkpointing else 0,
         "micro_batches": cfg.stage.global_batch_size // (rows * layout.dp),
         # FSDP2 reduces the gradients of each micro-batch unless the pipeline's schedule
         # holds them back to the last one (replicas reduce after the last anyway).
         "per_micro_batch": (layout.pp == 1 and layout.dp * layout.cp > 1
                             and layout.data_shard == "full"),
         "gather_bytes": gather_bytes}
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for op, nbytes in data_parallel_bytes(model, layout, cfg.stage.global_batch_size * seq,
                                          gather_bytes, s["micro_batches"]).items():
        _add(out, "Quantile Balancing" if op.startswith("QB") else "data parallel",
             "all_reduce" if op.startswith("QB") else op, nbytes)
    _tensor_parallel(out, model, layout, kinds, s)
    _experts(out, cfg, layout, kinds, s)
    _context_parallel(out, cfg, layout, kinds, s)
    _pipeline(out, cfg, layout, splits, ids, s)
    if cfg.optim.name == "muon":
        _muon(out, model, layout, s)
    terms = {term: {op: round(n) for op, n in sorted(ops.items())} for term, ops in out.items()}
    total: dict[str, int] = defaultdict(int)
    for ops in terms.values():
        for op, n in ops.items():
            total[op] += n
    return {"total": dict(sorted(total.items())), "terms": terms}

