"""The end of a run: the summary (every input record accounted for), the quarantine file and the
manifest that ties tokenizer, shards and mixture weights together for the loader.

manifest.json (written last; its presence with "complete": true marks a finished run):
    version, complete, fingerprint (of the config that made it), data (that config's settings
    that change the data: name, sources, filters, ...), kept_documents (input documents in the
    shards and the held-out split; 0: nothing survived, and tokenizer, vocab_size are null and
    sources have no shards), tokenizer, vocab_size, special_tokens, pack {seq_len,
    max_docs_per_row}, chat_overflow (what packing does with a conversation longer than the row,
    at any seq_len), vision {patch_size, merge_size, frames_per_chunk}, sources [{name,
    modality, weight, shards [{prefix, docs, tokens, rows, images, videos}]}] with shard
    prefixes relative to the manifest's folder, validation (the held-out split,
    validation_split.py: the same form, natural proportions). Readers ignore keys they do not
    know, so new keys can be added.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter, defaultdict
from pathlib import Path

from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep

from .config import DataConfig
from .records import read_jsonl, read_ledger, write_json
from .tokenize_shards import SYNTHETIC_SOURCE, tokenizer_path
from .tokenizer import SPECIAL_TOKENS
from .validation_split import VALIDATION_DIR

MANIFEST_VERSION = 1
# summed per source in the summary; truncated and dropped: conversations longer than the row
SHARD_COUNTS = ("docs", "tokens", "rows", "images", "videos", "truncated", "dropped")
RUN_SETTINGS = ("output_dir", "resume", "overwrite", "use_prepared", "progress", "verbose",
                "executor")  # do not change the data


def data_settings(cfg: DataConfig) -> dict:
    """Everything in the config that changes the output data."""
    d = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RUN_SETTINGS}
    d["executor_tasks"] = cfg.executor.tasks  # shard layout
    return d


def fingerprint(cfg: DataConfig) -> str:
    return hashlib.sha256(json.dumps(data_settings(cfg), sort_keys=True).encode()).hexdigest()[:16]


def _shards_and_docs(out: Path, folder: str = "shards") -> tuple[list[dict],
                                                                  dict[str, list[dict]]]:
    shards: dict[str, list[dict]] = defaultdict(list)
    docs = []
    for stats_path in sorted((out / folder).glob("*/*.json")):
        prefix = stats_path.with_suffix("")
        shards[stats_path.parent.name].append({
            "prefix": str(prefix.relative_to(out)), **json.loads(stats_path.read_text())})
        docs += read_jsonl(Path(f"{prefix}.docs.jsonl"))
    return docs, shards


def build_summary(out: Path, timings: dict[str, dict]) -> dict:
    reads = [json.loads(p.read_text()) | {"source": p.parent.name}
             for p in sorted((out / "counts" / "read").glob("*/*.json"))]
    by_source: dict[str, Counter] = defaultdict(Counter)
    for r in reads:
        by_source[r["source"]].update(records=r["records"], bytes=r["bytes"])
    ledger = [rec for rec in read_ledger(out) if rec["origin"] == "input"]
    docs, shards = _shards_and_docs(out)
    held_out_docs, held_out = _shards_and_docs(out, VALIDATION_DIR)
    kept_input = [d for d in docs + held_out_docs if d["origin"] == "input"]
    outcomes: dict[str, Counter] = {o: Counter() for o in ("filtered", "duplicate",
                                                            "quarantined")}
    by_stage: dict[str, Counter] = defaultdict(Counter)
    for rec in ledger:
        outcomes[rec["outcome"]][rec["reason"]] += 1
        by_stage[rec["stage"]][f"{rec['outcome']}:{rec['reason']}"] += 1
    input_records = sum(c["records"] for c in by_source.values())
    input_bytes = sum(c["bytes"] for c in by_source.values())
    outcome_ids = Counter([rec["id"] for rec in ledger] + [d["id"] for d in kept_input])
    accounted = len(kept_input) + sum(sum(c.values()) for c in outcomes.values())
    seq_len = next((s["seq_len"] for ss in shards.values() for s in ss), 0)
    rows = sum(s["rows"] for ss in shards.values() for s in ss)
    tokens = sum(s["tokens"] for ss in shards.values() for s in ss)
    packed = sum(s["packed_tokens"] for ss in shards.values() for s in ss)
    return {
        "input": {"records": input_records, "bytes": input_bytes,
                  "by_source": {k: dict(v) for k, v in sorted(by_source.items())}},
        "outcomes": {"kept": len(kept_input),
                     **{k: dict(sorted(v.items())) for k, v in outcomes.items()}},
        "accounted": accounted,
        "records_with_several_outcomes": sum(1 for n in outcome_ids.values() if n > 1),
        "balanced": accounted == input_records and all(n == 1 for n in outcome_ids.values()),
        "by_stage": {k: dict(sorted(v.items())) for k, v in sorted(by_stage.items())},
        "derived": dict(Counter(d["origin"] for d in docs if d["origin"] != "input")),
        "output": {
            "tokens": tokens, "rows": rows, "seq_len": seq_len,
            "fill": round(packed / (rows * seq_len), 4) if rows else 0.0,
            "by_source": {name: {k: sum(s[k] for s in ss) for k in SHARD_COUNTS if k in ss[0]}
                          for name, ss in sorted(shards.items())},
            "validation": {k: sum(s[k] for ss in held_out.values() for s in ss)
                           for k in ("docs", "tokens", "rows")},
        },
        "timing": _throughput(timings, input_records, input_bytes, _curated_count(out)),
    }


def _curated_count(out: Path) -> int:
    count = 0
    for path in (out / "work" / "curated").glob("*.jsonl"):
        with open(path, "rb") as f:
            count += sum(1 for _ in f)
    return count


def _throughput(timings: dict[str, dict], records: int, nbytes: int, curated: int) -> dict:
    """Documents per second into each stage (the curate stage reads the input records, the
    later stages the curated documents) and the input MB/s of the whole run."""
    out = {}
    for stage, t in timings.items():
        docs = records if stage == "curate" else curated
        out[stage] = {"wall_s": round(t["wall_s"], 3), "docs_in": docs,
                      "docs_per_s": round(docs / max(t["wall_s"], 1e-9), 1)}
        if stage == "curate":
            out[stage]["mb_per_s"] = round(nbytes / 1e6 / max(t["wall_s"], 1e-9), 3)
    if timings:
        total = max(sum(t["wall_s"] for t in timings.values()), 1e-9)
        out["total"] = {"wall_s": round(total, 3), "docs_per_s": round(records / total, 1),
                        "mb_per_s": round(nbytes / 1e6 / total, 3)}
    return out


def write_quarantine(out: Path) -> int:
    records = [r for r in read_ledger(out) if r["outcome"] == "quarantined"]
    with open(out / "quarantine.jsonl", "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return len(records)


def build_manifest(out: Path, cfg: DataConfig) -> dict:
    from .tokenizer import load_tokenizer

    docs, shards = _shards_and_docs(out)
    held_out_docs, held_out = _shards_and_docs(out, VALIDATION_DIR)
    tokenizer = tokenizer_path(out)
    weights = {s.name: s.weight for s in cfg.sources} | {SYNTHETIC_SOURCE: cfg.long_docs.weight}
    modalities = {s.name: s.modality for s in cfg.sources} | {SYNTHETIC_SOURCE: "text"}
    return {
        "version": MANIFEST_VERSION,
        "complete": True,
        "fingerprint": fingerprint(cfg),
        "data": data_settings(cfg),
        "kept_documents": sum(1 for d in docs + held_out_docs if d["origin"] == "input"),
        "tokenizer": tokenizer.name if tokenizer.exists() else None,
        "vocab_size": load_tokenizer(tokenizer).get_vocab_size() if tokenizer.exists() else None,
        "special_tokens": {t: i for i, t in enumerate(SPECIAL_TOKENS)},
        "pack": dataclasses.asdict(cfg.pack),
        "chat_overflow": cfg.chat_overflow,
        "vision": {"patch_size": cfg.image.patch_size, "merge_size": cfg.image.merge_size,
                   "frames_per_chunk": cfg.image.frames_per_chunk},
        "sources": [{"name": name, "modality": modalities[name], "weight": weights[name],
                     "shards": ss} for name, ss in sorted(shards.items())],
        "validation": [{"name": name, "modality": modalities[name], "weight": None,
                        "shards": ss}
                       for name, ss in sorted(held_out.items())],
    }


def manifest_path(out: str | Path) -> Path:
    return Path(out) / "manifest.json"


def timings_path(out: Path) -> Path:
    return out / "work" / "timings.json"


def finalize_run(out: Path, cfg: DataConfig) -> dict:
    """Summary, quarantine and (last) the manifest; returns the summary."""
    timings = json.loads(timings_path(out).read_text()) if timings_path(out).exists() else {}
    (out / "ledger").mkdir(exist_ok=True)  # there even when no record left the pipeline
    summary = build_summary(out, timings)
    write_quarantine(out)
    write_json(out / "summary.json", summary)
    write_json(manifest_path(out), build_manifest(out, cfg))
    return summary


class FinalizeStep(PipelineStep):
    name = "finalize"
    type = "MANIFEST"

    def __init__(self, cfg: DataConfig, output_dir: str):
        super().__init__()
        self.cfg = cfg
        self.output_dir = output_dir

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        if data:
            yield from data
        finalize_run(Path(self.output_dir), self.cfg)
