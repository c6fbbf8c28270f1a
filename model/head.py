"""The language model's output: the AttnRes output mix, the final RMSNorm, the vocabulary
projection and the token cross entropy, i.e. everything the last pipeline stage runs after its
decoder layers.

Two ways to the same loss:
- chunked (`chunk_tokens > 0`): the logits of `chunk_tokens` tokens at a time, inside one
  autograd Function that recomputes each chunk's logits in backward, so neither the fp32 logits
  of the micro-batch nor their gradient is ever held (k3_full, 8K tokens: 5.4 GB each).
- full (`chunk_tokens = 0`, or when the logits are asked for): `F.cross_entropy` on the logits of
  the whole micro-batch. It is the reference, and the vocabulary-parallel path: a plan that
  shards `output.weight` by vocabulary row (logits sharded on the last dim) sets
  `chunk_tokens = 0` and runs the loss under torch's `loss_parallel`, which takes over
  `F.cross_entropy`, so no rank holds logits over the whole vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attnres import DepthMix
from .config import K3Config
from .dtypes import autocast_dtype
from .norms import RMSNorm
from .ops import dispatch
from .ops.fast_exp import exp_

IGNORE_INDEX = -100


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or wider for a wider model (float64 reference runs keep their precision)."""
    return torch.promote_types(dtype, torch.float32)


def full_logits_loss(logits: torch.Tensor, labels: torch.Tensor,
                     weights: torch.Tensor | None = None) -> torch.Tensor:
    """Summed fp32 token cross entropy of logits [..., V] against labels [...], each token's
    weighted by weights [...] where given."""
    logits = logits.to(loss_dtype(logits.dtype)).flatten(0, -2)
    if weights is None:
        return F.cross_entropy(logits, labels.reshape(-1), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    per_token = F.cross_entropy(logits, labels.reshape(-1), ignore_index=IGNORE_INDEX,
                                reduction="none")
    return (per_token * weights.reshape(-1).to(per_token.dtype)).sum()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(F.linear(hidden_i, weight).float(), labels_i) over hidden [N, d], labels [N].

    Saves hidden, weight and each token's fp32 log-sum-exp; backward recomputes each chunk's
    logits, turns them into (softmax - one_hot) in place and feeds both matmuls from it.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens, token_weights):
        valid = labels != IGNORE_INDEX
        targets = torch.where(valid, labels, torch.zeros_like(labels))
        wide = loss_dtype(hidden.dtype)
        # Each token's weight in the sum: 1, or its loss weight; 0 where it has no label.
        scale = valid.to(wide) if token_weights is None else torch.where(
            valid, token_weights.to(wide), 0.0)
        lse = torch.empty(hidden.shape[0], dtype=wide, device=hidden.device)
        loss = torch.zeros((), dtype=wide, device=hidden.device)
        logits_buffer = _logits_buffer(hidden, weight, chunk_tokens, wide)
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logits = _chunk_logits(hidden[rows], weight, logits_buffer)
            target_logit = logits.gather(1, targets[rows, None]).squeeze(1)
            if not dispatch.call("log_sum_exp_rows", logits, lse[rows]):
                _log_sum_exp_(logits, out=lse[rows])
            loss += (scale[rows] * (lse[rows] - target_logit)).sum()
        ctx.chunk_tokens = chunk_tokens
        ctx.save_for_backward(hidden, weight, targets, scale, lse)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets, token_scale, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        wide = lse.dtype
        grad_weight = torch.zeros_like(weight, dtype=wide) if need_weight else None
        scale = token_scale * grad_loss  # [N] fp32 (or wider)
        logits_buffer = _logits_buffer(hidden, weight, ctx.chunk_tokens, wide)
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            grad_logits = _chunk_logits(hidden[rows], weight, logits_buffer)
            _softmax_grad_(grad_logits, lse[rows], targets[rows], scale[rows])
            grad_logits = grad_logits.to(hidden.dtype)
            if need_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[rows])
            if need_weight:
                grad_weight += (grad_logits.T @ hidden[rows]).to(wide)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def _logits_buffer(hidden: torch.Tensor, weight: torch.Tensor, chunk_tokens: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """One [chunk, V] buffer that every chunk's logits are written into: a fresh buffer per
    chunk is fresh memory on CPU (8 MiB for k3_tiny, page-faulted in each time), and
    logsumexp's temporaries were two more."""
    return hidden.new_empty(min(chunk_tokens, hidden.shape[0]), weight.shape[0], dtype=dtype)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor,
                  buffer: torch.Tensor) -> torch.Tensor:
    """F.linear(hidden, weight) in the buffer's (loss) dtype, written into its first rows."""
    logits = buffer[:hidden.shape[0]]
    if hidden.dtype == buffer.dtype:
        return torch.mm(hidden, weight.T, out=logits)
    return logits.copy_(F.linear(hidden, weight))  # computed in the low precision, then widened


def _softmax_grad_(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor,
                   scale: torch.Tensor) -> None:
    """logits [rows, V] <- scale (softmax - one_hot(targets)) in place: a registered kernel
    (model/ops/dispatch.py) where one takes the inputs, else torch's ops."""
    if dispatch.call("softmax_grad_rows_", logits, lse, targets, scale):
        return
    exp_(logits.sub_(lse[:, None]))  # softmax
    logits.scatter_add_(1, targets[:, None], torch.full_like(lse[:, None], -1.0))
    logits.mul_(scale[:, None])


def _log_sum_exp_(logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp(logits, -1) into `out`, overwriting logits with exp(logits - max): torch's
    ops in its order (an infinite max is taken as 0), without its two [chunk, V] temporaries,
    and with exp as exp2 (model/ops/fast_exp.py)."""
    maxes = logits.amax(-1, keepdim=True)
    maxes.masked_fill_(maxes.abs() == torch.inf, 0)
    torch.sum(exp_(logits.sub_(maxes)), -1, out=out)
    return out.log_().add_(maxes.squeeze(-1))


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                                 labels: torch.Tensor, chunk_tokens: int,
                                 token_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Summed fp32 cross entropy of F.linear(hidden, weight) against labels, chunk_tokens rows
    at a time; hidden [..., d], weight [V, d], labels [...], each token's weighted by
    token_weights [...] where given. Equal to `full_logits_loss(F.linear(hidden, weight),
    labels, token_weights)`, with its gradients."""
    dtype = autocast_dtype(hidden.device.type)
    if dtype is not None:  # the dtype F.linear would compute in; backward then runs in it too
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    return _ChunkedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk_tokens,
        None if token_weights is None else token_weights.reshape(-1))


class LMHead(nn.Module):
    """sources (AttnRes blocks + the last partial) -> summed token loss (and logits)."""

    def __init__(self, cfg: K3Config):
        super().__init__()
        self.out_mix = DepthMix(cfg.hidden_size, cfg.norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.chunk_tokens = cfg.loss_chunk_tokens  # 0: full logits (vocabulary-parallel path)

    def forward(self, sources: list[torch.Tensor], labels: torch.Tensor,
                return_logits: bool = False, loss_weights: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (loss_sum fp32, fp32 logits [..., V] if return_logits else None); each
        token's loss weighted by loss_weights [...] where given."""
        if return_logits or self.chunk_tokens == 0:
            logits = self.logits(sources)
            return (full_logits_loss(logits, labels, loss_weights),
                    logits if return_logits else None)
        return chunked_linear_cross_entropy(self._hidden(sources), self.output.weight, labels,
                                            self.chunk_tokens, loss_weights), None

    def logits(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """fp32 (float64 in a float64 model) logits [..., V]."""
        logits = self.output(self._hidden(sources))
        return logits.to(loss_dtype(logits.dtype))

    def decode_logits(self, sources: list[torch.Tensor],
                      positions: torch.Tensor | None = None) -> torch.Tensor:
        """`logits` of a decode call's positions [B, t, V], or with positions [B] (one per row)
        of those only [B, 1, V]: a prefill's next-token logits without every position's."""
        hidden = self._hidden(sources)
        if positions is not None:
            hidden = hidden.gather(1, positions.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1]))
        logits = self.output(hidden)
        return logits.to(loss_dtype(logits.dtype))

    def _hidden(self, sources: list[torch.Tensor]) -> torch.Tensor:
        return self.norm(self.out_mix(sources))
