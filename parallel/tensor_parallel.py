"""Tensor and sequence parallelism for K3, applied from outside with DTensor plans.

Parameters become DTensors on the tensor-parallel mesh (so optimizers, gradient clipping and
checkpoints see logical, full-shape tensors); between blocks the activations are DTensors too:
sharded along the sequence with `sequence_parallel` (norms and AttnRes mixes then work on T/tp
tokens), replicated without it.

Per module kind:
- KDA: q/k/v, output gate, beta and decay up-projections, the short convs, A_h and b_alpha
  sharded by head; the low-rank decay down-projection and the head-wise norm replicated; the
  output projection row-parallel (its partial sums reduced, or reduce-scattered under SP).
- MLA: q_b and kv_b (and the output gate) sharded by head; the low-rank down-projections and
  their norms replicated; the output projection row-parallel.
- Dense MLP: the fused gate/up projection column-parallel with a strided shard (each rank holds
  its slice of the gate rows and of the up rows), the down projection row-parallel.
- MoE: each tensor-parallel rank routes its own 1/tp of the tokens (`SplitTokens`), and the
  experts, split over expert-parallel or expert-tensor-parallel ranks (never whole on every
  tensor-parallel rank: Topology refuses that), are reached through the MoE layer's dispatcher
  (parallel/expert_parallel.py, parallel/expert_tensor_parallel.py).
- Vision tower: replicated, its tokens merged into the gathered embedding.
- Embedding: vocab-parallel; LM head: column-parallel over the vocab with `loss_parallel`, so the
  full fp32 logits of the whole vocab never exist on one rank.

Attention (and the MLP) run on plain local per-head tensors (`LocalCompute`): torch has no
DTensor sharding rule for SDPA on CPU, and the KDA ops are ours. The model's views take the
head count from the projections' outputs, so the model itself is unchanged.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.utils.stateless import _reparametrize_module

from model.k3 import K3Model, embedded_in_compute_dtype
from model.kda import KimiDeltaAttention
from model.mla import GatedMLA
from model.mlp import SiTUGLUMLP
from model.moe import LatentMoE

from .expert_parallel import is_expert_parameter


def _distribute_parameters(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement],
                           keep_local=lambda param: False) -> list[tuple[str, nn.Parameter]]:
    """Replaces every parameter of `module` (recursively) by a DTensor parameter; placements by
    name relative to `module`, Replicate where not named; `keep_local(param)`: left as it is."""
    out = []
    for name, param in list(module.named_parameters()):
        if keep_local(param):
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        placement = placements.get(name, Replicate())
        # Every rank holds the same values (or none yet, on meta): each takes its own part,
        # no scatter from a source rank.
        dt = nn.Parameter(distribute_tensor(param.data, mesh, [placement], src_data_rank=None),
                          requires_grad=param.requires_grad)
        owner.register_parameter(leaf, dt)
        out.append((name, dt))
    return out


class _AllReduceGrad(torch.autograd.Function):
    """Identity whose backward completes a partial-sum gradient. Without sequence parallelism
    DTensor keeps the gradients of the replicated activations partial (lazily, a sum of the
    heads' contributions), which the vocab-parallel embedding's masked partial cannot absorb;
    so they are reduced once, at the embedding's output. (Under SP the reduce-scatters back to
    Shard(1) complete them.)"""

    @staticmethod
    def forward(ctx, x: DTensor) -> DTensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: DTensor) -> DTensor:
        return grad.redistribute(placements=[Replicate()])


class ActivationLayout:
    """Where the activations between blocks live: sharded along the sequence under sequence
    parallelism, else replicated; replicated while decoding either way, whose calls take a
    token or a few per row, a sequence the tensor-parallel ranks cannot split."""

    def __init__(self, sequence_parallel: bool):
        self.sequence_parallel = sequence_parallel
        self.decoding = False

    @property
    def placement(self) -> Placement:
        return Shard(1) if self.sequence_parallel and not self.decoding else Replicate()

    def decoded(self, method, *args, **kwargs):
        """`method` (K3Model.decode or prefill) on replicated activations."""
        self.decoding = True
        try:
            return method(*args, **kwargs)
        finally:
            self.decoding = False


class LocalCompute(ParallelStyle):
    """Runs a module on plain local tensors while its parameters stay DTensors.

    The input DTensor is gathered to a full local tensor; each parameter is handed to the
    forward as its local shard. Sharded parameters (by head / by column) give exactly the local
    part of the gradient; replicated ones give a partial sum (`param_grad`) that the data-parallel
    reduction (or `reduce_partial_gradients`) completes. The local output is a partial sum
    (row-parallel projections) or a replicated value (`output`), turned back into the
    activation layout (`activation.placement`).
    """

    def __init__(self, shards: dict[str, Placement], *, param_grad: Placement,
                 input_grad: Placement, output: Placement, activation: ActivationLayout):
        super().__init__()
        self.shards = shards
        self.param_grad, self.input_grad = param_grad, input_grad
        self.output, self.activation = output, activation

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute_parameters(module, device_mesh, self.shards)
        module.forward = functools.partial(self._forward, module, module.forward, device_mesh)
        if hasattr(module, "decode"):  # attention: decoding's calls run on local heads too
            module.decode = functools.partial(self._forward, module, module.decode, device_mesh)
            module.new_cache = functools.partial(_on_local_parameters, module, module.new_cache)
        return module

    def _grad_placement(self, p: DTensor) -> Placement:
        return self.param_grad if isinstance(p.placements[0], Replicate) else p.placements[0]

    def _forward(self, module: nn.Module, forward, mesh: DeviceMesh, x, *args, **kwargs):
        local = _local_parameters(module, self._grad_placement)
        if isinstance(x, DTensor):
            x = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[self.input_grad])
        with _reparametrize_module(module, local):
            out = forward(x, *args, **kwargs)
        return DTensor.from_local(out, mesh, [self.output]).redistribute(
            mesh, [self.activation.placement])


class SplitTokens(ParallelStyle):
    """The MoE under tensor parallelism (Megatron's layouts: the expert-parallel and
    expert-tensor-parallel groups are made of tensor-, context- and data-parallel ranks, each
    with its own tokens). Each tensor-parallel rank routes and computes its contiguous 1/tp of
    the flattened [b * t] tokens (and their Quantile Balancing mask); the output is gathered
    back. The router, latent projections, latent norm and shared experts are replicated DTensors
    whose local gradients are partial sums over the tensor-parallel ranks; the experts keep the
    expert layout's own tensors, reduced by its own rules. Under sequence
    parallelism the flattening in the decoder layer gathers the sequence first (a [b, t/tp]
    shard is not a contiguous run of [b * t] unless b = 1)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute_parameters(module, device_mesh, {}, keep_local=is_expert_parameter)
        module.forward = functools.partial(self._forward, module, module.forward, device_mesh)
        localise_when_run(module.router, _partial_sum)
        return module

    def _forward(self, module: nn.Module, forward, mesh: DeviceMesh, x: DTensor,
                 token_mask: torch.Tensor | None = None) -> DTensor:
        tokens = x.shape[0]
        if tokens % mesh.size():  # decoding's few tokens (training's divide evenly)
            return _evenly_split(self, module, forward, mesh, x, token_mask)
        x = x.redistribute(mesh, [Shard(0)]).to_local(grad_placements=[Shard(0)])
        if token_mask is not None:  # the same rows as DTensor's Shard(0) (torch.chunk)
            token_mask = token_mask.chunk(mesh.size())[mesh.get_local_rank()]
        # The experts are not the tensor-parallel layout's: they take their own weights when
        # they run (plain home experts, or etp DTensors whose local slices the expert-tensor-
        # parallel plan hands their GEMMs), which FSDP2, where it shards them, gathers first,
        # also when activation checkpointing recomputes the layer.
        with _reparametrize_module(module, _local_parameters(module, _partial_sum,
                                                             skip=("router.", "experts."))):
            out = forward(x, token_mask)
        return DTensor.from_local(out, mesh, [Shard(0)]).redistribute(mesh, [Replicate()])


@torch.no_grad()
def _evenly_split(style: SplitTokens, module: nn.Module, forward, mesh: DeviceMesh, x: DTensor,
                  token_mask: torch.Tensor | None) -> DTensor:
    """SplitTokens on a token count the tensor-parallel ranks do not divide (a decode call's
    B * t): padded with masked tokens to a multiple, so every rank routes as many (the expert
    layouts' exchanges take equal counts), then cut back. Inference only."""
    tokens, ranks = x.shape[0], mesh.size()
    pad = -tokens % ranks
    whole = x.redistribute(mesh, [Replicate()]).to_local()
    mask = (token_mask if token_mask is not None
            else torch.ones(tokens, dtype=torch.bool, device=whole.device))
    whole = torch.cat([whole, whole.new_zeros(pad, whole.shape[1])])
    mask = torch.cat([mask, mask.new_zeros(pad)])
    padded = DTensor.from_local(whole, mesh, [Replicate()])
    return style._forward(module, forward, mesh, padded, mask)[:tokens]


def _partial_sum(p: DTensor) -> Placement:
    return Partial()


def _on_local_parameters(module: nn.Module, method, *args, **kwargs):
    """`method` of `module` on its parameters' local shards (a decode cache sized for this
    rank's heads)."""
    with _reparametrize_module(module, _local_parameters(module, _partial_sum)):
        return method(*args, **kwargs)


def _local_parameters(module: nn.Module, grad_placement: Callable[[DTensor], Placement],
                      skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The DTensor parameters of `module` (not those under `skip`) as local tensors whose
    gradients take `grad_placement(parameter)`."""
    return {name: p.to_local(grad_placements=[grad_placement(p)])
            for name, p in module.named_parameters()
            if isinstance(p, DTensor) and not name.startswith(skip)}


def localise_when_run(module: nn.Module,
                       grad_placement: Callable[[DTensor], Placement]) -> None:
    """`module` runs on its parameters' local tensors taken when it runs, not when its parent
    does: FSDP2 may gather it as a unit of its own (the router, kept fp32 under
    parallel.fsdp_param_dtype=compute), whose hook hands it the gathered weights only then."""
    forward = module.forward

    @functools.wraps(forward)
    def run(*args, **kwargs):
        with _reparametrize_module(module, _local_parameters(module, grad_placement)):
            return forward(*args, **kwargs)

    module.forward = run


class VocabParallelEmbedding(ParallelStyle):
    """The embedding table sharded by rows of the vocabulary (Megatron's VocabParallelEmbedding):
    each rank looks the tokens up in its rows (zeros for the others) and the partial sums are
    reduced into the activation layout. Ours rather than torch's RowwiseParallel: DTensor's
    rule for the embedding's backward makes the gradient of the whole table on every rank
    (fp32 [vocab, d]: 4.4 GiB at k3_full) and then keeps its rows; this makes only its rows'."""

    def __init__(self, activation: ActivationLayout):
        super().__init__()
        self.activation = activation

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute_parameters(module, device_mesh, {"weight": Shard(0)})
        module.forward = functools.partial(self._forward, module, device_mesh)
        return module

    def _forward(self, module: nn.Module, mesh: DeviceMesh, tokens: torch.Tensor) -> DTensor:
        weight = module.weight.to_local()  # gathered by FSDP2 over the data ranks by now
        rows = weight.shape[0]  # the vocabulary divides evenly (topology.check_model_fits)
        ids = tokens - mesh.get_local_rank() * rows
        mine = (ids >= 0) & (ids < rows)
        out = F.embedding(ids.where(mine, 0), weight) * mine.unsqueeze(-1).to(weight.dtype)
        return DTensor.from_local(out, mesh, [Partial()]).redistribute(
            mesh, [self.activation.placement])


class ReplicateParameters(ParallelStyle):
    """Replicated DTensor parameters for modules that run on DTensor activations (norms, AttnRes
    mixes): their ops work elementwise or along the hidden dimension, so a sequence-sharded
    input stays sharded."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute_parameters(module, device_mesh, {})
        return module


def kda_shards() -> dict[str, Placement]:
    heads = {f"{p}.weight": Shard(0) for p in ("q_proj", "k_proj", "v_proj", "gate_proj",
                                               "beta_proj", "decay_up", "q_conv", "k_conv",
                                               "v_conv")}
    return {**heads, "decay_bias": Shard(0), "a_log": Shard(0), "o_proj.weight": Shard(1)}


def mla_shards() -> dict[str, Placement]:
    return {"q_b.weight": Shard(0), "kv_b.weight": Shard(0), "gate_proj.weight": Shard(0),
            "o_proj.weight": Shard(1)}


def mlp_shards() -> dict[str, Placement]:
    # gate_up = [gate; up] stacked on rows: _StridedShard(0, 2) hands rank r the r-th slice of
    # the gate rows and of the up rows, so the local output still splits into (gate, up).
    return {"gate_up.weight": _StridedShard(0, split_factor=2), "down.weight": Shard(1)}


def _embed_tokens(model: K3Model, mesh: DeviceMesh, act: ActivationLayout,
                  tokens: torch.Tensor, vision) -> DTensor:
    """K3Model.embed_tokens with a vocab-parallel embedding: the vision tower is replicated (it
    runs the same on every tensor-parallel rank, so its gradients need no reduction) and its
    tokens are written into the gathered embedding, which then returns to the activation
    layout."""
    x = embedded_in_compute_dtype(model.embed(tokens))
    if vision is None or model.vision is None:
        return x
    whole = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Replicate()])
    b, t, d = whole.shape
    flat = whole.reshape(b * t, d).index_copy(0, vision.token_positions,
                                              model.vision_tokens(vision, whole.dtype))
    return DTensor.from_local(flat.view(b, t, d), mesh, [Replicate()]).redistribute(
        mesh, [act.placement])


def _decode_logits(mesh: DeviceMesh, decode_logits, sources, positions=None) -> torch.Tensor:
    """LMHead.decode_logits under the column-parallel head: the vocabulary shards gathered
    (every rank samples from the same whole logits)."""
    if positions is not None:
        positions = DTensor.from_local(positions, mesh, [Replicate()])
    return decode_logits(sources, positions).full_tensor()


def apply_tensor_parallel(model: K3Model, mesh: DeviceMesh,
                          sequence_parallel: bool) -> None:
    """Shards `model` in place over the 1-D tensor-parallel `mesh`, its experts already split
    over expert- or expert-tensor-parallel ranks (parallel/apply.py). A pipeline stage's model
    may lack the embedding or the LM head (parallel.pipeline.prune_to_stages)."""
    act = ActivationLayout(sequence_parallel)
    head_parallel = dict(param_grad=Partial(), input_grad=Partial(), output=Partial(),
                         activation=act)
    plan: dict[str, ParallelStyle] = {}
    if model.embed is not None:
        plan["embed"] = VocabParallelEmbedding(act)
    if model.head is not None:
        plan.update({"head.output": ColwiseParallel(input_layouts=act.placement,
                                                    output_layouts=Shard(-1),
                                                    use_local_output=False),
                     "head.norm": ReplicateParameters(), "head.out_mix": ReplicateParameters()})
    for index, layer in model.layers.items():
        prefix = f"layers.{index}"
        if isinstance(layer.attn, KimiDeltaAttention):
            plan[f"{prefix}.attn"] = LocalCompute(kda_shards(), **head_parallel)
        elif isinstance(layer.attn, GatedMLA):
            plan[f"{prefix}.attn"] = LocalCompute(mla_shards(), **head_parallel)
        if isinstance(layer.mlp, SiTUGLUMLP):
            plan[f"{prefix}.mlp"] = LocalCompute(mlp_shards(), **head_parallel)
        elif isinstance(layer.mlp, LatentMoE):
            plan[f"{prefix}.mlp"] = SplitTokens()
        for name in ("attn_norm", "mlp_norm", "attn_mix", "mlp_mix"):
            if getattr(layer, name) is not None:
                plan[f"{prefix}.{name}"] = ReplicateParameters()
    parallelize_module(model, mesh, plan)
    if model.head is not None:
        model.head.chunk_tokens = 0  # full (vocab-sharded) logits under loss_parallel
    if not sequence_parallel and model.embed is not None:
        model.embed.register_forward_hook(lambda module, args, out: _AllReduceGrad.apply(out))
    model.embed_tokens = functools.partial(_embed_tokens, model, mesh, act)
    model.decode = functools.partial(act.decoded, model.decode)
    model.prefill = functools.partial(act.decoded, model.prefill)
    if model.head is not None:
        model.head.decode_logits = functools.partial(_decode_logits, mesh,
                                                     model.head.decode_logits)
    model.register_forward_hook(_local_loss)


def _local_loss(module, args, output):
    """The vocab-parallel loss is a replicated DTensor: the loop gets a plain tensor."""
    if isinstance(output.loss_sum, DTensor):
        output.loss_sum = output.loss_sum.to_local()
    return output


def loss_context(tp: int):
    """Forward and backward of the vocab-parallel cross entropy run inside this."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()


def reduce_partial_gradients(model: nn.Module) -> None:
    """Completes gradients left as partial sums over the tensor-parallel ranks (replicated
    parameters used on local heads or local tokens). Data parallelism (replicate/FSDP2) does
    this inside its own reduction; this is for layouts without it."""
    for p in model.parameters():
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(placements=p.placements)
