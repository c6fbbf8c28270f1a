"""QK-Clip for gated MLA (MuonClip), applied to the weights after the optimizer step.

A head whose max pre-softmax logit m exceeds tau gets gamma = tau / m. Its logit is
q_nope . k_nope + q_rope . k_rope (times the softmax scale); scaling q_nope and k_nope by
sqrt(gamma) and q_rope by gamma scales every logit of that head by gamma, so its max becomes tau.
The shared k_rope (one for all heads) and v are left alone. Other heads are untouched bit for bit
(their factor is exactly 1).

Head-parallel shards work as they are: pass the local heads' weights, logits and count; for
weights sharded otherwise (FSDP rows), `qk_clip_factors` gives the per-row factors to apply.

In training, `QKClip` runs it as the optimizers' post-step hook, on every MLA layer.
"""

from __future__ import annotations

import weakref

import torch

from model.dtypes import upcast

from ..distributed import all_reduce_max


def _head_factors(gamma: torch.Tensor, first_dim: int, first_power: float, rest_dim: int,
                  rest_power: float) -> torch.Tensor:
    """[H, first_dim + rest_dim] row factors: gamma**first_power then gamma**rest_power."""
    first = gamma.pow(first_power)[:, None].expand(-1, first_dim)
    rest = gamma.pow(rest_power)[:, None].expand(-1, rest_dim)
    return torch.cat([first, rest], dim=1)


@torch.no_grad()
def qk_clip_(
    q_b_weight: torch.Tensor,
    kv_b_weight: torch.Tensor,
    max_logits: torch.Tensor,
    tau: float,
    num_heads: int,
    qk_nope_dim: int,
    qk_rope_dim: int,
    v_dim: int,
) -> torch.Tensor:
    """Clip in place; returns the number of clipped heads as a 0-dim tensor (no host sync).

    q_b_weight [H*(nope+rope), q_lora], rows per head [q_nope | q_rope];
    kv_b_weight [H*(nope+v), kv_lora], rows per head [k_nope | v]; max_logits [H].
    """
    expected = {
        "q_b_weight": (q_b_weight.shape[0], num_heads * (qk_nope_dim + qk_rope_dim)),
        "kv_b_weight": (kv_b_weight.shape[0], num_heads * (qk_nope_dim + v_dim)),
        "max_logits": (max_logits.numel(), num_heads),
    }
    for name, (got, want) in expected.items():
        if got != want:
            raise ValueError(f"qk_clip_: {name} has {got} rows/entries, expected {want} for "
                             f"num_heads={num_heads}, nope={qk_nope_dim}, rope={qk_rope_dim}, "
                             f"v={v_dim}")
    q_factors, kv_factors, clipped = qk_clip_factors(max_logits, tau, qk_nope_dim, qk_rope_dim,
                                                     v_dim)
    q_b_weight.mul_(q_factors[:, None].to(q_b_weight.dtype))
    kv_b_weight.mul_(kv_factors[:, None].to(kv_b_weight.dtype))
    return clipped


def qk_clip_factors(max_logits: torch.Tensor, tau: float, qk_nope_dim: int, qk_rope_dim: int,
                    v_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row factors of QK-Clip for the heads of `max_logits` [H]: ([H*(nope+rope)] for q_b,
    [H*(nope+v)] for kv_b, number of clipped heads), fp32 (float64 for float64 logits), no host
    sync."""
    logits = upcast(max_logits.detach())
    exceeds = logits > tau
    # Heads at or below tau get exactly 1.0, so multiplying leaves their weights bit-identical.
    gamma = torch.where(exceeds, tau / logits, torch.ones_like(logits))
    q_factors = _head_factors(gamma, qk_nope_dim, 0.5, qk_rope_dim, 1.0)
    kv_factors = _head_factors(gamma, qk_nope_dim, 0.5, v_dim, 0.0)
    return q_factors.reshape(-1), kv_factors.reshape(-1), exceeds.sum()


class QKClip:
    """QK-Clip as a post-step hook of the optimizers (`register`): once this rank's optimizers
    have stepped, every MLA layer with a recorded max logit is clipped and its record reset.
    `end_step()`, once per training step, returns the figures to log (and drops the records of a
    skipped step, which clips nothing). Recording starts when the QKClip is made.

    `parallel`: the layout's ParallelPlan, whose `qk_clip_` takes the max over dp x cp and
    scales the rows whatever the layout of q_b/kv_b; None: whole heads on every rank, max logits
    reduced over `group` (None: the world; under pipeline parallelism the ranks of one stage,
    the others hold other layers)."""

    _hooked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> QKClip

    def __init__(self, model, tau: float, parallel=None, group=None):
        self.model, self.tau, self.parallel, self.group = model, tau, parallel, group
        self._max_logits: list[torch.Tensor] = []
        self._clipped: list[torch.Tensor] = []
        for mla in model.mla_layers():
            mla.record_max_logit = True

    def register(self, optimizers: list[torch.optim.Optimizer]) -> QKClip:
        """Hooks the last of `optimizers`: a training step steps them in order, so its post-step
        hook runs once all have stepped (and a ZeRO-1 rank's list holds only its own)."""
        if not optimizers:
            raise ValueError("QK-Clip runs after this rank's optimizers step, and this rank has "
                             "none (ZeRO-1 left it no parameters): use fewer data-parallel "
                             "ranks, or optim.qk_clip_tau=0")
        optimizers[-1].register_step_post_hook(self._after_step)
        QKClip._hooked[optimizers[-1]] = self
        return self

    @classmethod
    def of(cls, optimizers: list[torch.optim.Optimizer]) -> QKClip | None:
        """The QKClip registered on these optimizers, if any."""
        return cls._hooked.get(optimizers[-1]) if optimizers else None

    def _after_step(self, optimizer, args, kwargs) -> None:
        for mla in self.model.mla_layers():
            if mla.max_logit is None:
                continue
            if self.parallel is None:
                top, count = _clip_whole_heads(mla, self.tau, self.group)
            else:
                top, count = self.parallel.qk_clip_(mla, self.tau, qk_clip_factors)
            self._max_logits.append(top)
            self._clipped.append(count)
            mla.max_logit = None

    def end_step(self) -> dict[str, torch.Tensor]:
        """The step's max logit over this rank's MLA layers and, when the optimizers stepped,
        its clipped heads, as 0-d device tensors (read when the row is logged, not every step);
        resets the step's records."""
        max_logits, clipped = self._max_logits, self._clipped
        self._max_logits, self._clipped = [], []
        for mla in self.model.mla_layers():
            if mla.max_logit is not None:  # a skipped step: recorded, not clipped
                max_logits.append(mla.max_logit.max())
                mla.max_logit = None
        if not max_logits:
            return {}
        row = {"attn/max_logit": torch.stack(max_logits).max()}
        if clipped:
            row["attn/clipped_heads"] = torch.stack(clipped).sum()
        return row


def _clip_whole_heads(mla, tau: float, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    all_reduce_max(mla.max_logit, group)  # every data-parallel replica clips the same heads
    count = qk_clip_(mla.q_b.weight, mla.kv_b.weight, mla.max_logit, tau, mla.num_heads,
                     mla.nope, mla.rope, mla.v_dim)
    return mla.max_logit.max(), count
