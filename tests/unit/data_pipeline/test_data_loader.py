"""The training loader on the sample's shards: determinism, exact resume (also across an epoch
boundary and with worker processes), disjoint DP ranks, the K3Batch layout, mixture weights."""

from __future__ import annotations

import copy
import json
from collections import Counter

import numpy as np
import pytest
import torch

from data_pipeline.config import StageConfig
from data_pipeline.loader import BatchSource, K3DataLoader, apportion
from data_pipeline.tokenizer import IMAGE_ID, PAD_ID
from model.batch import segment_ids
from model.config import ConfigError, k3_tiny
from model.vision.layout import vision_token_count

T, B, S = 512, 4, 64


@pytest.fixture(scope="module")
def manifest(sample_run):
    return sample_run["out"] / "manifest.json"


def assert_same_batch(a, b):
    for name in ("tokens", "labels", "cu_seqlens"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.vision is None) == (b.vision is None)
    if a.vision is not None:
        for name in ("patches", "grid_thw", "token_positions"):
            assert torch.equal(getattr(a.vision, name), getattr(b.vision, name)), name


def test_same_seed_same_batches_other_seed_other_batches(manifest):
    a, b = K3DataLoader(manifest, T, B, seed=7), K3DataLoader(manifest, T, B, seed=7)
    for _ in range(5):
        assert_same_batch(next(a), next(b))
    other = next(K3DataLoader(manifest, T, B, seed=8))
    assert not torch.equal(other.tokens, next(K3DataLoader(manifest, T, B, seed=7)).tokens)


def test_resume_continues_exactly_across_an_epoch_boundary(manifest):
    ref = K3DataLoader(manifest, T, 16, seed=3)
    assert ref.steps_per_epoch < 18  # the 20 batches below cross into the second epoch
    expected = [next(ref) for _ in range(20)]
    first = K3DataLoader(manifest, T, 16, seed=3)
    for _ in range(12):
        next(first)
    state = copy.deepcopy(first.state_dict())
    resumed = K3DataLoader(manifest, T, 16, seed=3)
    resumed.load_state_dict(state)
    for i in range(12, 20):
        assert_same_batch(next(resumed), expected[i])
    assert resumed.state_dict()["optimizer_step"] == 20


def test_resume_in_another_data_parallel_layout_gives_the_same_rows(manifest):
    """Saved by 2 ranks x 2 micro-batches after 3 steps, resumed by 1 rank x 4 and 4 ranks x 1:
    every later step covers the rows of the run that never moved (the state is global)."""
    def loaders(world, accum):
        return [K3DataLoader(manifest, T, 1, dp_rank=r, dp_world_size=world, seed=4,
                             grad_accum=accum) for r in range(world)]

    def rows(group, steps):
        """The sorted rows of each of the next `steps` optimizer steps over all ranks."""
        out = []
        for _ in range(steps):
            step = []
            for loader in group:
                for _ in range(loader.source.grad_accum):
                    step += loader.source.rows_for_step(loader.step).tolist()
                    next(loader)
            out.append(sorted(step))
        return out

    straight = loaders(2, 2)
    expected = rows(straight, 6)[3:]
    saved = loaders(2, 2)
    rows(saved, 3)
    states = [loader.state_dict() for loader in saved]
    assert states[0] == states[1]  # the same on every rank
    for world, accum in ((1, 4), (4, 1)):
        resumed = loaders(world, accum)
        for loader in resumed:
            loader.load_state_dict(states[0])
        assert rows(resumed, 3) == expected


def test_worker_processes_give_the_same_batches_and_resume(manifest):
    expected = [next(b) for b in [K3DataLoader(manifest, T, B, seed=5)] for _ in range(6)]
    workers = K3DataLoader(manifest, T, B, seed=5, num_workers=2)
    it = iter(workers)
    got = [next(it) for _ in range(3)]
    state = workers.state_dict()
    del it
    again = K3DataLoader(manifest, T, B, seed=5, num_workers=2)
    again.load_state_dict(state)
    it = iter(again)
    got += [next(it) for _ in range(3)]
    for g, e in zip(got, expected):
        assert_same_batch(g, e)


def test_dp_ranks_see_disjoint_samples(manifest):
    world = 3
    loaders = [K3DataLoader(manifest, T, B, dp_rank=r, dp_world_size=world, seed=11)
               for r in range(world)]
    steps = loaders[0].steps_per_epoch
    rows = [loaders[r].source.rows_for_step(s).tolist() for s in range(steps) for r in range(world)]
    flat = [row for rr in rows for row in rr]
    assert len(flat) == steps * world * B == len(set(flat))
    first = [next(loader).tokens for loader in loaders]  # and the batches really differ
    for i in range(world):
        for j in range(i):
            assert not any(torch.equal(x, y) for x in first[i] for y in first[j])


def test_every_rank_and_micro_batch_split_covers_the_same_rows_per_step(manifest):
    """Optimizer step s covers the same rows for 1 rank x 4 micro-batches, 2 x 2 and 4 x 1, also
    across the epoch boundary: each data-parallel layout trains on the single-process data."""
    B2 = 16

    def rows_per_step(world, accum, steps):
        sources = [K3DataLoader(manifest, T, B2, dp_rank=r, dp_world_size=world, seed=2,
                                grad_accum=accum).source for r in range(world)]
        return [sorted(row for src in sources for m in range(accum)
                       for row in src.rows_for_step(s * accum + m).tolist())
                for s in range(steps)]

    single = K3DataLoader(manifest, T, B2, seed=2, grad_accum=4)
    steps = single.steps_per_epoch // 4 + 2  # into the second epoch
    reference = rows_per_step(1, 4, steps)
    assert rows_per_step(2, 2, steps) == reference
    assert rows_per_step(4, 1, steps) == reference
    assert all(len(rows) == 4 * B2 for rows in reference)


def _check_layout(batch, seq_len: int, batch_size: int, slots: int) -> None:
    tokens, labels, cu = batch.tokens, batch.labels, batch.cu_seqlens
    assert tokens.shape == labels.shape == (batch_size, seq_len)
    assert cu.shape == (batch_size * slots + 1,) and cu[0] == 0
    assert cu[-1] == batch_size * seq_len and bool((cu[1:] >= cu[:-1]).all())
    assert set(range(0, batch_size * seq_len + 1, seq_len)) <= set(cu.tolist())
    flat_t, flat_l = tokens.reshape(-1), labels.reshape(-1)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if s == e:
            continue
        assert s // seq_len == (e - 1) // seq_len  # no segment crosses a row
        seg = flat_t[s:e]
        if bool((seg == PAD_ID).all()):
            assert bool((flat_l[s:e] == -100).all())
            continue
        want = seg[1:].clone()
        want[want == IMAGE_ID] = -100
        assert torch.equal(flat_l[s:e - 1], want) and flat_l[e - 1] == -100
    # the model's view of the documents agrees with the boundaries
    seg_ids = segment_ids(cu, batch_size * seq_len)
    assert len(torch.unique(seg_ids)) == int((cu[1:] > cu[:-1]).sum())
    v = batch.vision
    placeholders = torch.nonzero(flat_t == IMAGE_ID).squeeze(1)
    if v is None:
        assert len(placeholders) == 0
        return
    vision = k3_tiny().vision
    assert torch.equal(v.token_positions, placeholders)
    assert sum(vision_token_count(v.grid_thw, vision)) == len(placeholders)
    assert v.patches.shape == (int(v.grid_thw.prod(1).sum()), vision.patch_dim)
    assert v.patches.dtype == torch.float32 and float(v.patches.abs().max()) <= 1.0


def test_batches_follow_the_k3batch_layout(manifest):
    loader = K3DataLoader(manifest, T, B, seed=1)
    seen_video = seen_image = False
    for _ in range(loader.steps_per_epoch):
        batch = next(loader)
        _check_layout(batch, T, B, S)
        if batch.vision is not None:
            seen_video |= bool((batch.vision.grid_thw[:, 0] > 1).any())
            seen_image |= bool((batch.vision.grid_thw[:, 0] == 1).any())
    assert seen_image and seen_video


def test_another_stage_length_is_repacked(manifest):
    stage = StageConfig(seq_len=1024, micro_batch_size=2, global_batch_size=4,
                        max_docs_per_row=16)
    loader = K3DataLoader.from_stage(manifest, stage, vision=k3_tiny().vision)
    for _ in range(4):
        _check_layout(next(loader), 1024, 2, 16)


def test_vision_settings_must_match_the_data(manifest):
    with pytest.raises(ConfigError, match="merge_size"):
        K3DataLoader(manifest, T, B, merge_size=4)


def test_state_from_another_configuration_is_rejected(manifest):
    state = K3DataLoader(manifest, T, B, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        K3DataLoader(manifest, T, B, seed=2).load_state_dict(state)


def test_apportion_is_exact_and_proportional():
    counts = apportion(np.array([0.5, 0.3, 0.2]), 101)
    assert counts.sum() == 101 and counts.tolist() == [51, 30, 20]
    assert apportion(np.array([1.0, 1.0, 1.0]), 10).tolist() == [4, 3, 3]


def test_mixture_weights_set_each_sources_share(manifest, tmp_path):
    m = json.loads(manifest.read_text())
    for source in m["sources"]:
        source["weight"] = {"web": 0.6, "shapes": 0.3}.get(source["name"], 0.1 / 5)
        for shard in source["shards"]:
            shard["prefix"] = str(manifest.parent / shard["prefix"])
    weighted = tmp_path / "manifest.json"
    weighted.write_text(json.dumps(m))
    src = BatchSource(weighted, T, B, 0, 1, 0, S, 14, 2, 4)
    total = len(src.row_shard)
    names = [s["name"] for s in m["sources"]]
    source_of = np.empty(total, dtype=np.int64)
    for i, (begin, end) in enumerate(src.source_rows):
        source_of[begin:end] = i
    rows = np.concatenate([src.epoch_rows(e) for e in range(3)])
    counts = Counter(names[i] for i in source_of[rows])
    assert abs(counts["web"] / (3 * total) - 0.6) < 0.01
    assert abs(counts["shapes"] / (3 * total) - 0.3) < 0.01
    # a source drawn more often than it has rows cycles through all of them evenly
    begin, end = src.source_rows[names.index("shapes")]
    per_row = Counter(r for r in rows.tolist() if begin <= r < end)
    assert len(per_row) == end - begin and max(per_row.values()) - min(per_row.values()) <= 1
