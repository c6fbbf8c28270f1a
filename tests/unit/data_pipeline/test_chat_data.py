"""Chat sources through k3-data and the loader: the bundled chat sample accounted record by record
(planted duplicates removed, broken records quarantined with their reason, no prose filter on
conversations), the loss mask beside the tokens, labels on the assistant's tokens only (checked
against encode_chat of the raw record), conversations longer than the row truncated or dropped
and counted, several pictures in one conversation, and the tokenizer an SFT run is given."""

from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from data_pipeline.chat import K3_CHAT_TEMPLATE, encode_chat
from data_pipeline.config import (
    SAMPLE_DIR,
    DataConfig,
    LongDocConfig,
    PackConfig,
    SourceConfig,
    from_dict,
)
from data_pipeline.imaging import grid_size
from data_pipeline.loader import BatchSource, K3DataLoader, frame_patches
from data_pipeline.pipeline import run_pipeline
from data_pipeline.records import read_jsonl, read_ledger
from data_pipeline.shards import IndexedTokens, ShardReader, ShardWriter
from data_pipeline.tokenizer import IMAGE_ID, SPECIAL_TOKENS, load_tokenizer
from model.config import ConfigError, VisionConfig
from model.vision.layout import vision_token_count
from tests.helpers import REPO

CHAT_YAML = REPO / "configs" / "data" / "chat_sample.yaml"
PLANTED = json.loads((SAMPLE_DIR / "planted.json").read_text())["chat"]
VISION = VisionConfig(patch_size=14, merge_size=2, time_table_size=4)
IGNORE = -100


def chat_config(out: Path, tokenizer: Path, **changes) -> DataConfig:
    d = yaml.safe_load(CHAT_YAML.read_text())
    d.update(output_dir=str(out), progress=False, **changes)
    d["tokenizer"]["path"] = str(tokenizer)
    return from_dict(DataConfig, d, "data").validate()


@pytest.fixture(scope="module")
def chat_run(sample_data_dir, tmp_path_factory):
    """configs/data/chat_sample.yaml, with the pre-training sample's tokenizer."""
    out = tmp_path_factory.mktemp("chat_data")
    tokenizer = Path(sample_data_dir) / "tokenizer.json"
    summary = run_pipeline(chat_config(out, tokenizer))
    kept = {}
    for docs in sorted([*out.glob("shards/*/*.docs.jsonl"),
                        *out.glob("validation/*/*.docs.jsonl")]):
        prefix = str(docs)[:-len(".docs.jsonl")]
        for seq, d in enumerate(read_jsonl(docs)):
            kept[d["id"]] = (prefix, seq, d)
    return {"out": out, "summary": summary, "kept": kept, "given_tokenizer": tokenizer,
            "tok": load_tokenizer(out / "tokenizer.json"),
            "ledger": {r["id"]: r for r in read_ledger(out)}}


# ------------------------------------------------------------------ independent expectations

def _pictures(record_file: Path, messages: list[dict]) -> list[Path]:
    return [record_file.parent / part["image"] for m in messages
            if isinstance(m.get("content"), list)
            for part in m["content"] if part["type"] == "image"]


def _placeholders(picture: Path) -> int:
    with Image.open(picture) as img:
        w, h = grid_size(*img.size, 112 * 112, 28)
    return vision_token_count([[1, h // 14, w // 14]], VISION)[0]


class Expected:
    """A kept conversation's tokens, mask and picture starts, from its raw JSONL line."""

    def __init__(self, tok):
        self.tok = tok
        self.cache: dict[tuple[str, int], tuple[list[int], list[bool], list[int]]] = {}

    def __call__(self, doc: dict) -> tuple[list[int], list[bool], list[int]]:
        key = (doc["file"], doc["line"])
        if key not in self.cache:
            record = json.loads(Path(doc["file"]).read_text().splitlines()[doc["line"] - 1])
            ids, mask = encode_chat(record["messages"], self.tok, K3_CHAT_TEMPLATE,
                                    record.get("tools"))
            counts = iter(map(_placeholders, _pictures(Path(doc["file"]), record["messages"])))
            out_ids, out_mask, starts = [], [], []
            for token, learned in zip(ids, mask):
                n = next(counts) if token == IMAGE_ID else 1
                if token == IMAGE_ID:
                    starts.append(len(out_ids))
                out_ids += [token] * n
                out_mask += [learned and token != IMAGE_ID] * n
            self.cache[key] = out_ids, out_mask, starts
        return self.cache[key]


def _docs(prefix: str) -> list[dict]:
    return read_jsonl(Path(f"{prefix}.docs.jsonl"))


def expected_length(ids: list[int], mask: list[bool], starts: list[int], seq_len: int,
                    overflow: str) -> int:
    """The packed length: whole, the first seq_len tokens, or 0 (dropped)."""
    if len(ids) <= seq_len:
        return len(ids)
    cuts_picture = ids[seq_len] == IMAGE_ID and seq_len not in starts
    keeps_a_target = any(mask[1:seq_len])
    return seq_len if overflow == "truncate" and keeps_a_target and not cuts_picture else 0


def check_chat_rows(source: BatchSource, step: int, expected: Expected) -> tuple[int, int, int]:
    """Every conversation piece of the step's batch against its raw record: tokens, and labels
    = the next token exactly where that token is the assistant's. Returns (pieces, targets,
    truncated pieces)."""
    batch = source[step]
    T = source.seq_len
    pieces = targets = truncated = 0
    for b, row in enumerate(source.rows_for_step(step).tolist()):
        reader = source.readers[source.row_shard[row]]
        pos = 0
        for _, seq, offset, length in source.pieces(row).tolist():
            if reader.is_chat:
                ids, mask, starts = expected(_docs(reader.prefix)[seq])
                assert offset == 0 and length == expected_length(
                    ids, mask, starts, T, reader.chat_overflow)
                assert batch.tokens[b, pos:pos + length].tolist() == ids[:length]
                want = [ids[i + 1] if mask[i + 1] else IGNORE for i in range(length - 1)]
                assert batch.labels[b, pos:pos + length].tolist() == want + [IGNORE]
                pieces += 1
                targets += sum(label != IGNORE for label in want)
                truncated += length < len(ids)
            pos += length
        assert bool((batch.labels[b, pos:] == IGNORE).all())
    return pieces, targets, truncated


# ------------------------------------------------------------------ k3-data on the chat sample

def test_every_chat_record_is_accounted_and_the_planted_ones_are_handled(chat_run):
    s, ledger, kept = chat_run["summary"], chat_run["ledger"], chat_run["kept"]
    raw = sum(1 for p in (SAMPLE_DIR / "chat").glob("*.jsonl")
              for line in p.read_bytes().splitlines() if line.strip())
    o = s["outcomes"]
    total = o["kept"] + sum(sum(o[k].values()) for k in ("filtered", "duplicate", "quarantined"))
    assert s["input"]["by_source"]["chat_sample"]["records"] == raw == total == 306
    assert s["balanced"] and s["records_with_several_outcomes"] == 0
    for bad in PLANTED["quarantine"]:
        assert ledger[bad["id"]]["outcome"] == "quarantined"
        assert ledger[bad["id"]]["reason"] == bad["reason"], (bad, ledger[bad["id"]])
        assert ledger[bad["id"]]["detail"]
    assert sum(o["quarantined"].values()) == len(PLANTED["quarantine"]) == 8
    (narrator,) = [r for r in ledger.values() if r["record_id"] == "narrator"]
    assert "messages[0].role='narrator' is invalid" in narrator["detail"]  # encode_chat's words
    (tiny,) = PLANTED["filtered"]
    assert ledger[tiny["id"]]["stage"] == "filter_image_geometry"
    assert ledger[tiny["id"]]["reason"] == tiny["reason"] == "image_too_small"
    for kind, reason in (("exact_duplicates", "exact_duplicate"),
                         ("near_duplicates", "near_duplicate")):
        for dup in PLANTED[kind]:
            assert ledger[dup["id"]]["reason"] == reason, dup
            assert dup["of"] in kept
    assert {k for k, r in ledger.items() if r["outcome"] == "duplicate"} == {
        d["id"] for k in ("exact_duplicates", "near_duplicates") for d in PLANTED[k]}
    assert len(PLANTED["same_words_other_picture"]) == 2  # both kept (below)
    # the prose rules did not run on conversations, most of which they would have dropped
    assert set(PLANTED["distinct"]) == {k for k, v in kept.items() if v[2]["origin"] == "input"}
    assert not {r["stage"] for r in ledger.values()} & {
        "filter_text_length", "filter_gopher_quality", "filter_gopher_repetition",
        "filter_caption_length"}
    curated = [json.loads(line) for p in (chat_run["out"] / "work" / "curated").glob("*.jsonl")
               for line in p.read_text().splitlines()]
    assert sum(len(d["text"]) < DataConfig().text_filters.min_chars for d in curated) > 150
    assert s["output"]["validation"]["docs"] > 0  # held-out conversations exist


def test_the_given_tokenizer_is_used_and_the_mask_sits_beside_the_tokens(chat_run):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    out = chat_run["out"]
    assert (out / "tokenizer.json").read_bytes() == chat_run["given_tokenizer"].read_bytes()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["chat_overflow"] == "truncate"
    chat = [s for s in manifest["sources"] + manifest["validation"] if s["name"] == "chat_sample"]
    prefixes = [str(out / shard["prefix"]) for s in chat for shard in s["shards"]]
    assert len(prefixes) == 4  # 2 tasks, training and held-out
    for prefix in prefixes:
        masks, tokens = IndexedTokens(f"{prefix}.mask"), IndexedTokens(prefix)
        assert masks._tokens.dtype == np.uint8
        assert masks.sequence_lengths.tolist() == tokens.sequence_lengths.tolist()
        theirs = IndexedDataset(f"{prefix}.mask")  # megatron reads the same file
        assert all(theirs[s].tolist() == masks.get(s).tolist() for s in range(len(theirs)))
        reader = ShardReader(prefix)
        assert reader.is_chat and not reader.splittable().any()
        # the stored plan is the one the loader would compute
        assert np.array_equal(reader.plan(512, 64), reader.compute_plan(512, 64))
        counts = json.loads(Path(f"{prefix}.json").read_text())
        assert counts["truncated"] == counts["dropped"] == 0  # the sample fits 512 tokens
    for other in out.glob("shards/synthetic_long/*.idx"):  # pre-training shards have no mask
        assert not Path(str(other)[:-4] + ".mask.idx").exists()


def test_labels_are_the_assistant_tokens_of_the_raw_conversations(chat_run):
    manifest = chat_run["out"] / "manifest.json"
    expected = Expected(chat_run["tok"])
    source = K3DataLoader(manifest, 512, 4, seed=3).source
    pieces = targets = 0
    for step in range(source.steps_per_epoch):
        p, t, _ = check_chat_rows(source, step, expected)
        pieces, targets = pieces + p, targets + t
    kept_train = sum(1 for prefix, _, _ in chat_run["kept"].values() if "/shards/" in prefix
                     and "chat_sample" in prefix)
    assert pieces >= kept_train * 0.9 and targets > 3000  # nearly every conversation was seen
    # the mask is not all of a conversation: the system, user and tool parts are no targets
    ids, mask, _ = expected(_docs(str(chat_run["out"] / "shards/chat_sample/00000"))[0])
    assert 0 < sum(mask) < len(mask) - 10


def test_per_conversation_weights_make_each_conversation_weigh_one(chat_run):
    """stage.loss_normalization=sequence: the loader's loss_weights give every target of a
    conversation 1 / its targets, so each conversation with a target weighs 1 in the sum; with
    token normalization there are none (every target weighs 1)."""
    manifest = chat_run["out"] / "manifest.json"
    weighted = K3DataLoader(manifest, 512, 4, seed=3, loss_normalization="sequence").source
    plain = K3DataLoader(manifest, 512, 4, seed=3).source
    assert plain[0].loss_weights is None
    for step in range(3):
        batch = weighted[step]
        assert torch.equal(batch.labels, plain[step].labels)
        bounds = batch.cu_seqlens.tolist()
        for start, stop in zip(bounds[:-1], bounds[1:]):
            if stop == start:  # the unused document slots
                continue
            row, a, b = start // 512, start % 512, start % 512 + (stop - start)
            valid = batch.labels[row, a:b] != -100
            if not valid.any():
                continue
            w = batch.loss_weights[row, a:b][valid]
            assert torch.allclose(w, torch.full_like(w, 1 / int(valid.sum())))
        conversations = sum(int((batch.labels.view(-1)[a:b] != -100).any())
                            for a, b in zip(bounds[:-1], bounds[1:]))
        assert float(batch.loss_units()) == pytest.approx(conversations, rel=1e-6)


def test_a_conversation_with_two_pictures_gives_both_in_the_batch(chat_run):
    out, expected = chat_run["out"], Expected(chat_run["tok"])
    source = K3DataLoader(out / "manifest.json", 512, 1, seed=0).source
    two = [chat_run["kept"][i] for i in PLANTED["two_pictures"] if i in chat_run["kept"]]
    prefix, seq, doc = next(k for k in two if "/shards/" in k[0])
    shard = next(i for i, r in enumerate(source.readers) if r.prefix == prefix)
    row = next(r for r in range(len(source.row_shard)) if source.row_shard[r] == shard
               and seq in source.pieces(r)[:, 1].tolist())
    step = next(s for s in range(source.steps_per_epoch)
                if source.rows_for_step(s).tolist() == [row])
    batch = source[step]
    pictures = []  # (row position of the placeholders, picture file) in the row, in order
    pos = 0
    for _, s, _, length in source.pieces(row).tolist():
        d = _docs(prefix)[s]
        record = json.loads(Path(d["file"]).read_text().splitlines()[d["line"] - 1])
        starts = expected(d)[2]
        pictures += [(pos + start, path) for start, path in
                     zip(starts, _pictures(Path(d["file"]), record["messages"]))]
        if s == seq:
            ours = [path for start, path in pictures if start >= pos]
            assert len(ours) == 2 and ours[0] != ours[1]
        pos += length
    v = batch.vision
    counts = [_placeholders(path) for _, path in pictures]
    assert v.grid_thw.tolist() == [[1, 8, 8]] * len(pictures)  # 112 x 112 scenes
    assert len(v.token_positions) == sum(counts) == int((batch.tokens == IMAGE_ID).sum())
    assert v.token_positions.tolist() == [start + i for (start, _), n in zip(pictures, counts)
                                          for i in range(n)]
    patches = [frame_patches(np.array(Image.open(path).convert("RGB"))[None], 14)
               for _, path in pictures]
    assert torch.equal(v.patches, torch.cat(patches))


# ------------------------------------------------------------------ overflow

def test_a_shorter_row_truncates_or_drops_conversations_and_the_loader_says_so(chat_run,
                                                                               caplog, tmp_path):
    manifest_path = chat_run["out"] / "manifest.json"
    expected = Expected(chat_run["tok"])
    T = 100
    with caplog.at_level(logging.WARNING, logger="data_pipeline.loader"):
        source = K3DataLoader(manifest_path, T, 4, seed=1).source
    lengths = {}  # (prefix, seq) -> packed length, from the plans
    for reader, plan in zip(source.readers, source.plans):
        for _, seq, offset, length in plan.tolist():
            assert offset == 0 or not reader.is_chat
            lengths[reader.prefix, seq] = length
    truncated = dropped = 0
    for reader in source.readers:
        if not reader.is_chat:
            continue
        for seq, doc in enumerate(_docs(reader.prefix)):
            ids, mask, starts = expected(doc)
            want = expected_length(ids, mask, starts, T, "truncate")
            assert lengths.get((reader.prefix, seq), 0) == want, doc["id"]
            truncated += 0 < want < len(ids)
            dropped += want == 0
    assert truncated > 20 and dropped > 20  # tool conversations open with their schemas
    (message,) = [r.getMessage() for r in caplog.records if "chat_sample" in r.getMessage()]
    assert message == (f"chat source chat_sample: {truncated + dropped} conversations longer "
                       f"than seq_len={T}: {truncated} truncated, {dropped} dropped "
                       "(data.chat_overflow=truncate)")
    # the truncated conversations keep their targets inside the row
    checked = np.array([check_chat_rows(source, step, expected) for step in range(8)]).sum(0)
    assert checked[0] > 30 and checked[2] > 5  # pieces, truncated pieces
    # data.chat_overflow=drop: every conversation longer than the row is left out
    m = json.loads(manifest_path.read_text())
    m["chat_overflow"] = "drop"
    for s in m["sources"]:
        for shard in s["shards"]:
            shard["prefix"] = str(chat_run["out"] / shard["prefix"])
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    drop = BatchSource(tmp_path / "manifest.json", T, 4, 0, 1, 0, 64, 14, 2, 4)
    for reader, plan in zip(drop.readers, drop.plans):
        if reader.is_chat:
            assert reader.fit(T)[1:] == (0, int((reader.sequence_lengths > T).sum()))
            assert set(plan[:, 1].tolist()) == set(
                np.flatnonzero(reader.sequence_lengths <= T).tolist())


def _write_chat_shard(prefix: Path, overflow: str) -> dict:
    """Conversations of 6 and 12 tokens for rows of 8: t is a text token, I a placeholder."""
    buf = io.BytesIO()
    Image.new("RGB", (28, 56)).save(buf, format="PNG")
    picture = [1, 4, 2], [buf.getvalue()]  # 2 x 1 merged tokens: 2 placeholders
    t, I = 20, IMAGE_ID  # noqa: E741
    writer = ShardWriter(prefix, 100, masked=True)
    conversations = [  # tokens, assistant positions, picture starts
        ([t] * 6, {3, 4}, []),  # fits
        ([t] * 12, {3, 4, 10}, []),  # truncated: targets 3, 4 stay
        ([t] * 12, {9, 10, 11}, []),  # dropped: no target in the first 8
        ([t] * 12, {0}, []),  # dropped: position 0 is nobody's target
        ([t] * 7 + [I, I] + [t] * 3, {2, 3}, [7]),  # dropped: the cut splits the picture
        ([t] * 6 + [I, I] + [I, I] + [t] * 2, {2, 3}, [6, 8]),  # truncated before a picture
    ]
    for i, (tokens, targets, starts) in enumerate(conversations):
        mask = np.array([k in targets for k in range(len(tokens))])
        writer.add(f"c{i}", "input", "chat", np.array(tokens), [
            (start, picture[0], picture[1]) for start in starts], "c", mask=mask)
    return writer.finalize(8, 8, overflow)


@pytest.mark.parametrize("overflow, truncated, dropped", [("truncate", 2, 3), ("drop", 0, 5)])
def test_truncation_keeps_a_target_and_never_cuts_a_picture(tmp_path, overflow, truncated,
                                                            dropped):
    counts = _write_chat_shard(tmp_path / "talk", overflow)
    assert (counts["truncated"], counts["dropped"]) == (truncated, dropped)
    reader = ShardReader(tmp_path / "talk", overflow)
    plan = np.load(tmp_path / "talk.pack8x8.npy")
    assert np.array_equal(plan, reader.compute_plan(8, 8))
    packed = {seq: length for _, seq, offset, length in plan.tolist()}
    assert packed == ({0: 6, 1: 8, 5: 8} if overflow == "truncate" else {0: 6})
    assert counts["packed_tokens"] == sum(packed.values())
    assert reader.vision_items(5)[:, 1].tolist() == [6, 8]  # two pictures, placeholder order
    assert reader.vision_items(0).shape == (0, 7)


def test_k3_data_counts_truncated_and_dropped_conversations(chat_run, tmp_path, caplog):
    """...and quarantines at tokenization a conversation holding a special token of the given
    tokenizer that the reader could not know of."""
    src = tmp_path / "talk"
    src.mkdir()
    tok = Tokenizer.from_file(str(chat_run["given_tokenizer"]))
    tok.add_special_tokens(["<|secret|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    river = " ".join(f"The river passes mill {i} and bridge {2 * i}." for i in range(30))
    boats = " ".join(f"I counted {i} boats near harbour {3 * i}." for i in range(30))
    records = [
        {"id": "short", "messages": [{"role": "user", "content": "Hello."},
                                     {"role": "assistant", "content": "Hello to you."}]},
        {"id": "long answer", "messages": [{"role": "user", "content": "Tell me of the river."},
                                           {"role": "assistant", "content": river}]},
        {"id": "long question", "messages": [{"role": "user", "content": boats},
                                             {"role": "assistant", "content": "I see."}]},
        {"id": "secret", "messages": [{"role": "user", "content": "Say <|secret|>."},
                                      {"role": "assistant", "content": "No."}]},
    ]
    (src / "talk.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for overflow, truncated, dropped in (("truncate", 1, 1), ("drop", 0, 2)):
        out = tmp_path / overflow
        cfg = DataConfig(name="talk", sources=[SourceConfig("talk", "chat", "jsonl", str(src))],
                         output_dir=str(out), progress=False, validation_fraction=0.0,
                         long_docs=LongDocConfig(num_docs=0), pack=PackConfig(seq_len=64),
                         chat_overflow=overflow)
        cfg.tokenizer.path = str(tmp_path / "tokenizer.json")
        summary = run_pipeline(cfg)
        assert summary["outcomes"]["kept"] == 3 and summary["balanced"]
        (secret,) = read_jsonl(out / "quarantine.jsonl")
        assert (secret["record_id"], secret["stage"], secret["reason"]) == (
            "secret", "tokenize", "invalid_conversation")
        assert "contains the special token text ['<|secret|>']" in secret["detail"]
        by_source = summary["output"]["by_source"]["talk"]
        assert (by_source["truncated"], by_source["dropped"]) == (truncated, dropped)
        (counts,) = [json.loads(p.read_text()) for p in out.glob("shards/talk/*.json")]
        assert (counts["truncated"], counts["dropped"], counts["seq_len"]) == (truncated,
                                                                               dropped, 64)
    # the loader counts for its own row length
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="data_pipeline.loader"):
        BatchSource(tmp_path / "truncate" / "manifest.json", 48, 1, 0, 1, 0, 8, 14, 2, 4)
    assert [r.getMessage() for r in caplog.records] == [
        "chat source talk: 2 conversations longer than seq_len=48: 1 truncated, 1 dropped "
        "(data.chat_overflow=truncate)"]


# ------------------------------------------------------------------ the given tokenizer

def test_a_given_tokenizer_without_the_chat_tokens_is_refused_naming_it(tmp_path):
    old = Tokenizer(models.BPE())
    old.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    old.train_from_iterator(["some old pre-training text"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(SPECIAL_TOKENS), show_progress=False))
    old.save(str(tmp_path / "old.json"))
    cfg = chat_config(tmp_path / "out", tmp_path / "old.json")
    old_path = re.escape(repr(str(tmp_path / "old.json")))
    with pytest.raises(ConfigError, match=rf"data.tokenizer.path={old_path} lacks the chat "
                                          r"special tokens \['<\|im_system\|>'"):
        run_pipeline(cfg)
    with pytest.raises(ConfigError, match=r"data.tokenizer.path='.*missing.json' is invalid: "
                                          "no such file"):
        run_pipeline(chat_config(tmp_path / "out", tmp_path / "missing.json"))
    assert not (tmp_path / "out").exists()  # refused before anything was read or written
