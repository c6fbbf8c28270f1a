"""End to end on the bundled sample: every record accounted for, planted duplicates removed,
planted bad records quarantined, packed shards equal to the kept documents' tokens.

The pipeline runs once per session (conftest's `sample_data_dir`, and `sample_run` with the
ledger and the kept documents)."""

from __future__ import annotations

import dataclasses
import json
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from data_pipeline.config import SAMPLE_DIR, DataConfig
from data_pipeline.dedup import jaccard, word_shingles
from data_pipeline.packing import row_offsets
from data_pipeline.pipeline import ensure_prepared, run_pipeline
from data_pipeline.records import read_jsonl
from data_pipeline.shards import IndexedTokens
from data_pipeline.tokenizer import EOD_ID, IMAGE_ID, VIDEO_ID, load_tokenizer
from model.config import VisionConfig
from model.vision.layout import vision_token_count
from tests.helpers import REPO

PLANTED = json.loads((SAMPLE_DIR / "planted.json").read_text())


def _count_raw_records() -> int:
    """Records in the raw sample, counted without the pipeline's readers."""
    n = 0
    for path in (SAMPLE_DIR / "text" / "web").glob("*.jsonl"):
        n += sum(1 for line in path.read_bytes().splitlines() if line.strip())
    n += sum(pq.read_metadata(p).num_rows for p in (SAMPLE_DIR / "text").rglob("*.parquet"))
    for path in (SAMPLE_DIR / "images" / "wds").glob("*.tar"):
        keys = []
        try:
            with tarfile.open(path, "r|") as tar:
                for m in tar:
                    keys.append(m.name.split(".")[0])
                    tar.extractfile(m).read()
        except tarfile.TarError:  # the sample being read and the rest of the shard: one record
            keys = [k for k in keys if k != keys[-1]] + ["rest"]
        n += len(dict.fromkeys(keys))
    n += len(list((SAMPLE_DIR / "images" / "folder").glob("*.png")))
    n += len(list((SAMPLE_DIR / "video" / "frames").glob("*/caption.txt")))
    n += len(list((SAMPLE_DIR / "video" / "gif").glob("*.gif")))
    return n


def test_every_record_ends_in_exactly_one_outcome(sample_run):
    s = sample_run["summary"]
    o = s["outcomes"]
    total = o["kept"] + sum(sum(o[k].values()) for k in ("filtered", "duplicate", "quarantined"))
    assert s["input"]["records"] == _count_raw_records()
    assert total == s["input"]["records"] == s["accounted"]
    assert s["records_with_several_outcomes"] == 0 and s["balanced"]
    kept_inputs = {k for k, (_, _, d) in sample_run["kept"].items() if d["origin"] == "input"}
    assert not kept_inputs & set(sample_run["ledger"])
    assert len(kept_inputs) == o["kept"]
    assert json.loads((sample_run["out"] / "summary.json").read_text())["balanced"]


def test_planted_exact_duplicates_all_removed(sample_run):
    ledger, kept = sample_run["ledger"], sample_run["kept"]
    assert len(PLANTED["exact_duplicates"]) == 43
    for dup in PLANTED["exact_duplicates"]:
        assert ledger[dup["id"]]["reason"] == "exact_duplicate", dup
        assert dup["of"] in kept


def test_near_duplicates_recall_and_no_false_removals(sample_run):
    ledger, kept = sample_run["ledger"], sample_run["kept"]
    ngram = sample_run["cfg"].dedup.ngram
    texts = _raw_web_texts()
    near = PLANTED["near_duplicates"]
    for dup in near:  # the planted truth itself: Jaccard >= 0.8 with its original
        j = jaccard(word_shingles(texts[dup["id"]], ngram), word_shingles(texts[dup["of"]], ngram))
        assert 0.8 <= j < 1.0 and abs(j - dup["jaccard"]) < 1e-3
    removed = sum(ledger.get(d["id"], {}).get("reason") == "near_duplicate" for d in near)
    assert removed / len(near) >= 0.95
    # no distinct document was removed, and nothing beyond the planted copies was a duplicate
    assert all(d in kept for d in PLANTED["distinct_text"])
    planted_dups = {d["id"] for k in ("exact_duplicates", "near_duplicates", "image_duplicates",
                                      "video_duplicates") for d in PLANTED[k]}
    removed_dups = {k for k, r in ledger.items() if r["outcome"] == "duplicate"}
    assert removed_dups == planted_dups


def test_sharded_minhash_stages_take_the_reference_decisions(sample_run):
    """datatrove's signature/bucket/cluster stages (with exact-Jaccard verification) against
    dedup.find_duplicates with every signature in memory, on the whole sample."""
    from data_pipeline.dedup import find_duplicates, load_duplicates
    from data_pipeline.dedup_stages import load_signatures

    work, cfg = sample_run["out"] / "work", sample_run["cfg"].dedup
    sig = load_signatures(str(work), cfg)
    reference = {str(sig.ids[d.index]): {"id": str(sig.ids[d.index]), "reason": d.reason,
                                         "of": str(sig.ids[d.keeper]),
                                         "similarity": round(d.similarity, 4)}
                 for d in find_duplicates(sig, cfg)}
    sharded = load_duplicates(str(work))
    assert sharded == reference
    reasons = Counter(d["reason"] for d in sharded.values())
    assert reasons["near_duplicate"] >= 10 and reasons["exact_duplicate"] == 43
    # the bucket stage ran one task per band and verified candidate pairs
    assert len(list((work / "minhash" / "verified").glob("*.dups"))) == cfg.bands
    assert list((work / "minhash" / "clusters").glob("*.clusters"))


def _raw_web_texts() -> dict[str, str]:
    texts = {}
    for path in sorted((SAMPLE_DIR / "text" / "web").glob("*.jsonl")):
        for i, line in enumerate(path.read_bytes().splitlines()):
            try:
                texts[f"web/{path.name}#{i}"] = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError):
                pass
    return texts


def test_planted_image_and_video_duplicates_removed(sample_run):
    ledger = sample_run["ledger"]
    for kind, reason in (("image_duplicates", "image_duplicate"),
                         ("video_duplicates", "video_duplicate")):
        for dup in PLANTED[kind]:
            assert ledger[dup["id"]]["reason"] == reason, dup
            assert dup["of"] in sample_run["kept"]


def test_planted_bad_records_quarantined_with_reason(sample_run):
    quarantine = {r["id"]: r for r in read_jsonl(sample_run["out"] / "quarantine.jsonl")}
    assert len(PLANTED["quarantine"]) == 21
    for bad in PLANTED["quarantine"]:
        assert bad["id"] in quarantine, bad
        assert quarantine[bad["id"]]["reason"] == bad["reason"], (bad, quarantine[bad["id"]])
        assert quarantine[bad["id"]]["outcome"] == "quarantined"
    assert len(quarantine) == len(PLANTED["quarantine"])


def test_junk_filtered_by_the_expected_rule(sample_run):
    ledger = sample_run["ledger"]
    for junk in PLANTED["junk"]:
        assert ledger[junk["id"]]["outcome"] == "filtered"
        assert ledger[junk["id"]]["stage"] == junk["stage"], (junk, ledger[junk["id"]])
    for image in PLANTED["filtered_images"]:
        assert ledger[image["id"]]["reason"] == image["reason"]


def _expected_tokens(tok, doc: dict, vision: VisionConfig) -> list[int]:
    """A kept document's tokens, derived independently of the pipeline's tokenize code."""
    ids = tok.encode(doc["text"], add_special_tokens=False).ids
    modality = doc["metadata"]["modality"]
    if modality == "text":
        return ids + [EOD_ID]
    (n,) = vision_token_count(doc["metadata"]["grid_thws"], vision)
    return ([VIDEO_ID] if modality == "video" else []) + [IMAGE_ID] * n + ids + [EOD_ID]


def test_packed_shards_read_back_equal_to_kept_documents(sample_run):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    out, kept, cfg = sample_run["out"], sample_run["kept"], sample_run["cfg"]
    tok = load_tokenizer(out / "tokenizer.json")
    vision = VisionConfig(patch_size=14, merge_size=2, time_table_size=4)
    dups = {r["id"] for r in read_jsonl(out / "work" / "duplicates.jsonl")}
    curated = [json.loads(line) for p in sorted((out / "work" / "curated").glob("*.jsonl"))
               for line in p.read_text().splitlines()]
    survivors = [d for d in curated if d["id"] not in dups]
    assert {d["id"] for d in survivors} == {k for k, v in kept.items() if v[2]["origin"] == "input"}
    datasets = {}
    for doc in survivors:
        prefix, seq, _ = kept[doc["id"]]
        ds = datasets.setdefault(prefix, IndexedDataset(str(prefix)))
        assert ds[seq].tolist() == _expected_tokens(tok, doc, vision), doc["id"]
    # the pack plan: each document's pieces tile it exactly, rows respect length and slots
    T, S = cfg.pack.seq_len, cfg.pack.max_docs_per_row
    for prefix, ds in datasets.items():
        plan = np.load(f"{prefix}.pack{T}x{S}.npy")
        media_seqs = set(np.load(f"{prefix}.media.npy")[:, 0].tolist())
        offsets = row_offsets(plan)
        for r in range(len(offsets) - 1):
            row = plan[offsets[r]:offsets[r + 1]]
            assert row[:, 3].sum() <= T and len(row) <= S - 1
        rebuilt: dict[int, list[int]] = {}
        for _, seq, offset, length in sorted(plan.tolist(), key=lambda p: (p[1], p[2])):
            assert offset == len(rebuilt.setdefault(seq, []))
            rebuilt[seq] += ds.get(seq, offset, length).tolist()
            if seq in media_seqs:
                assert offset == 0 and length == len(ds[seq])
        assert sorted(rebuilt) == list(range(len(ds)))
        assert all(rebuilt[s] == ds[s].tolist() for s in rebuilt)


def test_indexed_tokens_read_what_megatron_reads(sample_run):
    """The loader's reader of the .bin/.idx files against megatron-core's IndexedDataset: every
    shard of the run, every sequence, whole and in slices."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefixes = sorted({prefix for prefix, _, _ in sample_run["kept"].values()})
    prefixes += [p.with_suffix("") for p in (sample_run["out"] / "shards").rglob("*.idx")]
    assert len(prefixes) > 2
    for prefix in sorted(set(map(str, prefixes))):
        ours, theirs = IndexedTokens(prefix), IndexedDataset(prefix)
        assert len(ours) == len(theirs) and ours.sequence_lengths.tolist() == \
            theirs.sequence_lengths.tolist(), prefix
        for seq in range(len(theirs)):
            assert ours.get(seq).tolist() == theirs[seq].tolist(), (prefix, seq)
            n = int(theirs.sequence_lengths[seq])
            for offset, length in ((1, None), (n // 3, n // 2), (n - 1, 1)):
                assert ours.get(seq, offset, length).tolist() == \
                    theirs.get(seq, offset, length).tolist(), (prefix, seq, offset, length)


def test_literal_special_token_text_is_not_a_placeholder(sample_run):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    (doc_id,) = PLANTED["special_text"]
    prefix, seq, _ = sample_run["kept"][doc_id]
    dataset = IndexedDataset(str(prefix))  # keep it alive: its items view its memory map
    tokens = dataset[seq].tolist()
    assert IMAGE_ID not in tokens and VIDEO_ID not in tokens and tokens.count(EOD_ID) == 1
    tok = load_tokenizer(sample_run["out"] / "tokenizer.json")
    assert "<image>" in tok.decode(tokens)


def test_manifest_and_ensure_prepared_reuse_the_run(sample_run):
    out = sample_run["out"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["special_tokens"]["<image>"] == IMAGE_ID
    names = {s["name"] for s in manifest["sources"]}
    assert names == {s.name for s in sample_run["cfg"].sources} | {"synthetic_long"}
    for source in manifest["sources"]:
        for shard in source["shards"]:
            for ext in (".bin", ".idx", ".docs.jsonl", ".media.npy"):
                assert Path(f"{out / shard['prefix']}{ext}").exists()
    mtime = (out / "manifest.json").stat().st_mtime_ns
    assert ensure_prepared(sample_run["cfg"]) == out / "manifest.json"
    assert (out / "manifest.json").stat().st_mtime_ns == mtime  # not rerun
    counts = Counter(d["origin"] for _, _, d in sample_run["kept"].values())
    assert counts["synthetic"] == sample_run["cfg"].long_docs.num_docs


@pytest.mark.slow
def test_k3_data_command_runs_and_prints_a_balanced_summary(tmp_path):
    import subprocess
    import sys

    repo = REPO
    result = subprocess.run(
        [sys.executable, "-m", "data_pipeline.cli", f"data.output_dir={tmp_path}",
         "data.progress=false", "stage.long_docs.num_docs=2"],
        cwd=repo, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "(balanced)" in result.stdout and "quarantined: 21" in result.stdout
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["pack"]["seq_len"] == 512
    assert json.loads((tmp_path / "summary.json").read_text())["derived"] == {"synthetic": 2}


@pytest.mark.slow
def test_worker_processes_produce_the_same_bytes(sample_run, tmp_path):
    cfg = DataConfig(output_dir=str(tmp_path), progress=False,
                     executor=dataclasses.replace(sample_run["cfg"].executor, workers=2))
    assert run_pipeline(cfg)["balanced"]
    files = sorted(p.relative_to(sample_run["out"])
                   for p in (sample_run["out"] / "shards").rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(tmp_path)
                                     for p in (tmp_path / "shards").rglob("*") if p.is_file())
    for f in files:
        assert (tmp_path / f).read_bytes() == (sample_run["out"] / f).read_bytes(), f
