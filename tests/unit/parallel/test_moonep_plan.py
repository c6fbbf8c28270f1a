"""MoonEP planner and slot layout (SPEC 10) against the plain Python reference planner."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parallel.moonep.layout import entry_slots, num_slots, slot_layout
from parallel.moonep.plan import plan_moonep, plan_reference


def counts_from_routing(topk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[R, S, K] expert ids -> tokens_per_expert [R, E]."""
    num_ranks = topk.shape[0]
    counts = torch.zeros(num_ranks, num_experts, dtype=torch.long)
    flat = topk.reshape(num_ranks, -1)
    counts.scatter_add_(1, flat, torch.ones_like(flat))
    return counts


def check_invariants(plan, counts: torch.Tensor) -> None:
    num_ranks, num_experts = counts.shape
    per_rank = num_experts // num_ranks
    capacity = int(counts[0].sum())
    alloc = plan.alloc
    assert alloc.shape == (num_experts, num_ranks) and (alloc >= 0).all()
    assert torch.equal(alloc.sum(1), counts.sum(0)), "every entry placed exactly once"
    assert torch.equal(alloc.sum(0), torch.full((num_ranks,), capacity)), "S*K per rank"
    home = torch.arange(num_experts) // per_rank
    for d in range(num_ranks):
        imported = [e for e in range(num_experts) if alloc[e, d] > 0 and home[e] != d]
        assert len(imported) <= per_rank
        assert len({int(home[e]) for e in imported}) <= 1, "imports from one home rank"
        copied = plan.copied_experts[d].tolist()
        assert copied == imported + [-1] * (per_rank - len(imported))
        assert plan.source_rank[d] == (int(home[imported[0]]) if imported else -1)


def check_against_reference(counts: torch.Tensor, top_k: int) -> None:
    plan = plan_moonep(counts, top_k)
    ref = plan_reference(counts.tolist(), top_k)
    assert plan.alloc.tolist() == ref["alloc"]
    assert plan.copied_experts.tolist() == ref["copied_experts"]
    assert plan.source_rank.tolist() == ref["source_rank"]
    check_invariants(plan, counts)


@st.composite
def routings(draw, ranks):
    """(every rank's topk_idx [R, S, K], E) from random, skewed and adversarial routings."""
    per_rank = draw(st.sampled_from([1, 2, 3]))
    num_experts = ranks * per_rank
    top_k = draw(st.integers(1, min(num_experts, 4)))
    tokens = draw(st.integers(1, 12))
    kind = draw(st.sampled_from(["random", "one_expert", "one_rank", "uniform", "zipf"]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        weights = torch.rand(num_experts, generator=gen)
    elif kind == "zipf":
        weights = 1.0 / torch.arange(1, num_experts + 1).float() ** 2
        weights = weights[torch.randperm(num_experts, generator=gen)]
    elif kind == "one_expert":  # every token's first choice is one expert; the rest nearby
        weights = torch.full((num_experts,), 1e-6)
        weights[draw(st.integers(0, num_experts - 1))] = 1.0
    elif kind == "one_rank":
        weights = torch.full((num_experts,), 1e-6)
        home = draw(st.integers(0, ranks - 1))
        weights[home * per_rank:(home + 1) * per_rank] = 1.0
    else:
        weights = torch.ones(num_experts)
    # Top-k without replacement per token: noisy scores ordered by popularity.
    noise = torch.rand(ranks, tokens, num_experts, generator=gen) * 1e-3
    topk = (weights.log() + noise).topk(top_k, dim=-1).indices
    if kind == "random":
        topk = torch.multinomial(weights.expand(ranks * tokens, -1), top_k,
                                 generator=gen).view(ranks, tokens, top_k)
    return topk, num_experts


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_planner_matches_reference_and_keeps_invariants(ranks):
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(routings(ranks), st.sampled_from([1, 3]))
    def check(case, alignment):
        topk, num_experts = case
        check_against_reference(counts_from_routing(topk, num_experts), topk.shape[-1])
        check_slots(topk.reshape(ranks, -1), num_experts, topk.shape[-1], alignment)

    check()


def test_planner_64_ranks_adversarial():
    torch.manual_seed(0)
    ranks, per_rank, tokens, top_k = 64, 2, 16, 4
    num_experts = ranks * per_rank
    cases = []
    every_first = torch.zeros(ranks, tokens, top_k, dtype=torch.long)
    every_first += torch.arange(top_k)  # all tokens to experts 0..k-1 (all on rank 0)
    cases.append(every_first)
    cases.append(torch.rand(ranks, tokens, num_experts).topk(top_k, -1).indices)
    skew = torch.randn(num_experts).mul(3).exp()
    cases.append(torch.multinomial(skew.expand(ranks * tokens, -1), top_k)
                 .view(ranks, tokens, top_k))
    for topk in cases:
        check_against_reference(counts_from_routing(topk, num_experts), top_k)


def test_all_tokens_to_one_expert_with_top1_fills_every_rank_from_it():
    ranks, per_rank, tokens = 4, 2, 5
    counts = torch.zeros(ranks, ranks * per_rank, dtype=torch.long)
    counts[:, 3] = tokens  # expert 3 (rank 1) gets everything
    plan = plan_moonep(counts, top_k=1)
    assert plan.alloc[3].tolist() == [tokens] * ranks
    assert plan.copied_experts.tolist() == [[3, -1], [-1, -1], [3, -1], [3, -1]]
    assert plan.source_rank.tolist() == [1, -1, 1, 1]
    check_invariants(plan, counts)


def check_slots(topk: torch.Tensor, num_experts: int, top_k: int, alignment: int) -> None:
    """Slot layout and entry slots of topk [R, S*K]: S*K distinct rows per rank, each in its
    expert's (home or copy) group, groups padded, entries in (source rank, token, k) order."""
    ranks, entries = topk.shape
    per_rank = num_experts // ranks
    counts = counts_from_routing(topk, num_experts)
    plan = plan_moonep(counts, top_k, alignment)
    layout = slot_layout(plan, entries)
    # Each source rank places its own entries, knowing the others' counts only.
    dest, slot = map(torch.stack, zip(*(entry_slots(plan, layout, topk[r], counts, r)
                                        for r in range(ranks))))
    rows = num_slots(entries, per_rank, alignment)
    assert layout.num_slots == rows and (layout.group_ends[:, -1] == rows).all()
    starts, ends = layout.group_starts, layout.group_ends
    assert ((ends - starts) % alignment == 0)[:, :-1].all()
    for d in range(ranks):
        mine = slot[dest == d]
        assert mine.numel() == entries, "S*K entries per rank"
        assert mine.unique().numel() == mine.numel() and (mine < rows).all()
        # Each entry lands in its expert's group (home group, or the copy group holding it).
        groups = torch.searchsorted(ends[d], mine, right=True)
        copied = plan.copied_experts[d]
        group_expert = torch.cat([torch.arange(per_rank) + d * per_rank, copied])
        assert torch.equal(group_expert[groups], topk[dest == d])
        assert torch.equal(layout.group_counts[d], torch.bincount(groups, minlength=2 * per_rank))
        # Rows inside a group start at its padded start.
        for g in range(2 * per_rank):
            in_group = torch.sort(mine[groups == g]).values
            assert torch.equal(in_group, torch.arange(in_group.numel()) + starts[d, g])
    # Inside a group, entries follow (source rank, token, top-k position) order.
    for e in range(num_experts):
        key = dest[topk == e] * rows * 2 + slot[topk == e]
        assert torch.equal(torch.argsort(key, stable=True), torch.arange(key.numel()))


@pytest.mark.parametrize("alignment", [1, 4])
def test_entry_slots_fill_each_rank_exactly_in_a_fixed_order(alignment):
    torch.manual_seed(1)
    ranks, tokens, top_k = 4, 24, 2
    skew = torch.tensor([20.0, 1, 1, 1, 0.1, 0.1, 3, 0.1])
    topk = torch.multinomial(skew.expand(ranks * tokens, -1), top_k).view(ranks, -1)
    plan = plan_moonep(counts_from_routing(topk, 8), top_k, alignment)
    assert (plan.copied_experts >= 0).any(), "the case must exercise copy slots"
    check_slots(topk, 8, top_k, alignment)
