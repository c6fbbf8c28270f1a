"""Dataset safety and bad input: a prepared dataset is used as
it is or refused with the fix, never re-curated over; a non-empty output is replaced only with
data.overwrite=true and only once the new dataset is complete; a run where nothing survives
still ends with summary, manifest and ledger, and k3-train refuses the empty dataset; missing
or unreadable paths are errors naming them; sources may be files, folders or globs and read
only matching files; image-text JSONL is read with missing/undecodable images quarantined; the
ledger names each record by file, line and its own id."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from data_pipeline.config import DataConfig, LongDocConfig, SourceConfig
from data_pipeline.pipeline import ensure_prepared, run_pipeline
from data_pipeline.publish import partial_dir
from data_pipeline.records import read_jsonl, read_ledger
from model.config import ConfigError
from tests.helpers import FIXTURES, REPO

PROSE = FIXTURES / "clean_prose.jsonl"


def _cfg(out: Path, *sources: SourceConfig, **kw) -> DataConfig:
    return DataConfig(name="mine", sources=list(sources), output_dir=str(out), progress=False,
                      long_docs=LongDocConfig(num_docs=0), **kw)


def _prose_source(folder: Path, name: str = "docs", lines: slice = slice(None)) -> SourceConfig:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "docs.jsonl").write_text("".join(PROSE.read_text().splitlines(True)[lines]))
    return SourceConfig(name, "text", "jsonl", str(folder))


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


# ------------------------------------------------------------------ 1: no implicit overwrite

def test_train_uses_a_prepared_dataset_as_it_is_or_stops_naming_both_sources(tmp_path):
    out = tmp_path / "k3"
    mine = _cfg(out, _prose_source(tmp_path / "raw"))
    run_pipeline(mine)
    before = _snapshot(out)
    # k3-train's data config: the bundled sample's sources, the same output folder
    sample = DataConfig(output_dir=str(out), progress=False)
    with pytest.raises(ConfigError) as e:
        ensure_prepared(sample)
    msg = str(e.value)
    assert str(tmp_path / "raw") in msg and "bundled://text/web" in msg
    assert "data.use_prepared=true" in msg and "data.overwrite=true" in msg
    assert _snapshot(out) == before  # nothing re-curated, nothing deleted
    sample.use_prepared = True
    assert ensure_prepared(sample) == out / "manifest.json"
    assert ensure_prepared(mine) == out / "manifest.json"
    assert run_pipeline(mine)["balanced"]  # the same config again: nothing to do
    assert _snapshot(out) == before


def test_recurating_needs_overwrite_and_keeps_the_old_dataset_until_the_new_is_complete(
        tmp_path, monkeypatch):
    out = tmp_path / "k3"
    run_pipeline(_cfg(out, _prose_source(tmp_path / "raw_a", lines=slice(0, 20))))
    before = _snapshot(out)
    other = _cfg(out, _prose_source(tmp_path / "raw_b", lines=slice(20, None)))
    with pytest.raises(ConfigError, match=r"holds a complete dataset.*data\.overwrite=true"):
        run_pipeline(other)
    assert _snapshot(out) == before

    from data_pipeline import tokenize_shards

    def crash(self, data, rank=0, world_size=1):
        raise RuntimeError("killed mid-run")
        yield

    other.overwrite = True
    with monkeypatch.context() as m:
        m.setattr(tokenize_shards.TokenizeToShards, "run", crash)
        with pytest.raises(RuntimeError, match="killed mid-run"):
            run_pipeline(other)
    assert _snapshot(out) == before  # the failed build lies beside, the old dataset is whole
    assert partial_dir(out).exists()
    summary = run_pipeline(other)
    assert summary["outcomes"]["kept"] == 16 and not partial_dir(out).exists()
    kept = {d["id"] for p in out.glob("shards/*/*.docs.jsonl") for d in read_jsonl(p)}
    assert kept and all("/raw_b/" not in k and k.startswith("docs/") for k in kept)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["data"]["sources"][0]["path"] == str(tmp_path / "raw_b")


# ------------------------------------------------------------------ 2: nothing survives

@pytest.mark.parametrize("case", ["empty_file", "empty_folder", "binary_file", "all_filtered"])
def test_a_run_where_nothing_survives_finishes_and_training_refuses_it(tmp_path, case):
    src = tmp_path / "src"
    src.mkdir()
    content = {"empty_file": b"", "binary_file": bytes(range(256)) * 4,
               "all_filtered": b'{"id": "x1", "text": "too short to keep"}\n'}
    if case in content:
        (src / "part.jsonl").write_bytes(content[case])
    out = tmp_path / "out"
    cfg = _cfg(out, SourceConfig("web", "text", "jsonl", str(src)))
    summary = run_pipeline(cfg)
    assert summary["outcomes"]["kept"] == 0 and summary["balanced"]
    for name in ("summary.json", "manifest.json", "quarantine.jsonl", "ledger"):
        assert (out / name).exists(), name
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["kept_documents"] == 0
    assert all(not s["shards"] for s in manifest["sources"])
    ledger = read_ledger(out)
    assert len(ledger) == summary["input"]["records"]
    if case == "all_filtered":
        (rec,) = ledger
        assert (rec["file"], rec["line"], rec["record_id"]) == (str(src / "part.jsonl"), 1, "x1")
        assert rec["reason"] == "text_too_short"
    with pytest.raises(ConfigError, match=rf"{out}.*holds no documents"):
        ensure_prepared(cfg)


def _k3_data(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "data_pipeline.cli", *overrides], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_k3_data_says_when_nothing_is_kept_and_is_quiet_unless_verbose(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_bytes(b"\xff\xfe not utf-8\n")
    args = (f"data.output_dir={tmp_path / 'out'}", f"data.sources=[{{name: web, path: '{src}'}}]",
            "stage.long_docs.num_docs=0")
    result = _k3_data(*args)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "is empty: none of the 1 input records survived" in result.stdout
    assert "non_utf8: 1" in result.stdout
    # quiet by default: one bar per stage and the summary, no datatrove INFO log lines
    assert "INFO" not in result.stderr and "Stats" not in result.stderr, result.stderr[-2000:]
    assert all(f"k3-data {stage}" in result.stderr
               for stage in ("curate", "buckets", "global", "tokenize", "finalize"))
    verbose = _k3_data(*args, "data.overwrite=true", "data.verbose=true")
    assert verbose.returncode == 0, verbose.stderr[-2000:]
    assert "INFO" in verbose.stderr and "Stats" in verbose.stderr


# ------------------------------------------------------------------ 3: missing, unreadable

def test_missing_source_path_is_an_error_naming_it(tmp_path):
    cfg = _cfg(tmp_path / "out", SourceConfig("web", "text", "jsonl", str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match=rf"data.sources\[0\].path='{tmp_path / 'nope'}'"):
        run_pipeline(cfg)


def _check_as_unprivileged_user(source: Path) -> str | None:
    """check_sources_exist's ConfigError message (None: no error), run in a forked child that
    drops root's rights first (root reads every folder)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(read_end)
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            try:
                _cfg(Path("/nonexistent"), SourceConfig("web", "text", "jsonl", str(source))) \
                    .check_sources_exist()
                message = ""
            except ConfigError as e:
                message = f"ConfigError: {e}"
            os.write(write_end, message.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        message = f.read().decode()
    os.waitpid(pid, 0)
    return message or None


def test_unreadable_source_folder_is_an_error_naming_it():
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="k3-unreadable-"))  # /tmp: reachable by every user
    locked = root / "src" / "locked"
    try:
        root.chmod(0o755)
        locked.mkdir(parents=True)
        (root / "src" / "ok.jsonl").write_text('{"text": "fine"}\n')
        (locked / "more.jsonl").write_text('{"text": "hidden"}\n')
        locked.chmod(0o000)
        message = _check_as_unprivileged_user(root / "src")
        assert message is not None and "data.sources[0].path" in message
        assert f"cannot read {locked}: Permission denied" in message
        locked.chmod(0o755)
        assert _check_as_unprivileged_user(root / "src") is None
    finally:
        locked.chmod(0o755)
        shutil.rmtree(root)


# ------------------------------------------------------------------ 6: files, globs, image_text

def _png(size=(64, 48), color=(200, 40, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_sources_may_be_files_folders_or_globs_and_only_matching_files_are_read(tmp_path):
    from data_pipeline.sources import list_source_files

    mixed = tmp_path / "mixed"
    (mixed / "2024-01").mkdir(parents=True)
    (mixed / "2024-02").mkdir()
    for month in ("2024-01", "2024-02"):
        (mixed / month / "part-0.jsonl").write_text('{"text": "x"}\n')
    (mixed / "picture.png").write_bytes(_png())
    (mixed / "meta.json").write_text("{}")
    (mixed / "notes.txt").write_text("not data")

    def files(path, fmt="jsonl", glob=None):
        base, found = list_source_files(str(path), fmt, glob, "data.sources[0].path")
        return [os.path.join(base, f) for f in found]

    assert files(mixed) == [str(mixed / f"2024-0{m}/part-0.jsonl") for m in (1, 2)]
    assert files(mixed / "2024-02" / "part-0.jsonl") == [str(mixed / "2024-02/part-0.jsonl")]
    assert files(f"{mixed}/2024-0[2-9]/*.jsonl") == [str(mixed / "2024-02/part-0.jsonl")]
    assert files(f"{mixed}/**/*.png", "image_folder") == [str(mixed / "picture.png")]
    assert files(mixed, glob="*.txt") == [str(mixed / "notes.txt")]

    # end to end: a text source on the mixed folder reads its two JSONL files only
    summary = run_pipeline(_cfg(tmp_path / "out", SourceConfig("web", "text", "jsonl",
                                                               str(mixed))))
    assert summary["input"]["records"] == 2 and summary["outcomes"]["quarantined"] == {}


def test_image_text_jsonl_reader_quarantines_missing_and_undecodable_images(tmp_path):
    src = tmp_path / "captions"
    (src / "img").mkdir(parents=True)
    (src / "img" / "red.png").write_bytes(_png())
    (src / "img" / "blue.png").write_bytes(_png((48, 64), (20, 30, 220)))
    (src / "img" / "broken.png").write_bytes(b"\x89PNG not really")
    rows = [
        {"id": "r1", "caption": "A red rectangle on its own.", "image": "img/red.png",
         "metadata": {"license": "cc0"}},
        {"id": "b1", "caption": "A blue rectangle standing upright.", "image": "img/blue.png"},
        {"id": "m1", "caption": "This picture does not exist.", "image": "img/missing.png"},
        {"id": "u1", "caption": "This picture does not decode.", "image": "img/broken.png"},
        {"id": "n1", "caption": "No image field at all."},
    ]
    (src / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    summary = run_pipeline(_cfg(out, SourceConfig("pairs", "image", "image_text", str(src))))
    assert summary["input"]["records"] == 5 and summary["balanced"]
    assert summary["outcomes"]["kept"] == 2
    quarantine = {r["record_id"]: r for r in read_jsonl(out / "quarantine.jsonl")}
    assert set(quarantine) == {"m1", "u1", "n1"}
    assert quarantine["m1"]["reason"] == "missing_image"
    assert str(src / "img" / "missing.png") in quarantine["m1"]["detail"]
    assert quarantine["n1"]["reason"] == "missing_image"
    assert quarantine["u1"]["reason"] not in ("missing_image", None)
    assert {(r["file"], r["line"]) for r in quarantine.values()} == {
        (str(src / "pairs.jsonl"), 3), (str(src / "pairs.jsonl"), 4),
        (str(src / "pairs.jsonl"), 5)}
    docs = [d for p in out.glob("shards/pairs/*.docs.jsonl") for d in read_jsonl(p)]
    assert sorted(d["id"] for d in docs) == ["pairs/pairs.jsonl#0", "pairs/pairs.jsonl#1"]
    assert {d["modality"] for d in docs} == {"image"}
    # kept records are traced by the same fields
    assert sorted((d["file"], d["line"], d["record_id"]) for d in docs) == [
        (str(src / "pairs.jsonl"), 1, "r1"), (str(src / "pairs.jsonl"), 2, "b1")]
    curated = {d["id"]: d for p in out.glob("work/curated/*.jsonl") for d in read_jsonl(p)}
    red = curated["pairs/pairs.jsonl#0"]["metadata"]
    assert red["record_metadata"] == {"license": "cc0"} and red["grid_thws"][0][0] == 1
    assert (red["file"], red["line"], red["orig_id"]) == (str(src / "pairs.jsonl"), 1, "r1")
