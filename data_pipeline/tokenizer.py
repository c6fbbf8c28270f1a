"""The tokenizer: byte-level BPE (HF `tokenizers`) with fixed special-token ids.

Ids 0..4 are fixed so that k3_tiny's pad_token_id=0 and image_token_id=3 hold for every
tokenizer this module trains or accepts:
    <pad>=0   padding (no loss, no Quantile Balancing)
    <eod>=1   ends every document
    <bos>=2   reserved for formats that mark a start; pre-training documents do not use it
    <image>=3 one placeholder per merged vision token, for images and videos alike (the model
              writes the projected vision tokens over them)
    <video>=4 a text marker placed before a video's placeholders
Special-token strings inside raw text are tokenized as plain text, never as specials.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from model.errors import ConfigError

SPECIAL_TOKENS = ("<pad>", "<eod>", "<bos>", "<image>", "<video>")
PAD_ID, EOD_ID, BOS_ID, IMAGE_ID, VIDEO_ID = range(len(SPECIAL_TOKENS))


def _finish(tok: Tokenizer) -> Tokenizer:
    tok.encode_special_tokens = True  # "<image>" typed in a web page stays text
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
                    progress: bool = False, length: int | None = None) -> Tokenizer:
    """Byte-level BPE on `texts` (deterministic for the same texts in the same order)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=progress)
    tok.train_from_iterator(texts, trainer, length=length)
    check_special_tokens(tok, "tokenizer")
    return _finish(tok)


def load_tokenizer(path: str | Path) -> Tokenizer:
    tok = Tokenizer.from_file(str(path))
    check_special_tokens(tok, f"tokenizer {path}")
    return _finish(tok)


def check_special_tokens(tok: Tokenizer, what: str) -> None:
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        got = tok.token_to_id(token)
        if got != expected_id:
            raise ConfigError(f"{what}: special token {token} has id {got}, the model needs "
                              f"{expected_id} (fixed ids: {list(SPECIAL_TOKENS)})")


def encode_text(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids
