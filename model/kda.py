"""Kimi Delta Attention layer (Kimi Linear's Eq. 2, 5, 6)."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KDACache
from .config import K3Config
from .dtypes import compute_dtype, upcast
from .init import ONES, ZEROS, Mapped, Rule, reset_
from .norms import rms_norm
from .ops import dispatch
from .ops.kda import kda_chunk, kda_recurrent
from .short_conv import ShortConv

if TYPE_CHECKING:
    from .decode import DecodeStep


def kda_gate(z: torch.Tensor, a_log: torch.Tensor, kind: str, lower_bound: float) -> torch.Tensor:
    """Per-channel log decay g <= 0 from the decay logit z [..., H, K] and the per-head A_h [H].

    "lower_bound" (K3): g = lb * sigmoid(exp(A_h) z), so g >= lb and a 16-token tile decays by
    at most exp(16 lb). "kimi_linear": g = -exp(A_h) softplus(z), unbounded below.
    """
    a = upcast(a_log).exp().unsqueeze(-1)
    if kind == "lower_bound":
        return lower_bound * torch.sigmoid(a * upcast(z))
    return -a * F.softplus(upcast(z))


# F.normalize's eps for q and k.
NORMALIZE_EPS = 1e-6


def kda_inputs_reference(q: torch.Tensor, k: torch.Tensor, beta_logits: torch.Tensor,
                         z: torch.Tensor, a_log: torch.Tensor, kind: str, lower_bound: float
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recurrence's inputs from the layer's projections, in plain torch ops: q and k
    [..., H, K] L2-normalised per head, beta = sigmoid(beta_logits [..., H]) and the log decay
    g = kda_gate(z [..., H, K], a_log [H])."""
    q = F.normalize(upcast(q), dim=-1, eps=NORMALIZE_EPS)
    k = F.normalize(upcast(k), dim=-1, eps=NORMALIZE_EPS)
    return q, k, torch.sigmoid(upcast(beta_logits)), kda_gate(z, a_log, kind, lower_bound)


def kda_inputs(q: torch.Tensor, k: torch.Tensor, beta_logits: torch.Tensor, z: torch.Tensor,
               a_log: torch.Tensor, kind: str, lower_bound: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """kda_inputs_reference; for K3's bounded gate a registered kernel (model/ops/dispatch.py)
    where one takes the inputs."""
    if kind == "lower_bound":
        out = dispatch.call("kda_inputs", q, k, beta_logits, z, a_log, lower_bound, NORMALIZE_EPS)
        if out is not None:
            return out
    return kda_inputs_reference(q, k, beta_logits, z, a_log, kind, lower_bound)


def _dt_bias(u: torch.Tensor, dt_min: float = 1e-3, dt_max: float = 0.1) -> torch.Tensor:
    """The inverse softplus of dt = exp(uniform(log dt_min, log dt_max)), from a uniform u."""
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp_min(1e-4)
    return dt + torch.log(-torch.expm1(-dt))


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: K3Config):
        super().__init__()
        kc = cfg.kda
        d, h, hd = cfg.hidden_size, kc.num_heads, kc.head_dim
        self.num_heads, self.head_dim = h, hd
        self.gate_kind, self.lower_bound = kc.gate, kc.gate_lower_bound
        self.chunk_size, self.backend = kc.chunk_size, kc.backend
        self.norm_eps = cfg.norm_eps
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, h * hd, bias=False)
        self.v_proj = nn.Linear(d, h * hd, bias=False)
        self.q_conv = ShortConv(h * hd, kc.conv_kernel)
        self.k_conv = ShortConv(h * hd, kc.conv_kernel)
        self.v_conv = ShortConv(h * hd, kc.conv_kernel)
        self.beta_proj = nn.Linear(d, h, bias=False)
        self.decay_down = nn.Linear(d, kc.decay_rank, bias=False)
        self.decay_up = nn.Linear(kc.decay_rank, h * hd, bias=False)
        # Per-head tensors are head-major along dim 0 (b_alpha [h * hd], A_h [h], the convs'
        # [h * hd, K]), so sharding them along dim 0 splits them with their heads; the forward
        # takes the head count from the projections' outputs (-1), so it runs on local heads.
        self.decay_bias = nn.Parameter(torch.empty(h * hd))  # b_alpha: no weight decay
        self.a_log = nn.Parameter(torch.empty(h))  # A_h, initialised to 0: no weight decay
        self.gate_proj = nn.Linear(d, h * hd, bias=False)  # full-rank sigmoid output gate
        self.out_norm_weight = nn.Parameter(torch.ones(hd))  # head-wise RMSNorm
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        # Context-parallel seam (filled from parallel/): state_exchange(kda, q, k, v, g, beta,
        # cu_seqlens) -> o runs `kda` (kda_chunk with this layer's options) on the packed
        # fragment with the states entering it from earlier ranks.
        self.state_exchange = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_(self)

    def init_rules(self) -> dict[str, Rule]:
        """A_h = 0, head norm weight 1, and b_alpha dt-style (as fla's KimiDeltaAttention):
        softplus(b) log-uniform in [1e-3, 0.1]. The projections are plain Linears."""
        return {"a_log": ZEROS, "out_norm_weight": ONES, "decay_bias": Mapped(_dt_bias)}

    # The chunk form, replaceable from outside: compile_sublayers (train/) keeps it out of the
    # torch.compile graphs. Its torch path loops in Python over blocks and chunks, which dynamo
    # would unroll (a graph that grows with the sequence length and compiles again for each new
    # one); on CUDA it is fla's Triton kernel.
    # Its element-wise kernels compile with fused_kernels=true instead (model/ops/fused.py).
    chunk_op = staticmethod(kda_chunk)
    # The single-token form decoding uses (the recurrence's one step).
    step_op = staticmethod(kda_recurrent)
    cache_type = KDACache

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None,
                segments: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, d]; cu_seqlens over the flattened B*T tokens and segments [B, T] the document
        id of each position (both None: one document per row)."""
        q, k, v = (conv(proj(x), segments) for proj, conv in self._convolutions())
        q, k, v, g, beta = self._recurrence_inputs(x, q, k, v)
        kda = self._chunk_form()
        if cu_seqlens is not None:  # all rows as one packed sequence with document boundaries
            packed = self._packed(q, k, v, g, beta)
            if self.state_exchange is None:  # every row starts a document (K3Batch)
                o, _ = kda(*packed, cu_seqlens=cu_seqlens, rows=x.shape[0])
            else:
                o = self.state_exchange(kda, *packed, cu_seqlens)
            o = o.view(v.shape)
        else:
            o, _ = kda(q, k, v, g, beta)
        return self._output(o, x)

    def decode(self, x: torch.Tensor, cache: KDACache, step: DecodeStep) -> torch.Tensor:
        """forward for the positions of one decode call (model/decode.py), continuing each
        row's cached state and convolution inputs and leaving the new ones in `cache`."""
        convolved, tails, convolved_inputs = [], [], []
        for (proj, conv), tail in zip(self._convolutions(), cache.conv_tails):
            inputs = proj(x)
            inputs = torch.cat([tail.to(inputs.dtype), inputs], dim=1)
            convolved.append(conv.continued(inputs, step.conv_segments))
            tails.append(step.last_inputs(inputs, conv.width))
            convolved_inputs.append(inputs)
        if step.checkpoints:
            windows = [step.position_windows(inputs, conv.width) for inputs, (_, conv)
                       in zip(convolved_inputs, self._convolutions())]
        cache.conv_tails = tails
        q, k, v, g, beta = self._recurrence_inputs(x, *convolved)
        g, beta = step.without_padding(g, beta)
        if step.checkpoints:  # the state after each position: the recurrence step by step
            o, states = self._stepwise(q, k, v, g, beta, step.row_initial_states(cache.state))
            cache.record(states, windows)
            cache.state = states[:, -1]
        elif step.t == 1 or step.cu_seqlens is None:  # one document per row
            op = self.step_op if step.t == 1 else self._chunk_form()
            o, cache.state = op(q, k, v, g, beta, initial_state=step.row_initial_states(
                cache.state), output_final_state=True)
        else:
            o, states = self._chunk_form()(
                *self._packed(q, k, v, g, beta), output_final_state=True,
                initial_state=step.document_initial_states(cache.state),
                cu_seqlens=step.cu_seqlens)
            o, cache.state = o.view(v.shape), step.row_final_states(states, cache.state)
        return self._output(o, x)

    def _stepwise(self, q, k, v, g, beta, state):
        """(o [B, t, H, V], the state after each position [B, t, H, K, V]) by the recurrence's
        single step, position after position, from `state`."""
        outputs, states = [], []
        for j in range(q.shape[1]):
            o, state = self.step_op(q[:, j:j + 1], k[:, j:j + 1], v[:, j:j + 1],
                                    g[:, j:j + 1], beta[:, j:j + 1], initial_state=state,
                                    output_final_state=True)
            outputs.append(o)
            states.append(state)
        return torch.cat(outputs, dim=1), torch.stack(states, dim=1)

    def new_cache(self, batch_size: int) -> KDACache:
        """Zero state and no earlier convolution inputs for `batch_size` rows."""
        weight = self.q_proj.weight
        heads = self.a_log.shape[0]
        state = weight.new_zeros(batch_size, heads, self.head_dim, self.head_dim,
                                 dtype=compute_dtype(weight.dtype))
        tails = [weight.new_zeros(batch_size, conv.width, conv.weight.shape[0])
                 for _, conv in self._convolutions()]
        return KDACache(state, tails)

    def _convolutions(self) -> tuple[tuple[nn.Linear, ShortConv], ...]:
        return ((self.q_proj, self.q_conv), (self.k_proj, self.k_conv),
                (self.v_proj, self.v_conv))

    def _recurrence_inputs(self, x, q, k, v):
        """(q, k, v, g, beta) [B, T, H, *] of the recurrence from x and the convolutions'
        outputs [B, T, H * head_dim]."""
        heads = (*x.shape[:2], -1, self.head_dim)
        z = (self.decay_up(self.decay_down(x)) + self.decay_bias).view(heads)
        q, k, beta, g = kda_inputs(q.view(heads), k.view(heads), self.beta_proj(x), z,
                                   self.a_log, self.gate_kind, self.lower_bound)
        return q, k, v.view(heads), g, beta

    def _chunk_form(self):
        # Only the K3 gate has a bound (fla's safe-gate kernel, the torch path's dense
        # sub-tiles).
        bound = self.lower_bound if self.gate_kind == "lower_bound" else None
        return functools.partial(self.chunk_op, chunk_size=self.chunk_size,
                                 backend=self.backend, lower_bound=bound)

    def _packed(self, q, k, v, g, beta):
        """The rows as one sequence [1, B*T, ...], for document bounds over all of them."""
        flat = (1, q.shape[0] * q.shape[1], -1, self.head_dim)
        return (q.reshape(flat), k.reshape(flat), v.reshape(flat), g.reshape(flat),
                beta.reshape(flat[:3]))

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The gated, head-normalised output projection of the recurrence's o [B, T, H, V]."""
        o = rms_norm(upcast(o), self.out_norm_weight, self.norm_eps)
        o = torch.sigmoid(upcast(self.gate_proj(x))).view(o.shape) * o
        return self.o_proj(o.reshape(*x.shape[:2], -1).to(x.dtype))
