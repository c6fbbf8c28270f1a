"""The quality filters on clean technical prose and on junk: with words
split as the Gopher rules define them (no punctuation words), at least 90% of a clean corpus of
documentation-style prose is kept (tests/fixtures/clean_prose.jsonl, written for this test:
guides, reference entries, option lists, troubleshooting notes), while junk, repetition and
symbol soup are still removed, each by the rule meant for it."""

from __future__ import annotations

import json

import pytest
from datatrove.data import Document

from data_pipeline.config import DataConfig
from data_pipeline.filters import GopherWordTokenizer, quality_filters
from tests.helpers import FIXTURES

PROSE = FIXTURES / "clean_prose.jsonl"


def _outcome(steps, text: str) -> str:
    """'kept' or the reason of the first filter that drops the text."""
    doc = Document(text, "d", metadata={"modality": "text"})
    for step in steps:
        result = step.filter(doc)
        if result is not True:
            return result[1] if isinstance(result, tuple) else step.name
    return "kept"


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    return quality_filters(DataConfig(), str(tmp_path_factory.mktemp("ledger")))


def test_clean_documentation_prose_is_kept(steps):
    docs = [json.loads(line) for line in PROSE.read_text().splitlines()]
    assert len(docs) >= 30
    outcomes = {d["id"]: _outcome(steps, d["text"]) for d in docs}
    kept = sum(o == "kept" for o in outcomes.values())
    assert kept / len(docs) >= 0.9, {k: o for k, o in outcomes.items() if o != "kept"}


JUNK = {
    "symbol soup": ("gopher_short_doc",
                    " ".join(["@@ ## $$ %% ^^ && ** (( )) -- ++ == {} [] <> || ;; ::"] * 12)),
    "number table": ("gopher_below_alpha_threshold",
                     "\n".join(" ".join(str(1000 + (r * 397 + c * 113) % 9000) for c in range(12))
                               for r in range(20)) + "\nthe total of the table"),
    "repeated line": ("dup_line_frac",
                      "\n".join(["Click here to subscribe to our newsletter today!"] * 10 +
                                ["We send one email a week about the project and its news.",
                                 "You can unsubscribe at any time from the link in it."])),
    "repeated n-grams": ("top_2_gram",
                         " ".join(["buy cheap watches online"] * 40) + " and that is the deal"),
    "no stop words": ("gopher_enough_stop_words",
                      " ".join(f"keyword{i} product{i} discount{i} offer{i} sale{i}"
                               for i in range(20))),
    "hash tags": ("gopher_too_many_hashes",
                  " ".join(f"#tag{i} #topic{i} words here" for i in range(30)) + " the end"),
    "base64 blob": ("gopher_above_avg_threshold",
                    " ".join("QmFzZTY0IGVuY29kZWQgYmxvYiBvZiBub3RoaW5n" + str(i)
                             for i in range(60)) + " the and of to"),
    "ellipsis lines": ("gopher_too_many_end_ellipsis",
                       "\n".join(f"Read more about the story number {i} of the week and..."
                                 for i in range(12))),
}


@pytest.mark.parametrize("kind", sorted(JUNK))
def test_junk_repetition_and_symbol_soup_are_removed(steps, kind):
    reason, text = JUNK[kind]
    assert len(text) >= 200  # past the length filter: the rule under test decides
    outcome = _outcome(steps, text)
    assert outcome != "kept" and outcome.startswith(reason), outcome


def test_gopher_words_strip_punctuation_and_drop_punctuation_only_pieces():
    words = GopherWordTokenizer().word_tokenize(
        'Call `open(path, mode="r")` -- see e.g. the docs... (v2.4) => done.')
    assert words == ["Call", 'open(path', 'mode="r', "see", "e.g", "the", "docs", "v2.4",
                     "done"]
