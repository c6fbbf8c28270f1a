"""`k3-plan`: parameters, active parameters, FLOPs per token and memory per GPU for a model and a
parallel layout, from the same configs as `k3-train`.

    k3-plan model=k3_full parallel.tensor=8 parallel.expert=64 parallel.pipeline=8 \
        parallel.data=64 stage.seq_len=8192 stage.micro_batch_size=1 [--json] [--long-context]

--long-context adds the memory per GPU at 8K, 64K, 256K and 1M tokens per sequence with the
same layout, and whether each fits an H200 (141 GB, 10% kept free).

The model is built on the meta device (no memory, no time), so the counts are the real module's.
Memory is an estimate: the weights as the step holds them (whole; FSDP2's gathered, which a
pipeline stage keeps through its micro-batches: bf16 under parallel.fsdp_param_dtype=compute,
else fp32 and autocast's bf16 copies), fp32 gradients, FSDP2's fp32 master shards and
the optimizer states (AdamW 2, Muon 1 fp32 per parameter), sharded (ZeRO-1 or FSDP2) over the
data-parallel ranks of each parameter within one HSDP replica, and activations from the tensors
the modules save for backward, traced on the meta device (see activation_bytes). Data-parallel
traffic: the bytes one rank hands to each collective per optimizer step (see
data_parallel_bytes; benchmarks/parallel_overhead.py counts them).
"""

from __future__ import annotations

import json
import math
import sys

import hydra
import torch
from omegaconf import DictConfig

from model.config import K3Config
from model.errors import ConfigError
from model.k3 import K3Model
from model.params import count_parameters
from parallel.moonep.traffic import moe_layer_traffic, symm_mem_rows
from parallel.pipeline import crossing_blocks
from parallel.topology import Topology, expert_tensor_size

from .cli import CONFIG_DIR, hydra_exit_codes, prepare_tool_argv, register_configs, to_train_config
from .collective_sizing import data_parallel_bytes, stage_model, step_collective_bytes
from .flops import forward_flops_per_token, training_flops_per_token
from .saved_activations import checkpointed_inputs_bytes, traced_head_bytes, traced_layer_bytes

GiB = 2**30


def plan_topology(cfg, world_size: int | None = None) -> Topology:
    """The validated layout (parallel/topology.py) of the world these sizes make, data x tensor x
    context x pipeline ranks. k3-plan has no world of its own (unless `world_size` is given, as
    the dry run does): data=-1 takes the fewest data ranks that hold whole expert groups
    (expert*expert_tensor dividing data*context*tensor)."""
    p = cfg.parallel
    if world_size is not None:
        return Topology.from_config(p, world_size, cfg.model)
    data = p.data
    if data == -1:
        span = max(p.expert * expert_tensor_size(p), 1)
        data = span // math.gcd(span, max(p.tensor * p.context, 1))
    world = max(data, 1) * p.tensor * p.context * p.pipeline
    return Topology.from_config(p, world, cfg.model)


def layout_dict(t: Topology) -> dict:
    return {"world_size": t.world_size, "pipeline": t.pp, "data": t.dp,
            "data_replicate": t.dp_replicate, "data_shard": t.data_shard, "context": t.cp,
            "tensor": t.tp, "sequence_parallel": t.sequence_parallel, "expert": t.ep,
            "expert_tensor": t.etp, "expert_data": t.edp, "virtual_stages": t.virtual_stages,
            "pipeline_schedule": t.pipeline_schedule}


def saved_after_forward(cfg: K3Config, seq_len: int, micro_batch: int, num_layers: int,
                        checkpointing: bool) -> tuple[int, int]:
    """(embedding + layers + head, largest layer) bytes kept for backward after the forward of
    one micro-batch through `num_layers` layers, counted by tracing the real modules on the meta
    device (train/saved_activations.py: bf16, with the fp32 tensors the model keeps). With
    activation checkpointing the layers count what they hold for recomputation; without it, a
    pipeline stage's (num_layers below the model's) count the AttnRes blocks it receives too."""
    per_layer = traced_layer_bytes(cfg, micro_batch, seq_len)
    embedding, head = traced_head_bytes(cfg, micro_batch, seq_len)
    if checkpointing:
        layers = checkpointed_inputs_bytes(cfg, micro_batch, seq_len, num_layers)
    else:
        layers = sum(sorted(per_layer)[-num_layers:])
        if num_layers < cfg.num_layers:  # a later stage's mixes keep the blocks it receives
            layers += cfg.num_attnres_blocks * micro_batch * seq_len * cfg.hidden_size * 2
    return embedding + layers + head, max(per_layer)


_PROBE_TRACES: dict[tuple, list[tuple[int, int]]] = {}  # K3Config is unhashable: keyed by its repr


PROBES = (1024, 2048, 4096)  # the lengths the fit traces


def fitted_saved_after_forward(cfg: K3Config, seq_len: int, micro_batch: int, num_layers: int,
                               checkpointing: bool, probes=PROBES) -> tuple[int, int]:
    """`saved_after_forward` at any length from traces at three short ones: every saved
    tensor's size is a polynomial of degree <= 2 in the tokens (linear for projections, chunk
    states and the blockwise attention's statistics; quadratic only for a dense [T, T] mask or
    score matrix, if the model saves one), so the quadratic through three points is exact. The
    trace itself runs the layers' Python per chunk and would take minutes at 64K tokens. The
    probe traces do not depend on `seq_len`: each configuration traces them once (every context
    stage of `--long-context` reads the same three)."""
    key = (repr(cfg), micro_batch, num_layers, checkpointing, tuple(probes))
    if key not in _PROBE_TRACES:
        _PROBE_TRACES[key] = [saved_after_forward(cfg, t, micro_batch, num_layers, checkpointing)
                              for t in probes]
    points = _PROBE_TRACES[key]

    def at(values: list[int]) -> int:  # Lagrange interpolation through the probes
        total = 0.0
        for i, (ti, vi) in enumerate(zip(probes, values, strict=True)):
            w = 1.0
            for j, tj in enumerate(probes):
                if j != i:
                    w *= (seq_len - tj) / (ti - tj)
            total += w * vi
        return round(total)

    return at([p[0] for p in points]), at([p[1] for p in points])


def activation_bytes(cfg: K3Config, seq_len: int, micro_batch: int, layout: Topology,
                     checkpointing: bool, fitted: bool = False) -> float:
    """Activations kept for backward on one GPU: a stage's share of `saved_after_forward`
    (the head as configured: with the chunked loss no vocabulary-sized logits remain, with
    `loss_chunk_tokens=0` the fp32 logits are counted) for each of up to `pipeline` micro-batches
    that 1F1B keeps in flight on the first stage, plus one layer's recomputation with activation
    checkpointing. Tensor parallelism splits heads, and sequence parallelism the rest, across
    its ranks. Beyond the fit's longest probe the fit is used whatever `fitted` says: it equals
    the trace (tests/unit/train/test_plan.py) at a fraction of its cost."""
    layers_per_stage = -(-cfg.num_layers // layout.pp)
    fitted = fitted or seq_len // layout.cp > max(PROBES)
    saved_fn = fitted_saved_after_forward if fitted else saved_after_forward
    saved, largest_layer = saved_fn(cfg, seq_len // layout.cp, micro_batch, layers_per_stage,
                                    checkpointing)
    recompute = largest_layer if checkpointing else 0
    return (saved * layout.pp + recompute) / layout.tp


def _bf16(precision: str) -> bool:
    return precision in ("auto", "bf16", "mxfp4_qat")  # auto: k3-plan sizes GPUs


def gathered_bytes(precision: str, data_shard: str, fsdp_param_dtype: str) -> int:
    """Bytes per element of a decoder layer's parameters as the step uses them whole: 2 where
    FSDP2 gathers them in bf16 (parallel.fsdp_param_dtype=compute under bf16; the routers and
    the root's embedding, head and vision tower stay fp32), else the parameters' own (fp32, or
    float64)."""
    if _bf16(precision) and data_shard == "full" and fsdp_param_dtype == "compute":
        return 2
    return 8 if precision == "fp64" else 4


def held_weight_bytes(precision: str, data_shard: str, fsdp_param_dtype: str) -> int:
    """Bytes per parameter a rank holds whole during the step, besides the shards, gradients
    and optimizer state: the gathered parameters, and where they are fp32 under bf16 autocast
    also their bf16 copies, which autocast keeps until its region ends (a pipeline schedule's
    step spans it)."""
    held = gathered_bytes(precision, data_shard, fsdp_param_dtype)
    return held + 2 if _bf16(precision) and held == 4 else held


def pipeline_buffer_bytes(cfg: K3Config, layout: Topology, seq_len: int, micro_batch: int,
                          micro_batches: int) -> float:
    """The receive buffers torch's pipeline stage makes for every micro-batch of a step and
    keeps: the inputs from the stage before and the gradients from the stage after, each the
    partial sum and the AttnRes blocks crossing the boundary (parallel/pipeline.py), bf16,
    the tokens split by context and (sequence parallelism) tensor parallelism. Counted for a
    middle stage, which receives both (the first stage only gradients, the last only inputs);
    nothing without the pipeline."""
    if layout.pp == 1:
        return 0.0
    first_of_next = -(-cfg.num_layers // layout.pp)
    tensors = 1 + crossing_blocks(first_of_next, cfg.attnres_block_size)
    tokens = micro_batch * seq_len / layout.cp / (layout.tp if layout.sequence_parallel else 1)
    return 2 * micro_batches * tensors * tokens * cfg.hidden_size * 2


def moe_dispatch_bytes(cfg: K3Config, layout: Topology, seq_len: int, micro_batch: int,
                       transport: str) -> float:
    """What one MoE layer's MoonEP dispatch holds at once besides the tensors the layer saves
    (the largest layer's recomputation counts those), under expert parallelism: the weighted
    expert rows before the combine (S*K x L, fp32), the combine's send and receive buffers
    (fp32, S*min(K, R-1) rows each on symm_mem, R*S on collective), the tokens received
    (bf16, as many rows) and the home experts' weights with this micro-batch's copies (2 E/R
    experts, bf16). S: a rank's tokens (split by context and tensor parallelism), times the
    expert-tensor-parallel ranks (each dispatches its peers' tokens too, gathered in bf16, and
    reduce-scatters their bf16 outputs)."""
    if layout.ep == 1 and layout.etp == 1:
        return 0.0
    moe, ranks = cfg.moe, layout.ep
    tokens = micro_batch * seq_len / layout.cp / layout.tp * layout.etp
    weighted = tokens * moe.top_k * moe.latent_dim * 4
    gathered = 2 * tokens * moe.latent_dim * 2 if layout.etp > 1 else 0
    if ranks == 1:  # the local dispatch: no transport buffers, no copies
        return weighted + gathered
    rows = (symm_mem_rows(tokens, moe.top_k, ranks) if transport == "symm_mem"
            else ranks * tokens)
    expert = 3 * moe.latent_dim * moe.expert_intermediate / layout.etp
    return (weighted + gathered + rows * moe.latent_dim * (2 * 4 + 2)
            + 2 * moe.num_experts / ranks * expert * 2)


def memory_per_gpu(cfg: K3Config, counts, layout: Topology, optimizer: str, seq_len: int,
                   micro_batch: int, checkpointing: bool, fitted: bool = False,
                   weight_bytes: int = 6, micro_batches: int | None = None) -> dict[str, float]:
    """`weight_bytes`: held_weight_bytes of the run (default: fp32 parameters under bf16
    autocast); `micro_batches` per step on a rank (default: one per pipeline stage, the fewest
    the schedules take)."""
    routed = counts.routed_experts
    dense = counts.total - routed
    dense_local = dense / (layout.tp * layout.pp)
    expert_local = routed / (layout.ep * layout.etp * layout.pp)
    states = 2 if optimizer == "adamw" else 1  # Muon: one momentum buffer (AdamW on the rest)
    # The ranks one parameter's FSDP2 / ZeRO-1 shards spread over, within one HSDP replica.
    dense_shards = layout.dp_shard * layout.cp
    expert_shards = layout.edp // layout.dp_replicate
    # FSDP2 gathers whole rows of dim 0, padded to a multiple of the shards: a rank's experts
    # (E / ep of them) gather as ceil(E / ep / shards) * shards.
    experts = cfg.moe.num_experts // layout.ep
    padded = (-(-experts // expert_shards) * expert_shards / experts
              if layout.data_shard == "full" else 1)
    # Sharded within a replica: HSDP's replicas each hold the whole state. FSDP2 keeps the
    # fp32 parameters' shards besides (the master weights); otherwise the parameters are them.
    master = 4 if layout.data_shard == "full" else 0
    sharded = (dense_local + expert_local if layout.data_shard == "none"
               else dense_local / dense_shards + expert_local / expert_shards)
    master_and_states = (master + 4 * states) * sharded
    if layout.data_shard == "full" and layout.pp == 1:
        # FSDP2 alone gathers one decoder layer and prefetches the next, and reduce-scatters
        # each layer's gradients as its backward ends; the root (embedding, head, vision
        # tower) stays gathered, in fp32, and its gradients unsharded until the last one.
        root = 2 * cfg.vocab_size * cfg.hidden_size / layout.tp + counts.vision
        moe_layers = max(cfg.num_layers - cfg.num_dense_layers, 1)
        layer = (dense_local - root) / cfg.num_layers + expert_local * padded / moe_layers
        weights = 4 * root + 2 * weight_bytes * layer
        grads = 4 * (root + layer + sharded)
    else:
        # Under the pipeline a stage keeps its parameters gathered and its gradients unsharded
        # until the step's last micro-batch; the other modes hold them whole anyway.
        weights = weight_bytes * (dense_local + expert_local * padded)
        grads = 4 * (dense_local + expert_local)  # fp32 gradient accumulation
    acts = (activation_bytes(cfg, seq_len, micro_batch, layout, checkpointing, fitted)
            + pipeline_buffer_bytes(cfg, layout, seq_len, micro_batch,
                                    micro_batches if micro_batches is not None else layout.pp)
            + moe_dispatch_bytes(cfg, layout, seq_len, micro_batch, layout.moonep_transport))
    total = weights + grads + master_and_states + acts
    return {"weights_gib": weights / GiB, "grads_gib": grads / GiB,
            "optimizer_gib": master_and_states / GiB, "activations_gib": acts / GiB,
            "total_gib": total / GiB}


LONG_CONTEXT = (8192, 65536, 262144, 1048576)  # K3's context stages
H200_BYTES = 141e9  # HBM3e of one H200 (141 GB = 131.3 GiB)
RESERVE = 0.10  # CUDA context, NCCL buffers, allocator fragmentation


def long_context_memory(cfg: K3Config, counts, layout: Topology, optimizer: str,
                        micro_batch: int, checkpointing: bool,
                        weight_bytes: int = 6) -> list[dict]:
    """Memory per GPU at each context stage with this layout (each CP rank holds seq/cp tokens
    of every sequence) and whether it fits an H200 with RESERVE kept free."""
    rows = []
    for seq in LONG_CONTEXT:
        mem = memory_per_gpu(cfg, counts, layout, optimizer, seq, micro_batch, checkpointing,
                             fitted=True, weight_bytes=weight_bytes)
        rows.append({"seq_len": seq, **mem,
                     "fits_h200": mem["total_gib"] * GiB <= (1 - RESERVE) * H200_BYTES})
    return rows


def plan(cfg, long_context: bool = False, world_size: int | None = None,
         pp_rank: int = 0) -> dict:
    """k3-plan's figures; the per-step traffic for a rank of pipeline rank `pp_rank`."""
    with torch.device("meta"):
        model = K3Model(cfg.model)
    counts = count_parameters(model)
    layout = plan_topology(cfg, world_size)
    seq = cfg.stage.seq_len
    weight_bytes = held_weight_bytes(cfg.precision.name, layout.data_shard,
                                     cfg.parallel.fsdp_param_dtype)
    gather = gathered_bytes(cfg.precision.name, layout.data_shard, cfg.parallel.fsdp_param_dtype)
    micro_batches = cfg.stage.global_batch_size // (cfg.stage.micro_batch_size * layout.dp)
    stage = stage_model(cfg, layout, pp_rank, model)  # the counts above are the whole model's
    collectives = step_collective_bytes(cfg, layout, stage, gather)
    return {
        "model": cfg.model.name,
        "parameters": counts.as_dict(),
        "flops_per_token": {"forward": forward_flops_per_token(cfg.model, seq),
                            "training": training_flops_per_token(cfg.model, seq),
                            "seq_len": seq},
        "layout": layout_dict(layout),
        "memory_per_gpu": memory_per_gpu(cfg.model, counts, layout, cfg.optim.name, seq,
                                         cfg.stage.micro_batch_size,
                                         cfg.activation_checkpointing,
                                         weight_bytes=weight_bytes,
                                         micro_batches=micro_batches),
        "expert_traffic": expert_traffic(cfg.model, layout, seq * cfg.stage.micro_batch_size),
        "data_parallel_bytes": data_parallel_bytes(
            stage[0], layout, cfg.stage.global_batch_size * seq,
            gather, micro_batches),
        "collective_bytes": collectives["total"],
        "collective_bytes_by_source": collectives["terms"],
        **({"long_context": long_context_memory(cfg.model, counts, layout, cfg.optim.name,
                                                cfg.stage.micro_batch_size,
                                                cfg.activation_checkpointing, weight_bytes)}
           if long_context else {}),
    }


def expert_traffic(cfg: K3Config, layout: Topology, tokens_per_micro_batch: int) -> dict:
    """Bytes one rank receives per MoE layer and micro-batch (bf16 activations), per dispatch
    and transport, with the formulas (parallel/moonep/traffic.py)."""
    moe = cfg.moe
    tokens = tokens_per_micro_batch // layout.cp
    out = {"tokens_per_rank": tokens, "ranks": layout.ep}
    for name, dispatch, transport in (("moonep_collective", "moonep", "collective"),
                                      ("moonep_symm_mem", "moonep", "symm_mem"),
                                      ("dynamic", "dynamic", "collective")):
        out[name] = moe_layer_traffic(tokens, moe.top_k, moe.num_experts, layout.ep,
                                      moe.latent_dim, moe.expert_intermediate, dispatch,
                                      transport=transport, expert_tensor=layout.etp)
    return out


def _human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def format_plan(p: dict) -> str:
    c, f, m, lay = p["parameters"], p["flops_per_token"], p["memory_per_gpu"], p["layout"]
    t = p["expert_traffic"]
    lines = [
        f"model {p['model']}",
        f"  parameters        {_human(c['total'])} total, {_human(c['active'])} active per token "
        f"(LM {_human(c['language_model'])}, vision {_human(c['vision'])}, "
        f"routed experts {_human(c['routed_experts'])})",
        f"  FLOPs per token   {_human(f['forward'])} forward, {_human(f['training'])} training "
        f"(seq_len {f['seq_len']})",
        "  layout            " + " ".join(f"{k}={v}" for k, v in lay.items()),
        "  memory per GPU    " + ", ".join(f"{k.removesuffix('_gib')} {v:.1f} GiB"
                                          for k, v in m.items()),
        f"  expert traffic    per MoE layer and micro-batch, received per rank "
        f"(S={t['tokens_per_rank']}, R={t['ranks']}): moonep/collective "
        f"{t['moonep_collective']['total'] / 2**20:.1f} MiB, moonep/symm_mem at most "
        f"{t['moonep_symm_mem']['total'] / 2**20:.1f} MiB, dynamic (balanced routing) "
        f"{t['dynamic']['total'] / 2**20:.1f} MiB; formulas with --json",
    ]
    dp_bytes = p["data_parallel_bytes"]
    lines.append("  data-parallel     per step and rank: " + (", ".join(
        f"{k} {v / 2**20:.1f} MiB" for k, v in dp_bytes.items()) or "none (one data rank)"))
    lines.append("  collectives       per step and rank (first pipeline stage): " + (", ".join(
        f"{k} {v / 2**30:.2f} GiB" for k, v in p["collective_bytes"].items()) or "none")
        + "; by source with --json")
    for row in p.get("long_context", []):
        lines.append(f"  at {row['seq_len']:>8} tokens  {row['total_gib']:7.1f} GiB per GPU "
                     f"(activations {row['activations_gib']:.1f}): "
                     + ("fits an H200" if row["fits_h200"] else "does not fit an H200")
                     + f" ({(1 - RESERVE) * H200_BYTES / GiB:.1f} GiB usable)")
    return "\n".join(lines)


register_configs()
_as_json = False
_long_context = False


_task_started = False  # set once Hydra has composed the config and calls the task


@hydra.main(config_path=CONFIG_DIR, config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    global _task_started
    _task_started = True
    try:
        train_cfg = to_train_config(cfg)
        train_cfg.model.validate("model")
        result = plan(train_cfg, _long_context)
    except ConfigError as e:
        print(f"k3-plan: config error: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(result, indent=2) if _as_json else format_plan(result))


def main() -> None:
    global _as_json, _long_context
    _long_context = "--long-context" in sys.argv
    if _long_context:
        sys.argv.remove("--long-context")
    _as_json = prepare_tool_argv("--json")
    hydra_exit_codes(_hydra_main, lambda: _task_started)


if __name__ == "__main__":
    main()
