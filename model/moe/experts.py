"""Routed experts as stacked weights, run as one grouped GEMM over the dispatched slots."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model.activations import situ_glu_halves
from model.init import Normal, Rule, reset_

FakeQuant = Callable[[torch.Tensor], torch.Tensor]
GroupWeights = Callable[[torch.Tensor, torch.Tensor, torch.dtype],
                        tuple[torch.Tensor, torch.Tensor]]


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether F.grouped_mm can run these operands: it exists (torch >= 2.8), every row stride
    is a multiple of 16 bytes (checked on CPU too) and the dtype is one it takes (bf16 is the
    only one documented for CUDA, and the meta kernel demands it; CPU also runs fp32, fp16)."""
    if not hasattr(F, "grouped_mm"):
        return False
    allowed = {torch.bfloat16, torch.float16, torch.float32} if x.is_cpu else {torch.bfloat16}
    if x.dtype not in allowed or any(w.dtype != x.dtype for w in weights):
        return False
    row_bytes = [x.shape[-1] * x.element_size()]
    row_bytes += [size * w.element_size() for w in weights for size in w.shape[1:]]
    return all(n % 16 == 0 for n in row_bytes)


class GroupedExperts(nn.Module):
    """E SiTU-GLU experts latent -> intermediate -> latent.

    `w1` [E, 2I, L] (gate rows then up rows) and `w2` [E, L, I] are stored [out, in], the
    reduction dimension last, as MX block quantisation needs. `weight_fake_quant` and
    `input_fake_quant` (default None) are the QAT seams: applied to w1/w2 and to the inputs of
    both GEMMs; `input_fake_quant` must act row by row (MX blocks run along the last dimension),
    so that quantising a whole buffer equals quantising each expert's rows.
    `group_weights` (default None: one GEMM group per expert) is the expert-parallel seam: it
    maps the (fake-quantised) w1, w2 this module holds and the GEMM's dtype to the weights of
    every GEMM group (MoonEP appends the copies of other ranks' experts it computes this
    micro-batch, moved in that dtype).
    backend "grouped_mm" is the static-shape hot path; "loop" is the per-expert reference (it
    reads the group offsets on the host).
    """

    def __init__(self, num_experts: int, dim: int, intermediate: int, beta_gate: float = 4.0,
                 beta_up: float = 25.0, init_std: float = 0.02, backend: str = "grouped_mm"):
        super().__init__()
        if backend not in ("grouped_mm", "loop"):
            raise ValueError(f"backend={backend!r} is invalid: must be 'grouped_mm' or 'loop'")
        self.num_experts = num_experts
        self.intermediate = intermediate
        self.beta_gate = beta_gate
        self.beta_up = beta_up
        self.backend = backend
        self.init_std = init_std
        self.weight_fake_quant: FakeQuant | None = None
        self.input_fake_quant: FakeQuant | None = None
        self.group_weights: GroupWeights | None = None
        self.w1 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, intermediate))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_(self)

    def init_rules(self) -> dict[str, Rule]:
        return {"w1": Normal(self.init_std), "w2": Normal(self.init_std)}

    def _weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        w1, w2 = self.w1, self.w2
        if self.weight_fake_quant is not None:
            w1, w2 = self.weight_fake_quant(w1), self.weight_fake_quant(w2)
        if self.group_weights is not None:
            w1, w2 = self.group_weights(w1, w2, dtype)
        return w1.to(dtype), w2.to(dtype)

    def _gemm_input(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.input_fake_quant is None else self.input_fake_quant(x)

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return situ_glu_halves(gate_up, self.beta_gate, self.beta_up)

    # Left out of torch.compile graphs (train.activation_checkpointing.compile_sublayers wraps
    # forward in torch.compiler.disable where this is set): grouped_mm's fake (tracing) kernel
    # takes bf16 only in torch 2.13, so fp32 runs could not be traced; each grouped GEMM is one
    # kernel anyway. Not a decorator here: that imports torch._dynamo (and sympy) with the model,
    # time and tens of MiB in every process that never compiles.
    compile_disabled = True

    def forward(self, buffer: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
        """buffer [N, L] grouped by expert, group_ends [G] int32 (ends at N) -> [N, L]."""
        # Autocast does not cover grouped_mm: cast to its dtype here as a Linear would be.
        device_type = buffer.device.type
        if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
            buffer = buffer.to(torch.get_autocast_dtype(device_type))
        w1, w2 = self._weights(buffer.dtype)
        if self.backend == "grouped_mm":
            if grouped_mm_supported(buffer, w1, w2):
                return self._forward_grouped(buffer, group_ends, w1, w2)
            warnings.warn("F.grouped_mm cannot run these operands (dtype, device or a row not "
                          "16-byte aligned): using the per-expert loop, which syncs with the host",
                          stacklevel=2)
        return self._forward_loop(buffer, group_ends, w1, w2)

    def _forward_grouped(self, buffer, group_ends, w1, w2) -> torch.Tensor:
        hidden = F.grouped_mm(self._gemm_input(buffer), w1.transpose(-2, -1), offs=group_ends)
        activated = self._activation(hidden)
        return F.grouped_mm(self._gemm_input(activated), w2.transpose(-2, -1), offs=group_ends)

    def _forward_loop(self, buffer, group_ends, w1, w2) -> torch.Tensor:
        quantised = self._gemm_input(buffer)
        outputs = []
        start = 0
        for expert, end in enumerate(group_ends.tolist()):
            rows = quantised[start:end]
            activated = self._activation(rows @ w1[expert].T)
            outputs.append(self._gemm_input(activated) @ w2[expert].T)
            start = end
        return torch.cat(outputs)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, dim={self.w1.shape[-1]}, "
                f"intermediate={self.intermediate}, backend={self.backend}")
