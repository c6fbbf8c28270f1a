"""Synthetic long documents: facts spread over the whole context and, at the end, a
question that only a chain of several of them answers.

A chain of `hops` facts: "Mirel is inside Tosak." ... "Varun is kept in room 417." The question
"In which room is Mirel kept?" needs every link. Distractor chains of the same shape (other
names, other rooms) sit in between, so no single fact or keyword lookup answers it. The needed
facts fall into `hops` different equal parts of the context, in shuffled order. Documents are
assembled from separately tokenized sentences so that the length is exactly `seq_len` tokens,
<eod> included.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from itertools import accumulate

from tokenizers import Tokenizer

from .tokenizer import EOD_ID, encode_text

_SYLLABLES = ["ka", "ri", "to", "mel", "va", "sun", "de", "lo", "pir", "an", "ze", "tu", "bor",
              "ni", "qua", "sel", "ra", "mo", "fen", "ish"]
_ADJ = ["quiet", "old", "bright", "narrow", "heavy", "distant", "green", "small", "warm", "tall"]
_NOUN = ["river", "market", "tower", "garden", "bridge", "library", "harbor", "valley", "road",
         "forest"]
_VERB = ["stood", "waited", "rested", "shone", "changed", "grew", "remained", "appeared"]
_TIME = ["morning", "evening", "winter", "summer", "festival", "storm", "harvest", "night"]
_SINGLE_TOKEN_CANDIDATES = (" the", " a", " and", " of", ".", " ")


@dataclass
class LongDocSample:
    tokens: list[int]  # the whole document: context, question, answer, <eod>
    prompt_len: int  # tokens up to and including "Answer:" (what a model is given)
    question: str
    answer: str
    fact_positions: list[int]  # token offset of each needed fact, in chain order
    body_len: int  # tokens before the question (where facts live)


def _names(rng: random.Random, count: int) -> list[str]:
    names: dict[str, None] = {}  # insertion-ordered: a set's order would vary per process
    while len(names) < count:
        names["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()] = None
    return list(names)


def _chain(names: list[str], room: int) -> list[str]:
    facts = [f"{a} is inside {b}." for a, b in zip(names[:-1], names[1:])]
    return facts + [f"{names[-1]} is kept in room {room}."]


def _filler(rng: random.Random) -> str:
    return (f"The {rng.choice(_ADJ)} {rng.choice(_NOUN)} {rng.choice(_VERB)} near the "
            f"{rng.choice(_NOUN)} during the {rng.choice(_TIME)}.")


def _single_token(tok: Tokenizer) -> list[int]:
    for text in _SINGLE_TOKEN_CANDIDATES:
        ids = encode_text(tok, text)
        if len(ids) == 1:
            return ids
    raise ValueError("the tokenizer has no single-token filler among "
                     f"{_SINGLE_TOKEN_CANDIDATES}")


def generate_long_document(tok: Tokenizer, seq_len: int, seed: int, hops: int = 3,
                           distractor_chains: int = 4) -> LongDocSample:
    rng = random.Random(seed)
    names = _names(rng, hops * (1 + distractor_chains))
    rooms = rng.sample(range(100, 1000), 1 + distractor_chains)
    chains = [_chain(names[i * hops:(i + 1) * hops], rooms[i])
              for i in range(1 + distractor_chains)]
    question = f"In which room is {chains[0][0].split()[0]} kept?"
    answer = str(rooms[0])
    prompt_tail = encode_text(tok, f" Question: {question} Answer:")
    answer_ids = encode_text(tok, f" {answer}")
    body_len = seq_len - len(prompt_tail) - len(answer_ids) - 1
    needed = [encode_text(tok, " " + f) for f in chains[0]]
    distractors = [encode_text(tok, " " + f) for chain in chains[1:] for f in chain]
    free = body_len - sum(map(len, needed)) - sum(map(len, distractors))
    if free < 0:
        raise ValueError(f"seq_len={seq_len} is too short for {hops} hops and "
                         f"{distractor_chains} distractor chains")
    # filler sentences up to the free budget (topped up with single tokens), distractors
    # at random places among them
    stream: list[list[int]] = []
    used = 0
    while True:
        sentence = encode_text(tok, " " + _filler(rng))
        if used + len(sentence) > free:
            break
        stream.append(sentence)
        used += len(sentence)
    stream.append(_single_token(tok) * (free - used))
    for fact in distractors:
        stream.insert(rng.randint(0, len(stream)), fact)
    # needed fact k goes to the sentence boundary at or before a target inside part segment[k]
    # of the context; the targets keep a margin of a sentence from the parts' edges
    part = body_len / hops
    segment = rng.sample(range(hops), hops)
    targets = {k: rng.uniform((segment[k] + 0.25) * part, (segment[k] + 0.6) * part)
               for k in range(hops)}
    for k in sorted(targets, key=targets.get):
        bounds = list(accumulate(map(len, stream), initial=0))
        at = max(i for i, b in enumerate(bounds) if b <= targets[k])
        stream.insert(at, needed[k])
    positions = dict.fromkeys(range(hops), 0)
    pos = 0
    for item in stream:
        for k, fact in enumerate(needed):
            if item is fact:
                positions[k] = pos
        pos += len(item)
    body = [t for item in stream for t in item]
    tokens = body + prompt_tail + answer_ids + [EOD_ID]
    assert len(tokens) == seq_len, (len(tokens), seq_len)
    return LongDocSample(tokens, len(body) + len(prompt_tail), question, answer,
                         [positions[k] for k in range(hops)], len(body))


def check_answer(sample: LongDocSample, predicted: str) -> bool:
    """True when the first number in `predicted` is the answer."""
    match = re.search(r"\d+", predicted)
    return match is not None and match.group() == sample.answer
