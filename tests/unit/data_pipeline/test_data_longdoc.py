"""Synthetic long documents: exact stage lengths, facts spread over the context, an answer that
needs the whole chain, and a checker that accepts right and rejects wrong answers."""

from __future__ import annotations

import re

import pytest
import yaml

from data_pipeline.config import StageConfig
from data_pipeline.longdoc import LongDocSample, check_answer, generate_long_document
from data_pipeline.tokenizer import EOD_ID, load_tokenizer
from tests.helpers import REPO

STAGES = REPO / "configs" / "stage"


@pytest.fixture(scope="module")
def tok(sample_run):
    return load_tokenizer(sample_run["out"] / "tokenizer.json")


def _stage(name: str) -> StageConfig:
    from data_pipeline.config import LongDocConfig

    d = yaml.safe_load((STAGES / f"{name}.yaml").read_text())
    return StageConfig(**{**d, "long_docs": LongDocConfig(**d["long_docs"])}).validate()


def _solve(tok, sample: LongDocSample) -> str:
    """Follows the chain in the decoded context, as a reader of the document would."""
    text = tok.decode(sample.tokens[:sample.body_len])
    inside = dict(re.findall(r"(\w+) is inside (\w+)\.", text))
    rooms = dict(re.findall(r"(\w+) is kept in room (\d+)\.", text))
    node = re.search(r"In which room is (\w+) kept\?", sample.question).group(1)
    hops = 1
    while node not in rooms:
        node = inside[node]
        hops += 1
    return rooms[node], hops


@pytest.mark.parametrize("stage", ["tiny", "tiny_s2", "tiny_s3", "tiny_s4"])
def test_generated_length_matches_the_stage(tok, stage):
    cfg = _stage(stage)
    sample = generate_long_document(tok, cfg.seq_len, seed=1, hops=cfg.long_docs.hops,
                                    distractor_chains=cfg.long_docs.distractor_chains)
    assert len(sample.tokens) == cfg.seq_len and sample.tokens[-1] == EOD_ID
    answer, hops = _solve(tok, sample)
    assert answer == sample.answer and hops == cfg.long_docs.hops
    # each needed fact lies in a different part of the context
    parts = {pos * cfg.long_docs.hops // sample.body_len for pos in sample.fact_positions}
    assert parts == set(range(cfg.long_docs.hops))
    prompt = tok.decode(sample.tokens[:sample.prompt_len])
    assert prompt.endswith("Answer:") and sample.question in prompt


def test_checker_accepts_right_and_rejects_wrong_answers(tok):
    sample = generate_long_document(tok, 512, seed=3, hops=3, distractor_chains=4)
    text = tok.decode(sample.tokens[:sample.body_len])
    distractor_rooms = set(re.findall(r"room (\d+)\.", text)) - {sample.answer}
    assert len(distractor_rooms) == 4
    for right in (sample.answer, f" {sample.answer}", f"Room {sample.answer}.",
                  f"{sample.answer}\n"):
        assert check_answer(sample, right)
    wrong = [str(int(sample.answer) + 1), f"{sample.answer}0", "", "room", *distractor_rooms]
    for answer in wrong:
        assert not check_answer(sample, answer), answer


def test_same_seed_same_document_and_too_short_rejected(tok):
    a = generate_long_document(tok, 1024, seed=9, hops=4, distractor_chains=8)
    b = generate_long_document(tok, 1024, seed=9, hops=4, distractor_chains=8)
    c = generate_long_document(tok, 1024, seed=10, hops=4, distractor_chains=8)
    assert a.tokens == b.tokens and a.tokens != c.tokens
    with pytest.raises(ValueError, match="too short"):
        generate_long_document(tok, 128, seed=0, hops=6, distractor_chains=32)


def test_documents_do_not_depend_on_the_process_hash_seed(sample_run):
    import os
    import subprocess
    import sys

    code = ("import sys; from data_pipeline.tokenizer import load_tokenizer; "
            "from data_pipeline.longdoc import generate_long_document; "
            "tok = load_tokenizer(sys.argv[1]); "
            "print(generate_long_document(tok, 512, seed=4, hops=3, distractor_chains=4).tokens)")
    repo = REPO
    tokenizer = str(sample_run["out"] / "tokenizer.json")
    outputs = {subprocess.run([sys.executable, "-c", code, tokenizer], cwd=repo, check=True,
                              capture_output=True, text=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout
               for seed in ("1", "2")}
    assert len(outputs) == 1
