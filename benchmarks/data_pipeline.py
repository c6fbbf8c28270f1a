"""Data pipeline throughput: filter + dedup + tokenize on a generated text corpus, 1 vs 2 workers.

    python benchmarks/data_pipeline.py                      # 100 MB, workers 1 and 2
    python benchmarks/data_pipeline.py --mb 10 --workers 1  # a quick look

The corpus is encyclopedia-style documents (data_pipeline.make_sample's generators) with 5 %
exact copies, 5 % near copies (one word changed) and 2 % junk, in 8 JSONL files. Both runs use
the same 8 tasks, so they do the same work; only the number of processes running them differs.
The tokenizer is trained once beforehand (timed apart) and loaded by the runs. Worker processes
are forked, so their CPU time is counted; megatron-core is imported before the timing. Reported per
stage: wall seconds, documents/s and MB/s of input, and both divided by the worker count (per
core). Prints a markdown section; --results writes it to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data_pipeline.config import (  # noqa: E402
    DataConfig,
    ExecutorConfig,
    LongDocConfig,
    SourceConfig,
    TokenizerConfig,
)
from data_pipeline.make_sample import animal_document, town_document  # noqa: E402
from data_pipeline.pipeline import run_pipeline  # noqa: E402
from data_pipeline.tokenizer import train_tokenizer  # noqa: E402

FILES = 8
TASKS = 8


def generate_corpus(folder: Path, megabytes: float, seed: int = 0) -> tuple[int, int]:
    rng = random.Random(seed)
    target = megabytes * 1e6
    handles = [open(folder / f"part_{i:03d}.jsonl", "w", encoding="utf-8") for i in range(FILES)]
    docs = size = 0
    recent: list[str] = []
    while size < target:
        roll = rng.random()
        if roll < 0.05 and recent:
            text = rng.choice(recent)  # exact copy
        elif roll < 0.10 and recent:
            words = rng.choice(recent).split(" ")
            words[rng.randrange(len(words))] = "meanwhile"  # near copy
            text = " ".join(words)
        elif roll < 0.12:
            text = " ".join(["$$$ click here !!!"] * rng.randint(5, 40))  # junk
        else:
            text = (town_document if roll < 0.8 else animal_document)(rng, set())
            recent = (recent + [text])[-1000:]
        line = json.dumps({"id": f"doc-{docs}", "text": text}) + "\n"
        handles[docs % FILES].write(line)
        docs += 1
        size += len(line.encode("utf-8"))
    for h in handles:
        h.close()
    return docs, size


def bench(corpus: Path, tokenizer: Path, workers: int, out: Path) -> dict:
    cfg = DataConfig(
        name="bench", sources=[SourceConfig("web", "text", "jsonl", str(corpus))],
        output_dir=str(out), progress=False, tokenizer=TokenizerConfig(path=str(tokenizer)),
        long_docs=LongDocConfig(num_docs=0),
        executor=ExecutorConfig(tasks=TASKS, workers=workers, start_method="fork"))
    before = os.times()
    summary = run_pipeline(cfg)
    after = os.times()
    assert summary["balanced"], "records not accounted for"
    # CPU seconds of this process and of its (forked) worker processes: a per-core figure that
    # does not depend on what else the machine is running
    summary["cpu_s"] = sum(getattr(after, k) - getattr(before, k)
                           for k in ("user", "system", "children_user", "children_system"))
    return summary


def table(runs: dict[int, dict], docs: int, nbytes: int) -> list[str]:
    rows = ["| workers | stage | wall s | docs/s | MB/s | docs/s per worker | MB/s per worker |",
            "|---|---|---|---|---|---|---|"]
    mb = nbytes / 1e6
    for workers, summary in runs.items():
        timing = summary["timing"]
        stages = [("curate (read, filters, signatures)", timing["curate"]["wall_s"]),
                  ("dedup clusters + tokenizer load", timing["global"]["wall_s"]),
                  ("tokenize to shards", timing["tokenize"]["wall_s"])]
        stages.append(("filter + dedup + tokenize", sum(w for _, w in stages)))
        for name, wall in stages:
            rows.append(f"| {workers} | {name} | {wall:.1f} | {docs / wall:,.0f} | "
                        f"{mb / wall:.2f} | {docs / wall / workers:,.0f} | "
                        f"{mb / wall / workers:.2f} |")
    rows += ["", "| workers | CPU s (whole run) | docs per CPU s | MB per CPU s |",
             "|---|---|---|---|"]
    for workers, summary in runs.items():
        cpu = summary["cpu_s"]
        rows.append(f"| {workers} | {cpu:.1f} | {docs / cpu:,.0f} | {mb / cpu:.2f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--results", type=Path, default=None)
    args = parser.parse_args()
    import megatron.core.datasets.indexed_dataset  # noqa: F401  (its ~3 s import is not timed)

    with tempfile.TemporaryDirectory(prefix="k3_data_bench_") as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus"
        corpus.mkdir()
        t0 = time.perf_counter()
        docs, nbytes = generate_corpus(corpus, args.mb)
        gen_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        sample = [json.loads(line)["text"] for line in
                  (corpus / "part_000.jsonl").read_text(encoding="utf-8").splitlines()[:5000]]
        tok_docs = len(sample)
        train_tokenizer(sample, vocab_size=2048).save(str(tmp / "tokenizer.json"))
        tok_s = time.perf_counter() - t0
        runs = {}
        load = os.getloadavg()[0]
        for workers in args.workers:
            runs[workers] = bench(corpus, tmp / "tokenizer.json", workers, tmp / f"out_{workers}")
            print(f"workers={workers}: {json.dumps(runs[workers]['timing'])}", file=sys.stderr)
    first = next(iter(runs.values()))["outcomes"]
    lines = [
        "## Data pipeline (benchmarks/data_pipeline.py)", "",
        f"Corpus: {docs:,} documents, {nbytes / 1e6:.1f} MB in {FILES} JSONL files, {TASKS} "
        f"tasks (generated in {gen_s:.1f} s; tokenizer trained on {tok_docs:,} documents in "
        f"{tok_s:.1f} s, then loaded). Outcomes: kept {first['kept']:,}, duplicates "
        f"{sum(first['duplicate'].values()):,}, filtered {sum(first['filtered'].values()):,}.",
        f"Machine: {os.cpu_count()} cores, load average {load:.1f} before the runs (other "
        "processes share the cores: compare the CPU-second figures, not the wall times, "
        "when it is above 0).", "",
        *table(runs, docs, nbytes), "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.results:
        args.results.write_text(text)


if __name__ == "__main__":
    main()
