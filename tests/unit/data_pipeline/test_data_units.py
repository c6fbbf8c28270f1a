"""Unit tests of the data pipeline's parts: packing (against a plain best-fit reference), dedup
hashing (against set-based Jaccard), perceptual signatures, the vision conventions shared with
model/vision, the tokenizer's fixed ids, configs and their YAML mirrors, and the hooks."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from datatrove.data import Document
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageDraw

from data_pipeline.config import (
    DataConfig,
    DedupConfig,
    ExecutorConfig,
    ImageConfig,
    LongDocConfig,
    RephraseConfig,
    SourceConfig,
    StageConfig,
    from_dict,
)
from data_pipeline.dedup import (
    MODALITY_CODES,
    MinHasher,
    Signatures,
    exact_hash,
    find_duplicates,
    jaccard,
    word_shingles,
    words,
)
from data_pipeline.filters import ClassifierFilter
from data_pipeline.imaging import MediaError, decode_frames, grid_size, perceptual_signature
from data_pipeline.loader import frame_patches
from data_pipeline.packing import pack_rows
from data_pipeline.rephrase import Rephrase
from data_pipeline.tokenizer import IMAGE_ID, SPECIAL_TOKENS, train_tokenizer
from model.config import ConfigError
from model.vision.layout import vision_token_count
from tests.helpers import REPO

CONFIGS = REPO / "configs"


# ------------------------------------------------------------------ packing

def reference_pack(lengths, splittable, seq_len, slots):
    """Plain best-fit decreasing: scan every row for the fullest one the piece fits."""
    pieces = []
    for seq, (n, can_split) in enumerate(zip(lengths, splittable)):
        if n > seq_len and not can_split:
            raise ValueError("too long")
        pieces += [(seq, o, min(seq_len, n - o)) for o in range(0, n, seq_len)]
    pieces.sort(key=lambda p: (-p[2], p[0], p[1]))
    rows: list[list] = []
    for p in pieces:
        fits = [r for r, row in enumerate(rows)
                if len(row) < slots - 1 and seq_len - sum(q[2] for q in row) >= p[2]]
        if fits:
            best = min(fits, key=lambda r: (seq_len - sum(q[2] for q in rows[r]), r))
            rows[best].append(p)
        else:
            rows.append([p])
    return [[r, *p] for r, row in enumerate(rows) for p in row]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 120), st.booleans()), min_size=0, max_size=40),
       st.integers(16, 64), st.integers(2, 6))
def test_pack_rows_matches_reference_and_tiles_every_document(docs, seq_len, slots):
    lengths = np.array([n for n, _ in docs], dtype=np.int64)
    splittable = np.array([s or n > seq_len for n, s in docs], dtype=bool)  # pictures fit
    plan = pack_rows(lengths, splittable, seq_len, slots)
    assert plan.tolist() == reference_pack(lengths.tolist(), splittable.tolist(), seq_len, slots)
    for r in np.unique(plan[:, 0]):
        row = plan[plan[:, 0] == r]
        assert row[:, 3].sum() <= seq_len and len(row) <= slots - 1
    for seq, n in enumerate(lengths.tolist()):
        pieces = sorted(p[2:] for p in plan.tolist() if p[1] == seq)
        assert [o for o, _ in pieces] == list(range(0, n, seq_len))
        assert sum(length for _, length in pieces) == n
        if not splittable[seq]:
            assert len(pieces) == 1


def test_unsplittable_document_longer_than_a_row_is_an_error():
    with pytest.raises(ValueError, match="cannot be split"):
        pack_rows(np.array([10, 70]), np.array([True, False]), 64, 4)


# ------------------------------------------------------------------ dedup

def reference_jaccard(a: str, b: str, n: int) -> float:
    def grams(text):
        w = words(text)
        return {tuple(w[i:i + n]) for i in range(max(1, len(w) - n + 1))}
    ga, gb = grams(a), grams(b)
    return len(ga & gb) / len(ga | gb)


TEXT = ("The town of Velmora lies on the northern bank of the river Asher and was founded in "
        "the year 1204 by a group of weavers who came from the coast with their families")


@pytest.mark.parametrize("edit", [
    lambda t: t, lambda t: t.replace("northern", "southern"),
    lambda t: t.replace("weavers", "potters").replace("1204", "1250"),
    lambda t: t + " and they built a bridge", lambda t: "Short text only",
])
def test_hashed_shingles_give_the_exact_set_jaccard(edit):
    other = edit(TEXT)
    assert jaccard(word_shingles(TEXT, 5), word_shingles(other, 5)) == pytest.approx(
        reference_jaccard(TEXT, other, 5), abs=1e-12)


def test_minhash_estimates_jaccard_without_bias():
    """Over the hash family (a new seed per trial) the agreement rate is the Jaccard
    similarity, with the binomial spread sqrt(J(1-J)/num_perm) <= 0.046."""
    rng = np.random.default_rng(0)
    errors = []
    for trial in range(300):  # small shingle values: where a linear hash family would fail
        hasher = MinHasher(120, seed=trial)
        a = np.unique(rng.integers(0, 5000, 200)).astype(np.uint32)
        keep = int(rng.integers(100, len(a)))
        b = np.unique(np.r_[a[:keep], rng.integers(5000, 9000, len(a) - keep)]).astype(np.uint32)
        errors.append(float((hasher.signature(a) == hasher.signature(b)).mean()) - jaccard(a, b))
    assert abs(np.mean(errors)) < 0.01 and np.std(errors) < 0.05


def _text_signatures(texts: list[str], order: list[str], cfg: DedupConfig) -> Signatures:
    hasher = MinHasher(cfg.num_perm, cfg.seed)
    sh = [word_shingles(t, cfg.ngram) for t in texts]
    n = len(texts)
    return Signatures(
        ids=np.array([f"d{i}" for i in range(n)]), order=np.array(order),
        modality=np.zeros(n, np.int8), exact=np.array([exact_hash(t) for t in texts], np.uint64),
        minhash=np.stack([hasher.signature(s) for s in sh]), shingles=np.concatenate(sh),
        shingle_offsets=np.r_[0, np.cumsum([len(s) for s in sh])].astype(np.int64),
        phash=np.zeros(0, np.uint64), colors=np.zeros((0, 192), np.uint8),
        frame_offsets=np.zeros(n + 1, np.int64))


def test_find_duplicates_keeps_the_first_copy_in_order():
    near = TEXT.replace("families", "children")  # one shingle differs: Jaccard 26/28
    texts = [near, "  " + TEXT.upper() + " ", TEXT, "A completely different text about cats "
             "and dogs that share a house in the middle of a large quiet city park"]
    order = ["b", "c", "a", "d"]  # the original (index 2) comes first
    dups = {d.index: d for d in find_duplicates(_text_signatures(texts, order, DedupConfig()),
                                                DedupConfig())}
    assert set(dups) == {0, 1}
    assert dups[1].reason == "exact_duplicate" and dups[1].keeper == 2
    assert dups[0].reason == "near_duplicate" and dups[0].keeper == 2
    assert dups[0].similarity == pytest.approx(reference_jaccard(near, TEXT, 5))


def test_sharded_minhash_stages_equal_the_reference_on_chains_and_copies(tmp_path):
    """Two curate tasks through SignatureStep, datatrove's bucket stage (one task per band)
    with exact-Jaccard verification, its cluster stage and DedupStep; the decisions equal the
    in-memory reference's. The corpus has a chain (A ~ B ~ C with A !~ C at a lower
    threshold), exact copies on both tasks (one of them first in order), and distinct texts."""
    from data_pipeline.dedup import load_duplicates
    from data_pipeline.dedup_stages import (
        SignatureStep,
        buckets_pipeline,
        global_pipeline,
        load_signatures,
    )

    words = TEXT.split()
    b = " ".join(words[:20] + ["quietly"] + words[21:])
    c = " ".join(words[:20] + ["quietly"] + words[21:40] + ["again"] + words[41:])
    distinct = [" ".join(f"word{i}x{j}" for j in range(30)) for i in range(3)]
    tasks = [[TEXT, b, distinct[0], TEXT.upper()], [c, "  " + b + " ", distinct[1], distinct[2]]]
    for threshold in (0.8, 0.95):
        cfg = DedupConfig(jaccard_threshold=threshold)
        work = str(tmp_path / f"work{threshold}")
        for rank, texts in enumerate(tasks):
            order = [f"{(i * 7 + rank) % 5}|{rank}|{i}" for i in range(len(texts))]
            docs = [Document(t, f"t{rank}/{i}", metadata={"modality": "text", "order": o})
                    for i, (t, o) in enumerate(zip(texts, order))]
            assert len(list(SignatureStep(cfg, work).run(iter(docs), rank, 2))) == len(texts)
        for band in range(cfg.bands):
            pipeline = buckets_pipeline(cfg, work)
            pipeline[0].run(None, band, cfg.bands)
            list(pipeline[1].run(None, band, cfg.bands))
        cluster, dedup = global_pipeline(cfg, work)
        cluster.run(None, 0, 1)
        list(dedup.run(None, 0, 1))
        sig = load_signatures(work, cfg)
        reference = {str(sig.ids[d.index]): (d.reason, str(sig.ids[d.keeper]),
                                             round(d.similarity, 4))
                     for d in find_duplicates(sig, cfg)}
        sharded = {k: (r["reason"], r["of"], r["similarity"])
                   for k, r in load_duplicates(work).items()}
        assert sharded == reference
        reasons = sorted(r for r, _, _ in sharded.values())
        assert reasons.count("exact_duplicate") == 2 and "near_duplicate" in reasons
        assert not any(k.endswith("/2") or k == "t1/3" for k in sharded)  # distinct kept


# ------------------------------------------------------------------ pictures

def _scene(color, shift=0) -> Image.Image:
    img = Image.new("RGB", (112, 112), (255, 255, 255))
    ImageDraw.Draw(img).ellipse((20 + shift, 30, 60 + shift, 70), fill=color)
    ImageDraw.Draw(img).rectangle((70, 60, 100, 90), fill=(40, 80, 220))
    return img


def _same(a, b):
    cfg = DedupConfig()
    (pa, ca), (pb, cb) = perceptual_signature(a), perceptual_signature(b)
    return (pa ^ pb).bit_count() <= cfg.phash_max_distance and \
        int(np.abs(ca.astype(int) - cb.astype(int)).max()) <= cfg.color_max_difference


def test_perceptual_signature_matches_copies_and_separates_colours_and_layouts():
    base = _scene((220, 40, 40))
    buf = io.BytesIO()
    base.save(buf, format="JPEG", quality=85)
    assert _same(base, Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
    assert _same(base, base.point(lambda v: min(255, v + 8)))
    assert not _same(base, _scene((40, 170, 60)))  # same layout, other colour
    assert not _same(base, _scene((220, 40, 40), shift=30))  # same colours, other layout
    flat = Image.new("RGB", (64, 64), (128, 128, 128))
    assert perceptual_signature(flat)[0] == perceptual_signature(flat.copy())[0]


@pytest.mark.parametrize("size", [(112, 112), (640, 480), (30, 200), (28, 28), (1000, 250)])
def test_grid_size_is_on_the_merge_grid_within_budget(size):
    w, h = grid_size(*size, max_pixels=112 * 112, unit=28)
    assert w % 28 == 0 and h % 28 == 0 and w * h <= 112 * 112 and w >= 28 and h >= 28
    if size[0] * size[1] <= 112 * 112 and size[0] % 28 == 0 and size[1] % 28 == 0:
        assert (w, h) == size


PNG_HEADER = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("data", [b"not an image", PNG_HEADER + b"cut"])
def test_undecodable_bytes_name_the_reason_without_a_memory_address(data):
    with pytest.raises(MediaError) as error:
        decode_frames(data)
    assert error.value.reason == "undecodable_image"
    assert "0x" not in error.value.detail  # the quarantine file is the same on every run


@pytest.mark.parametrize("grid, count", [((1, 8, 8), 16), ((6, 8, 8), 32), ((4, 4, 6), 6),
                                         ((9, 2, 2), 3)])
def test_placeholder_count_follows_the_image_config(grid, count):
    image = ImageConfig(merge_size=2, frames_per_chunk=4)  # ceil(t/4) chunks of (h/2)*(w/2)
    assert vision_token_count([grid], image.vision) == [count]


def test_frame_patches_cut_pixels_into_channel_major_patches_in_minus_one_to_one():
    frames = np.random.default_rng(0).integers(0, 256, (3, 56, 84, 3), dtype=np.uint8)
    p = 14
    patches = frame_patches(frames, p)
    assert patches.dtype == torch.float32 and patches.shape == (3 * 4 * 6, 3 * p * p)
    k = 0
    for f in range(3):  # frames in order, patches row-major, each patch (c, y, x)
        for i in range(4):
            for j in range(6):
                block = frames[f, i * p:(i + 1) * p, j * p:(j + 1) * p].transpose(2, 0, 1)
                expected = block.reshape(-1).astype(np.float32) / 127.5 - 1.0
                assert np.array_equal(patches[k].numpy(), expected), (f, i, j)
                k += 1


# ------------------------------------------------------------------ tokenizer

CORPUS = [f"the {w} of the {v} and <image> tags in text number {i}" for i, (w, v) in
          enumerate(zip(["river", "town", "bridge", "market"] * 50, ["sea", "hill"] * 100))]


def test_tokenizer_special_ids_are_fixed_and_never_matched_in_text():
    tok = train_tokenizer(CORPUS, vocab_size=300)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert IMAGE_ID not in tok.encode("a literal <image> tag", add_special_tokens=False).ids
    batch = tok.encode_batch(["<image><video><eod>"], add_special_tokens=False)
    assert not set(batch[0].ids) & set(range(len(SPECIAL_TOKENS)))
    assert train_tokenizer(CORPUS, vocab_size=300).to_str() == tok.to_str()  # deterministic


def test_a_tokenizer_with_other_special_ids_is_rejected(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from data_pipeline.tokenizer import load_tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300,
                                                        special_tokens=["<image>", "<pad>"]))
    tok.save(str(tmp_path / "t.json"))
    with pytest.raises(ConfigError, match="<pad> has id"):
        load_tokenizer(tmp_path / "t.json")


# ------------------------------------------------------------------ configs

def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_yaml_mirrors_equal_the_dataclass_defaults():
    assert from_dict(DataConfig, _yaml(CONFIGS / "data" / "sample.yaml"), "data") == DataConfig()


def test_the_chat_sample_config_differs_from_the_sample_only_in_its_source():
    chat = from_dict(DataConfig, _yaml(CONFIGS / "data" / "chat_sample.yaml"), "data").validate()
    assert [(s.name, s.modality, s.format, s.path) for s in chat.sources] == [
        ("chat_sample", "chat", "jsonl", "bundled://chat")]
    assert chat.tokenizer.path == "outputs/data/sample/tokenizer.json"  # pre-training's
    assert chat.chat_template is None and chat.chat_overflow == "truncate"
    assert chat.validation_fraction == 0.1  # enough held-out rows for SFT's validation loss
    assert dataclasses.replace(
        chat, name="sample", sources=DataConfig().sources, output_dir="outputs/data/sample",
        tokenizer=dataclasses.replace(chat.tokenizer, path=None),
        validation_fraction=DataConfig().validation_fraction) == DataConfig()
    stage = _yaml(CONFIGS / "stage" / "tiny.yaml")
    stage["long_docs"] = LongDocConfig(**stage["long_docs"])
    assert StageConfig(**stage) == StageConfig()


# Post-training stages (stage=sft) set other groups too: tests/unit/train/test_configs.py
# composes them.
PRETRAINING_STAGES = [p for p in sorted((CONFIGS / "stage").glob("*.yaml"))
                      if not p.read_text().startswith("# @package _global_")]


@pytest.mark.parametrize("path", PRETRAINING_STAGES, ids=lambda p: p.stem)
def test_every_stage_config_is_valid(path):
    d = _yaml(path)
    stage = StageConfig(**{**d, "long_docs": LongDocConfig(**d["long_docs"])}).validate()
    assert stage.name == path.stem


@pytest.mark.parametrize("change, field", [
    (lambda c: c.sources[1].__setattr__("format", "jsonl") or
     c.sources[1].__setattr__("modality", "image"), "data.sources[1].format"),
    (lambda c: c.executor.__setattr__("kind", "ray"), "data.executor.kind"),
    (lambda c: c.dedup.__setattr__("jaccard_threshold", 1.5), "data.dedup.jaccard_threshold"),
    (lambda c: c.sources.append(SourceConfig()), "data.sources[6].name"),
    (lambda c: c.__setattr__("rephrase", RephraseConfig(enabled=True)), "data.rephrase.rewriter"),
    (lambda c: c.text_filters.__setattr__("classifier", "no_colon"),
     "data.text_filters.classifier"),
    (lambda c: c.image.__setattr__("max_pixels", 100), "data.image.max_pixels"),
    (lambda c: c.__setattr__("chat_overflow", "split"), "data.chat_overflow"),
    (lambda c: c.sources[0].__setattr__("modality", "chat") or
     c.sources[1].__setattr__("modality", "chat"), "data.sources[1].format"),
])
def test_bad_data_config_values_name_the_field(change, field):
    cfg = DataConfig()
    change(cfg)
    with pytest.raises(ConfigError, match=rf"^{__import__('re').escape(field)}="):
        cfg.validate()


def test_bad_stage_values_and_unknown_keys_are_config_errors():
    with pytest.raises(ConfigError, match="stage.global_batch_size"):
        StageConfig(micro_batch_size=3, global_batch_size=8).validate()
    with pytest.raises(ConfigError, match=r"data.pack.seqlen"):
        from_dict(DataConfig, {"pack": {"seqlen": 4}}, "data")


def test_k3_data_config_composes_with_a_stage():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import data_pipeline.cli  # noqa: F401  (registers the schema)

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("data_pipeline", overrides=["stage=tiny_s3", "data.executor.tasks=4"])
    app = OmegaConf.to_object(cfg)
    assert app.data.pack.seq_len == 2048 and app.data.pack.max_docs_per_row == 128
    assert app.data.long_docs == app.stage.long_docs and app.data.executor.tasks == 4
    app.data.validate()


def test_slurm_executor_is_selected_and_chains_the_stages(tmp_path):
    from datatrove.executor import SlurmPipelineExecutor

    from data_pipeline.pipeline import _slurm, stages

    cfg = DataConfig(output_dir=str(tmp_path), executor=ExecutorConfig(kind="slurm", tasks=3))
    previous = None
    for name, pipeline, tasks in stages(cfg, str(tmp_path)):
        previous = _slurm(cfg, name, pipeline, tasks, str(tmp_path), previous)
        assert isinstance(previous, SlurmPipelineExecutor)
        expected = {"curate": 3, "tokenize": 3, "buckets": cfg.dedup.bands}.get(name, 1)
        assert previous.tasks == expected
    assert previous.depends.depends.depends.depends.job_name == "k3-data-curate"


# ------------------------------------------------------------------ hooks

def rewrite_twice(text: str, doc_id: str) -> list[str]:
    return [f"In other words: {text}", f"Put simply, {text.lower()}"]


def score_by_length(text: str) -> float:
    return min(1.0, len(text) / 100)


@pytest.mark.parametrize("keep_original", [True, False])
def test_rephrase_hook_adds_derived_documents(keep_original):
    cfg = RephraseConfig(enabled=True,
                         rewriter="tests.unit.data_pipeline.test_data_units:rewrite_twice",
                         keep_original=keep_original)
    docs = [Document("Knowledge text.", "k/1", metadata={"rephrase": True, "origin": "input"}),
            Document("Web text.", "w/1", metadata={"rephrase": False, "origin": "input"})]
    out = list(Rephrase(cfg).run(iter(docs)))
    by_id = {d.id: d for d in out}
    assert by_id["w/1"].text == "Web text."
    if keep_original:
        assert [d.id for d in out] == ["k/1", "k/1#rephrase0", "k/1#rephrase1", "w/1"]
        assert by_id["k/1"].text == "Knowledge text."
    else:
        assert [d.id for d in out] == ["k/1", "k/1#rephrase0", "w/1"]
        assert by_id["k/1"].text.startswith("In other words")
    assert {d.metadata["origin"] for d in out if "#" in d.id} == {"rephrased"}
    assert by_id["k/1"].metadata["origin"] == "input"


def test_classifier_hook_filters_by_score():
    f = ClassifierFilter("tests.unit.data_pipeline.test_data_units:score_by_length", min_score=0.5)
    assert f.filter(Document("x" * 80, "a")) is True
    assert f.filter(Document("x" * 20, "b")) == (False, "classifier_score_below_min")


def test_modality_codes_cover_the_config_modalities():
    from data_pipeline.config import MODALITY_FORMATS

    assert set(MODALITY_CODES) == set(MODALITY_FORMATS)
    assert dataclasses.fields(DataConfig)  # the schema Hydra registers is a dataclass
