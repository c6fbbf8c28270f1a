"""Quantile Balancing (the K3 report's Eq. 14): a router bias giving each expert k/n of the load.

Token i picks expert j when s_ij + b_j beats its cutoff c_i (the (k+1)-th biased score), that
is when b_j > r_ij = c_i - s_ij, the bias expert j would need to win token i. Expert j receives
exactly m k / n of m tokens when b_j sits at the k/n quantile of r_:j, i.e.

    b_j = quantile_{k/n}(c - s_:j) = -quantile_{1-k/n}(s_:j - c)

(mean-centred, since only bias differences matter). The bias is set once per optimizer step
from the whole step's tokens and is applied from the next step; it is frozen in eval mode.

Two estimators of that quantile:
- "exact": keeps every token's s - c and takes the quantile; the single-process reference.
- "histogram": per expert an integer histogram of r over [b_min - 1, b_max + 1], which contains
  every possible r (scores lie in (0, 1)). Histograms add across micro-batches and ranks, so one
  integer all-reduce per step (`reduce_fn`) makes the estimate the global batch's quantile.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import nn

from model.moe.router import Routing

Reduce = Callable[[torch.Tensor], torch.Tensor]


def no_reduce(stats: torch.Tensor) -> torch.Tensor:
    """The single-process `reduce_fn`: statistics are already global."""
    return stats


def load_statistics(tokens_per_expert: torch.Tensor) -> dict[str, torch.Tensor]:
    """Coefficient of variation (population std / mean) and max / mean of the expert load, as
    device tensors (no host sync); both 0 when there is no load."""
    load = tokens_per_expert.float()
    mean = load.mean()
    has_load = mean > 0
    safe_mean = torch.where(has_load, mean, torch.ones_like(mean))
    zero = torch.zeros_like(mean)
    return {
        "tokens_per_expert": tokens_per_expert,
        "load_cv": torch.where(has_load, load.std(correction=0) / safe_mean, zero),
        "load_max_over_mean": torch.where(has_load, load.max() / safe_mean, zero),
    }


class QuantileBalancer(nn.Module):
    """Owns one MoE layer's router bias and the statistics that set it.

    Per micro-batch the layer calls `accumulate` (training mode only); after the optimizer step
    the training loop calls `update` (or `clear` for a skipped step). A parallel plan sets
    `reduce_fn` to a sum all-reduce, over the data- and expert-parallel ranks, of the int64
    tensor `local_statistics()` (it may reduce in place; its return value is used). The exact
    estimator refuses statistics that other ranks contributed to.
    """

    def __init__(self, num_experts: int, top_k: int, estimator: str = "histogram",
                 bins: int = 1000):
        super().__init__()
        if estimator not in ("exact", "histogram"):
            raise ValueError(f"estimator={estimator!r} is invalid: must be 'exact' or 'histogram'")
        if not 0 < top_k < num_experts:
            raise ValueError(f"top_k={top_k} is invalid: must be in [1, {num_experts - 1}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.estimator = estimator
        self.bins = bins
        self.reduce_fn: Reduce = no_reduce
        # False while activation checkpointing recomputes a forward: each micro-batch counts once.
        self.accumulating = True
        self.register_buffer("bias", torch.zeros(num_experts))  # persistent: checkpointed
        self.register_buffer("last_load", torch.zeros(num_experts, dtype=torch.long),
                             persistent=False)
        self.register_buffer("_load", torch.zeros(num_experts, dtype=torch.long),
                             persistent=False)
        hist_bins = bins if estimator == "histogram" else 0
        self.register_buffer("_histogram", torch.zeros(num_experts, hist_bins, dtype=torch.long),
                             persistent=False)
        self._score_minus_cutoff: list[torch.Tensor] = []  # exact estimator, NaN = padding
        self._pending = False

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Zero bias and statistics: the state of a fresh balancer (also after `to_empty`)."""
        self.bias.zero_()
        self.last_load.zero_()
        self.clear()

    def _histogram_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Lower edge and bin width of [b_min - 1, b_max + 1] (device tensors)."""
        low = self.bias.min() - 1.0
        high = self.bias.max() + 1.0
        return low, (high - low) / self.bins

    @torch.no_grad()
    def accumulate(self, routing: Routing, token_mask: torch.Tensor | None = None) -> None:
        """Adds one micro-batch; `token_mask` [S] is non-zero for tokens that count (padding 0).
        Static shapes, no host sync: padding is weighted out, never indexed out."""
        if not self.training or not self.accumulating:
            return
        scores, cutoff = routing.scores, routing.cutoff
        num_tokens = scores.shape[0]
        if token_mask is None:
            counted = torch.ones(num_tokens, dtype=torch.long, device=scores.device)
        else:
            counted = (token_mask.reshape(num_tokens) != 0).long()
        k = routing.topk_idx.shape[1]
        self._load.index_add_(0, routing.topk_idx.reshape(-1),
                              counted[:, None].expand(num_tokens, k).reshape(-1))
        if self.estimator == "histogram":
            low, width = self._histogram_range()
            required_bias = cutoff[:, None] - scores
            bin_idx = ((required_bias - low) / width).floor().long().clamp_(0, self.bins - 1)
            expert_offset = torch.arange(self.num_experts, device=scores.device) * self.bins
            self._histogram.view(-1).index_add_(
                0, (bin_idx + expert_offset).reshape(-1),
                counted[:, None].expand(num_tokens, self.num_experts).reshape(-1))
        else:
            values = scores - cutoff[:, None]
            self._score_minus_cutoff.append(
                torch.where(counted[:, None] != 0, values, torch.full_like(values, float("nan"))))
        self._pending = True

    def local_statistics(self) -> torch.Tensor:
        """The int64 tensor `update` passes to `reduce_fn`: [E, bins + 1], each expert's
        histogram followed by its load (histogram estimator); [E, 1], the load, otherwise."""
        return torch.cat([self._histogram, self._load[:, None]], dim=1)

    def _histogram_estimate(self, histogram: torch.Tensor) -> torch.Tensor:
        """Per expert the bias at which ceil(m k / n) of the m counted tokens have a smaller
        required bias: first bin whose cumulative count reaches that, interpolated inside it."""
        counted_tokens = histogram[0].sum()  # every counted token adds one count to every row
        target = (counted_tokens * self.top_k + self.num_experts - 1) // self.num_experts
        cumulative = histogram.cumsum(dim=1)
        first = (cumulative < target).sum(dim=1, keepdim=True).clamp_(max=self.bins - 1)
        in_bin = histogram.gather(1, first)
        before = cumulative.gather(1, first) - in_bin
        low, width = self._histogram_range()
        dtype = low.dtype  # the bias's: fp32, or float64 for a float64 model
        fraction = (target - before).to(dtype) / in_bin.clamp(min=1).to(dtype)
        return (low + width * (first.to(dtype) + fraction)).squeeze(1)

    def _exact_estimate(self) -> torch.Tensor:
        values = torch.cat(self._score_minus_cutoff)
        level = 1.0 - self.top_k / self.num_experts
        return -torch.nanquantile(values, level, dim=0)

    @torch.no_grad()
    def update(self, reduced: torch.Tensor | None = None) -> None:
        """Sets the bias from this step's statistics (used from the next forward on) and clears
        them. No-op when nothing was accumulated; keeps the old bias if no token counted.
        `reduced`: the already reduced statistics (see `update_balancers`); default
        reduce_fn(local_statistics())."""
        if not self._pending:
            return
        local = self.local_statistics()
        stats = self.reduce_fn(local.clone()) if reduced is None else reduced
        histogram, load = stats[:, :-1], stats[:, -1]
        if self.estimator == "histogram":
            target = self._histogram_estimate(histogram)
        else:
            # Reference path (it syncs): other ranks' tokens would be missing from the quantile.
            if not torch.equal(stats, local):
                raise RuntimeError("the exact Quantile Balancing estimator is single-process "
                                   "only: use model.moe.qb_estimator=histogram across ranks")
            target = self._exact_estimate()
        has_tokens = load.sum() > 0
        centred = (target - target.mean()).to(self.bias.dtype)
        self.bias.copy_(torch.where(has_tokens, centred, self.bias))
        self.last_load.copy_(load)
        self.clear()

    def clear(self) -> None:
        """Drops the step's statistics without touching the bias (e.g. a skipped step)."""
        self._load.zero_()
        self._histogram.zero_()
        self._score_minus_cutoff.clear()
        self._pending = False

    def load_stats(self) -> dict[str, torch.Tensor]:
        """Tokens per expert of the last updated step, its CV and max / mean (device tensors)."""
        return load_statistics(self.last_load)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, "
                f"estimator={self.estimator}, bins={self.bins}")


@torch.no_grad()
def update_balancers(balancers: list[QuantileBalancer], reduce_fn: Reduce) -> None:
    """`update` of every layer's balancer with ONE reduction of all their statistics:
    one integer all-reduce per step across data and expert ranks, not one per layer. Layers
    with nothing accumulated take part with their (zero) statistics, so every rank reduces the
    same tensor size."""
    if not balancers:
        return
    local = [b.local_statistics() for b in balancers]
    reduced = reduce_fn(torch.cat([s.reshape(-1) for s in local]))
    offset = 0
    for balancer, stats in zip(balancers, local):
        balancer.update(reduced[offset:offset + stats.numel()].view_as(stats))
        offset += stats.numel()


@contextlib.contextmanager
def statistics_paused(balancers: Iterable[QuantileBalancer]):
    """No balancer of `balancers` accumulates statistics inside the block (a recomputed forward,
    decoding); each routes with its bias as it is."""
    balancers = list(balancers)
    before = [b.accumulating for b in balancers]
    for b in balancers:
        b.accumulating = False
    try:
        yield
    finally:
        for b, accumulating in zip(balancers, before):
            b.accumulating = accumulating
