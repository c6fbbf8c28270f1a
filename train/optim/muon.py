"""Per-Head Muon: momentum, Newton-Schulz orthogonalisation per matrix, scaled update.

One step for a parameter W with gradient G (torch.optim.Muon's conventions):

    B <- lerp(B, G, 1 - momentum)                       momentum buffer (state "momentum_buffer")
    U <- lerp(G, B, momentum) if nesterov else B
    O <- NS(U) per matrix: each head block / expert slice / whole matrix on its own
    W <- W * (1 - lr * weight_decay)                    decoupled, with the unadjusted lr
    W <- W - lr * scale(rows, cols) * O                 rows, cols of each orthogonalised matrix

Which matrices a parameter holds is set per group (see MuonParamGroup): a 2-D weight is one
matrix, or `num_heads` head blocks; a 3-D weight [E, out, in] (stacked experts) is E matrices.
With a single head this is torch.optim.Muon(adjust_lr_fn="match_rms_adamw") step for step; with
heads it is stock Muon run on each head block as a separate parameter.

Sharded layouts: Newton-Schulz needs whole matrices. The optimizer hands all of a step's
updates to a MatrixExchange (parallel.muon_exchange), which assembles blocks of whole matrices
(the whole logical update, or the whole heads a tensor-parallel rank holds), has each
orthogonalised once (by an owner rank, in a distributed exchange) and returns every rank's
part; the default is local (every parameter is whole). A parallel plan passes its own exchange
to the constructor; it lives outside the param groups so that checkpoints (which save the
groups) hold no process groups. Groups keep the logical head count (`num_heads` of the full
parameter), so they mean the same in every layout.

A step goes through the parameters in buckets of about `bucket_bytes` of (logical) parameter
bytes: each bucket's updates are made, orthogonalised and applied before the next bucket's
exist, so the step holds one bucket's updates and exchange buffers beside the parameters,
gradients and state, not the whole model's (the updates, send and receive buffers of every
matrix at once: three times a rank's share of them). A bucket holds parameters of one mesh;
the ranks of an exchange form the same buckets of it (logical sizes, parameter order), so the
exchanges pair up; each matrix still goes through Newton-Schulz whole, so the result does not
depend on the bucket size, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypedDict

import torch
from torch.distributed.tensor import DTensor

# The exchange's interface lives with the layouts that implement it (and is importable here).
from parallel.muon_exchange import (  # noqa: F401
    LocalExchange,
    MatrixExchange,
    MatrixJob,
    Orthogonalize,
)
from train.optim.newton_schulz import newton_schulz

AdjustLR = Literal["match_rms_adamw", "spectral", "none"]

# Update scale per orthogonalised matrix of shape (rows, cols).
UPDATE_SCALES: dict[str, Callable[[int, int], float]] = {
    # Moonlight: an update with the RMS of AdamW's, so AdamW's lr and weight decay carry over.
    "match_rms_adamw": lambda rows, cols: 0.2 * math.sqrt(max(rows, cols)),
    # Keller Jordan's original (torch: "original").
    "spectral": lambda rows, cols: math.sqrt(max(1.0, rows / cols)),
    "none": lambda rows, cols: 1.0,
}


class MuonParamGroup(TypedDict, total=False):
    """The keys Muon reads from a parameter group; any not given take the constructor's value.

    params: 2-D weights [rows, cols] or 3-D stacked experts [E, rows, cols].
    num_heads: head blocks per matrix (default 1: the whole matrix).
    head_axis: 0 if heads are row blocks (Q/K/V/gate: [H*hd, in] viewed as [H, hd, in]);
        1 if column blocks (output projections: [out, H*hd] viewed as [H, out, hd]).
    name: used in error messages only.
    ns_dtype: Newton-Schulz dtype; None picks bf16 on CUDA, fp32 on CPU (float64 for float64
        parameters).
    """

    params: list[torch.Tensor]
    lr: float
    momentum: float
    nesterov: bool
    weight_decay: float
    ns_steps: int
    adjust_lr: AdjustLR
    ns_dtype: torch.dtype | None
    num_heads: int
    head_axis: Literal[0, 1]
    name: str


def split_heads(x: torch.Tensor, num_heads: int, head_axis: int) -> torch.Tensor:
    """[..., R, C] -> a batch of matrices [N, R/H, C] (head_axis 0) or [N, R, C/H] (head_axis 1),
    ordered (leading index, head)."""
    rows, cols = x.shape[-2:]
    if head_axis == 0:
        return x.reshape(-1, rows // num_heads, cols)
    blocks = x.reshape(*x.shape[:-1], num_heads, cols // num_heads).transpose(-3, -2)
    return blocks.reshape(-1, rows, cols // num_heads)


def merge_heads(
    batch: torch.Tensor, shape: torch.Size, num_heads: int, head_axis: int
) -> torch.Tensor:
    """Inverse of split_heads back to `shape`."""
    if head_axis == 0:
        return batch.reshape(shape)
    rows, cols = shape[-2:]
    blocks = batch.reshape(*shape[:-2], num_heads, rows, cols // num_heads).transpose(-3, -2)
    return blocks.reshape(shape)


def orthogonalize(block: torch.Tensor, job: MatrixJob) -> torch.Tensor:
    """Newton-Schulz on every matrix of a block of whole heads (or whole matrices) of a job."""
    axis = job.head_axis - 2
    heads = job.num_heads * block.shape[axis] // job.param.shape[axis]
    matrices = split_heads(block, heads, job.head_axis)
    ortho = newton_schulz(matrices, job.ns_steps, job.ns_dtype)
    return merge_heads(ortho.to(job.param.dtype), block.shape, heads, job.head_axis)


def _check_group(group: dict[str, Any], index: int) -> None:
    where = f"Muon param group {index}" + (f" ({group['name']!r})" if "name" in group else "")
    if group["adjust_lr"] not in UPDATE_SCALES:
        raise ValueError(f"{where}: adjust_lr={group['adjust_lr']!r} is not one of "
                         f"{sorted(UPDATE_SCALES)}")
    if not group["lr"] >= 0 or not group["weight_decay"] >= 0:
        raise ValueError(f"{where}: lr={group['lr']} and weight_decay={group['weight_decay']} "
                         "must be >= 0")
    if not 0 <= group["momentum"] < 1:
        raise ValueError(f"{where}: momentum={group['momentum']} must be in [0, 1)")
    num_heads, head_axis = group["num_heads"], group["head_axis"]
    if head_axis not in (0, 1):
        raise ValueError(f"{where}: head_axis={head_axis!r} must be 0 (row blocks) or "
                         "1 (column blocks)")
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"{where}: num_heads={num_heads!r} must be an int >= 1")
    for p in group["params"]:
        shape = tuple(p.shape)
        if p.ndim not in (2, 3):
            raise ValueError(f"{where}: parameter of shape {shape} is not a matrix [rows, cols] "
                             "or a stack of experts [E, rows, cols]; give it to AdamW")
        size = shape[-2 + head_axis]
        if size % num_heads:
            axis_name = ("rows", "columns")[head_axis]
            raise ValueError(f"{where}: num_heads={num_heads} does not divide the {size} "
                             f"{axis_name} (head_axis={head_axis}) of parameter shape {shape}")


class Muon(torch.optim.Optimizer):
    """Per-Head Muon; see the module docstring for the update and MuonParamGroup for the keys."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[MuonParamGroup],
        lr: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        ns_steps: int = 5,
        adjust_lr: AdjustLR = "match_rms_adamw",
        *,
        ns_dtype: torch.dtype | None = None,
        exchange: MatrixExchange | None = None,
        bucket_bytes: int = 1 << 30,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"Muon: bucket_bytes={bucket_bytes} is invalid: must be >= 1")
        self.exchange: MatrixExchange = LocalExchange() if exchange is None else exchange
        self.bucket_bytes = bucket_bytes
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        ns_steps=ns_steps, adjust_lr=adjust_lr, ns_dtype=ns_dtype,
                        num_heads=1, head_axis=0)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        _check_group(self.param_groups[-1], len(self.param_groups) - 1)

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for bucket in self._buckets():
            self._step_bucket(bucket)
        return loss

    def _buckets(self) -> list[list[tuple[torch.Tensor, dict[str, Any]]]]:
        """(parameter, group) pairs with a gradient, by the mesh they are held on (its dimension
        names; plain tensors first), then in order, cut where a bucket's logical bytes would
        pass `bucket_bytes` (a larger parameter is a bucket of its own). The ranks of an
        exchange hold the same parameters of its mesh, but not always the same others (ZeRO-1
        owners): buckets of one mesh at a time pair their exchanges up."""
        by_mesh: dict[tuple, list[tuple[torch.Tensor, dict[str, Any]]]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    mesh = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else ()
                    by_mesh.setdefault(tuple(mesh), []).append((p, group))
        buckets: list[list[tuple[torch.Tensor, dict[str, Any]]]] = []
        for mesh in sorted(by_mesh):
            size = self.bucket_bytes  # a new bucket for each mesh
            for p, group in by_mesh[mesh]:
                nbytes = p.numel() * p.element_size()  # a DTensor's: the logical tensor's
                if size + nbytes > self.bucket_bytes:
                    buckets.append([])
                    size = 0
                buckets[-1].append((p, group))
                size += nbytes
        return buckets

    def _step_bucket(self, bucket: list[tuple[torch.Tensor, dict[str, Any]]]) -> None:
        jobs = [MatrixJob(self._momentum_update(p, group), p, group["num_heads"],
                          group["head_axis"], group["ns_steps"], group["ns_dtype"])
                for p, group in bucket]
        orthos = self.exchange.orthogonalize(jobs, orthogonalize)
        for job, (_, group), ortho in zip(jobs, bucket, orthos, strict=True):
            p, lr = job.param, group["lr"]
            rows, cols = job.param.shape[-2:]
            matrix = (rows // job.num_heads, cols) if job.head_axis == 0 else (
                rows, cols // job.num_heads)
            scale = UPDATE_SCALES[group["adjust_lr"]](*matrix)
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(ortho, alpha=-(lr * scale))

    def _momentum_update(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        grad, momentum = p.grad, group["momentum"]
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group["nesterov"] else buf

