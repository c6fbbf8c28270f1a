"""Builds the optimizer from the model and the `optim` config.

Every parameter gets a role from its name and shape:
- "matrix": hidden 2-D weights (and stacked 3-D expert weights): Muon under optim.name=muon.
- "decay": embeddings and the LM head: AdamW with weight decay.
- "no_decay": norms, biases, 1-D parameters, A_h, b_alpha, AttnRes queries, short-conv kernels,
  vision position/time tables: AdamW without weight decay.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

_NO_DECAY_SUFFIXES = ("a_log", "decay_bias", "query", "norm_weight", "conv.weight",
                      "pos_table", "time_table")
_DECAY_PREFIXES = ("embed.", "head.output.")


def param_role(name: str, param: torch.Tensor) -> str:
    if param.ndim < 2 or name.endswith(_NO_DECAY_SUFFIXES):
        return "no_decay"
    if name.startswith(_DECAY_PREFIXES):
        return "decay"
    return "matrix"


def param_groups_by_role(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {"matrix": [], "decay": [], "no_decay": []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups[param_role(name, p)].append((name, p))
    return groups


def head_blocks(model: nn.Module) -> dict[str, int]:
    """Per-Head Muon's blocks: parameter name -> number of row-block heads.

    KDA q/k/v projections in head_dim-row blocks, MLA q_b in (q_nope + q_rope)-row blocks and kv_b
    in (k_nope + v)-row blocks; [H * rows, in] is viewed as [H, rows, in]. Counted from the
    logical (full) shapes, so a head-sharded model gives the same groups.
    """
    from model.kda import KimiDeltaAttention
    from model.mla import GatedMLA

    heads = {}
    for name, module in model.named_modules():
        if isinstance(module, KimiDeltaAttention):
            for proj in ("q_proj", "k_proj", "v_proj"):
                rows = getattr(module, proj).weight.shape[0]
                heads[f"{name}.{proj}.weight"] = rows // module.head_dim
        elif isinstance(module, GatedMLA):
            heads[f"{name}.q_b.weight"] = module.q_b.weight.shape[0] // (module.nope + module.rope)
            heads[f"{name}.kv_b.weight"] = module.kv_b.weight.shape[0] // (module.nope
                                                                          + module.v_dim)
    return heads


def _adamw_groups(roles, cfg, lr_ratio: float, include_matrices: bool) -> list[dict]:
    decay = roles["decay"] + (roles["matrix"] if include_matrices else [])
    groups = [
        {"params": [p for _, p in decay], "weight_decay": cfg.weight_decay, "role": "decay",
         "lr_ratio": lr_ratio},
        {"params": [p for _, p in roles["no_decay"]], "weight_decay": 0.0, "role": "no_decay",
         "lr_ratio": lr_ratio},
    ]
    return [g for g in groups if g["params"]]


def _muon_groups(model: nn.Module, roles, cfg) -> list[dict]:
    heads = head_blocks(model) if cfg.per_head else {}
    by_heads: dict[int, list[nn.Parameter]] = {}
    for name, p in roles["matrix"]:
        by_heads.setdefault(heads.get(name, 1), []).append(p)
    return [{"params": params, "num_heads": h, "head_axis": 0,
             "name": "whole matrices" if h == 1 else f"{h} row-block heads"}
            for h, params in sorted(by_heads.items())]


def _cpu_adamw(groups: list[dict], lr: float, betas, eps: float) -> torch.optim.Optimizer:
    """optim.offload=cpu: DeepSpeed's vectorised host AdamW (decoupled weight decay, like
    torch.optim.AdamW), its state in host memory. DeepSpeed builds its CPU op on first use
    (g++ and ninja); DS_ACCELERATOR=cpu when no GPU is in the way."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(groups, lr=lr, betas=betas, eps=eps, adamw_mode=True)


def _torch_adamw(groups: list[dict], **kwargs) -> torch.optim.AdamW:
    """torch's AdamW, fused (one kernel over all tensors, where the default on a CPU is a loop
    of about ten operators per tensor) unless a parameter is a DTensor, whose fused update
    refuses the optimizer's plain step counters."""
    sharded = any(isinstance(p, DTensor) for group in groups for p in group["params"])
    return torch.optim.AdamW(groups, fused=None if sharded else True, **kwargs)


def build_optimizer(model: nn.Module, cfg, owns=None, exchange=None
                    ) -> list[torch.optim.Optimizer]:
    """AdamW alone (optim.name=adamw), or Muon for hidden matrices plus AdamW for the rest
    (optim.name=muon). Returns a list; DCP's get_state_dict takes it as it is.

    `owns(name)`: the parameters this rank updates (ZeRO-1 shards whole tensors over the
    data-parallel ranks; default all); an optimizer left without parameters is not built.
    `exchange`: Muon's MatrixExchange for sharded parameters (default: whole on this rank)."""
    roles = param_groups_by_role(model)
    if owns is not None:
        roles = {role: [(n, p) for n, p in named if owns(n)] for role, named in roles.items()}
    adamw_kwargs = dict(betas=tuple(cfg.betas), eps=cfg.eps)
    adamw = _cpu_adamw if cfg.offload == "cpu" else _torch_adamw
    if cfg.name == "adamw":
        groups = _adamw_groups(roles, cfg, 1.0, True)
        return [adamw(groups, lr=cfg.lr, **adamw_kwargs)] if groups else []
    if cfg.name == "muon":
        from .muon import Muon

        adamw_lr = cfg.adamw_lr if cfg.adamw_lr is not None else cfg.lr
        muon_groups = _muon_groups(model, roles, cfg)
        adamw_groups = _adamw_groups(roles, cfg, adamw_lr / cfg.lr, False)
        optimizers = []
        if muon_groups:
            optimizers.append(Muon(muon_groups, lr=cfg.lr, momentum=cfg.momentum,
                                   nesterov=cfg.nesterov, weight_decay=cfg.weight_decay,
                                   ns_steps=cfg.ns_steps, exchange=exchange,
                                   bucket_bytes=cfg.muon_bucket_mb << 20))
        if adamw_groups:
            optimizers.append(adamw(adamw_groups, lr=adamw_lr, **adamw_kwargs))
        return optimizers
    raise ValueError(f"optim.name={cfg.name!r}: must be one of ['adamw', 'muon']")


def describe_groups(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> str:
    """The start-up table: optimizer, group, tensors, parameters, lr ratio, weight decay."""
    names = {id(p): n for n, p in model.named_parameters()}
    lines = [f"{'optimizer':<10} {'group':<22} {'tensors':>7} {'params':>12} {'lr x':>6} "
             f"{'wd':>5}  example"]
    for opt in optimizers:
        for g in opt.param_groups:
            label = g.get("name") or g.get("role", "")
            count = sum(p.numel() for p in g["params"])
            lines.append(f"{type(opt).__name__:<10} {label:<22} {len(g['params']):>7} "
                         f"{count:>12,} {g.get('lr_ratio', 1.0):>6.3g} {g['weight_decay']:>5.3g}"
                         f"  {names.get(id(g['params'][0]), '?')}")
    return "\n".join(lines)


def set_lr(optimizers: list[torch.optim.Optimizer], lr: float) -> None:
    """Sets the scheduled lr; groups with an `lr_ratio` (AdamW groups under Muon) follow it."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr * group.get("lr_ratio", 1.0)
