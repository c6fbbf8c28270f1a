"""The Gopher quality and repetition rules with three word splitters, side by side: how much of a
clean documentation corpus each keeps, how much of the sample's planted Gopher junk each
removes, and its time per MB.

    python -m benchmarks.word_splitting

Splitters: `gopher` (data_pipeline.filters.GopherWordTokenizer: whitespace pieces, punctuation
stripped, punctuation-only pieces dropped), `punct-words` (the splitter the pipeline used
before: a regular expression that makes every run of punctuation a word) and `spacy`
(datatrove's default for English; needs spaCy installed, which the project does not depend on,
and is skipped otherwise). Corpora: tests/fixtures/clean_prose.jsonl (36 documents written for
the tests: guides, reference entries, option lists) and the planted junk of the bundled sample
that the Gopher rules are meant to catch (data_pipeline/sample/planted.json, stage
filter_gopher_*).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from datatrove.data import Document
from datatrove.pipeline.filters.gopher_quality_filter import GopherQualityFilter
from datatrove.pipeline.filters.gopher_repetition_filter import GopherRepetitionFilter
from datatrove.utils.word_tokenizers import WordTokenizer

from data_pipeline.config import SAMPLE_DIR
from data_pipeline.filters import GopherWordTokenizer

ROOT = Path(__file__).resolve().parent.parent


class PunctuationWords(WordTokenizer):
    """Words and runs of punctuation, each a word (the former splitter)."""

    _WORD = re.compile(r"\w+(?:[-'\u2019]\w+)*|[^\w\s]+")

    def word_tokenize(self, text: str) -> list[str]:
        return self._WORD.findall(text)

    def sent_tokenize(self, text: str) -> list[str]:
        return [text]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        return [(0, len(text))]


def _clean() -> list[str]:
    path = ROOT / "tests" / "fixtures" / "clean_prose.jsonl"
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def _gopher_junk() -> list[str]:
    wanted = {j["id"] for j in json.loads((SAMPLE_DIR / "planted.json").read_text())["junk"]
              if j["stage"].startswith("filter_gopher")}
    texts = []
    for path in sorted((SAMPLE_DIR / "text" / "web").glob("*.jsonl")):
        for i, line in enumerate(path.read_bytes().splitlines()):
            if f"web/{path.name}#{i}" in wanted:
                texts.append(json.loads(line)["text"])
    return texts


def _kept(language, texts: list[str]) -> list[bool]:
    rules = (GopherQualityFilter(language=language), GopherRepetitionFilter(language=language))
    return [all(r.filter(Document(t, "d")) is True for r in rules) for t in texts]


def main() -> None:
    clean, junk = _clean(), _gopher_junk()
    splitters = {"gopher": GopherWordTokenizer(), "punct-words": PunctuationWords()}
    try:
        import spacy  # noqa: F401

        splitters["spacy"] = "eng"
    except ImportError:
        print("spacy: not installed, skipped")
    mb = sum(len(t.encode()) for t in clean) / 1e6
    print(f"clean: {len(clean)} documents ({mb * 1e3:.0f} kB); Gopher junk: {len(junk)} documents")
    print(f"{'splitter':<12} {'clean kept':>10} {'junk removed':>12} {'s per MB':>9}")
    for name, language in splitters.items():
        _kept(language, clean[:1])  # load outside the timing
        t0 = time.perf_counter()
        kept = _kept(language, clean)
        seconds = time.perf_counter() - t0
        removed = sum(not k for k in _kept(language, junk))
        print(f"{name:<12} {sum(kept) / len(clean):>10.1%} {removed:>7}/{len(junk):<4} "
              f"{seconds / mb:>9.2f}")


if __name__ == "__main__":
    main()
