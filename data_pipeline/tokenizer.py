"""The tokenizer: byte-level BPE (HF `tokenizers`) with fixed special-token ids.

Ids 0..4 are fixed so that k3_tiny's pad_token_id=0 and image_token_id=3 hold for every
tokenizer this module trains or accepts:
    <pad>=0   padding (no loss, no Quantile Balancing)
    <eod>=1   ends every document
    <bos>=2   reserved for formats that mark a start; pre-training documents do not use it
    <image>=3 one placeholder per merged vision token, for images and videos alike (the model
              writes the projected vision tokens over them)
    <video>=4 a text marker placed before a video's placeholders
Ids 5..14 are the chat tokens of Kimi K2's template (data_pipeline.chat), reserved by every
tokenizer trained here; a tokenizer trained before them still loads, but cannot encode chats:
    <|im_system|>=5  <|im_user|>=6  <|im_assistant|>=7  <|im_middle|>=8  <|im_end|>=9
    <|tool_calls_section_begin|>=10  <|tool_calls_section_end|>=11
    <|tool_call_begin|>=12  <|tool_call_argument_begin|>=13  <|tool_call_end|>=14
Special-token strings inside raw text are tokenized as plain text, never as specials.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from model.errors import ConfigError

SPECIAL_TOKENS = ("<pad>", "<eod>", "<bos>", "<image>", "<video>")
PAD_ID, EOD_ID, BOS_ID, IMAGE_ID, VIDEO_ID = range(len(SPECIAL_TOKENS))
CHAT_SPECIAL_TOKENS = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
                       "<|im_end|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                       "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
RESERVED_TOKENS = SPECIAL_TOKENS + CHAT_SPECIAL_TOKENS  # at ids 0.. in this order


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
                                  special_tokens=list(RESERVED_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=progress)
    tok.train_from_iterator(texts, trainer, length=length)
    check_special_tokens(tok, "tokenizer")
    check_chat_special_tokens(tok, "tokenizer", CHAT_SPECIAL_TOKENS)
    return _finish(tok)


def load_tokenizer(path: str | Path) -> Tokenizer:
    tok = Tokenizer.from_file(str(path))
    check_special_tokens(tok, f"tokenizer {path}")
    return _finish(tok)


def check_special_tokens(tok: Tokenizer, what: str) -> None:
    """Ids 0..4, which every tokenizer needs (the chat tokens are checked where chats are
    encoded, so that tokenizers trained before them still load)."""
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        got = tok.token_to_id(token)
        if got != expected_id:
            raise ConfigError(f"{what}: special token {token} has id {got}, the model needs "
                              f"{expected_id} (fixed ids: {list(SPECIAL_TOKENS)})")


def check_chat_special_tokens(tok: Tokenizer, what: str, tokens: Iterable[str]) -> None:
    """`tokens` (of RESERVED_TOKENS) must be special tokens of `tok` at their fixed ids."""
    specials = {i: t.content for i, t in tok.get_added_tokens_decoder().items() if t.special}
    wrong = [t for t in tokens if specials.get(RESERVED_TOKENS.index(t)) != t]
    if wrong:
        raise ConfigError(
            f"{what} lacks the chat special tokens {wrong} at their fixed ids (fixed ids: "
            f"{dict(zip(RESERVED_TOKENS, range(len(RESERVED_TOKENS))))}): retrain it with k3-data")


def encode_text(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids
