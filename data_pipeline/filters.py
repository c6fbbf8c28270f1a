"""Quality filters as datatrove filters, each dropping into the ledger with its reason.

Text documents: character length, datatrove's Gopher quality rules (word count, mean word
length, symbol/word ratio, bullet and ellipsis lines, alphabetic words, stop words) and Gopher
repetition rules (duplicate lines/paragraphs, top and duplicated n-grams) with words split by
GopherWordTokenizer, and an optional classifier score. Image and video documents: caption
length and raw image geometry. Conversations (chat): only the geometry of their pictures; the
prose rules do not fit dialogue, and a conversation the chat template refuses is quarantined
when it is read.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

from datatrove.data import Document
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.pipeline.filters.gopher_quality_filter import GopherQualityFilter
from datatrove.pipeline.filters.gopher_repetition_filter import GopherRepetitionFilter
from datatrove.utils.text import PUNCTUATION
from datatrove.utils.word_tokenizers import WordTokenizer

from .config import DataConfig, ImageConfig
from .records import LedgerWriter

VISUAL = ("image", "video")
PICTURED = VISUAL + ("chat",)  # modalities whose documents may hold pictures


class GopherWordTokenizer(WordTokenizer):
    """Words as the Gopher rules define them: whitespace-separated pieces with the punctuation
    around them stripped ("(see" -> "see", "e.g.," -> "e.g"); a piece that is only
    punctuation ("-", "=>", "...") is no word. spaCy's tokenizer, datatrove's default, makes a
    word of every punctuation mark, so in technical prose (parentheses, code, paths, commas)
    the alphabetic-word ratio and mean word length fall and clean documents are filtered.
    The Gopher rules only use word_tokenize; sentences split at terminal punctuation."""

    _SENTENCE_END = re.compile(r"(?<=[.!?])\s+")

    def word_tokenize(self, text: str) -> list[str]:
        return [w for w in (piece.strip(PUNCTUATION) for piece in text.split()) if w]

    def sent_tokenize(self, text: str) -> list[str]:
        return [s for s in self._SENTENCE_END.split(text) if s.strip()]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        starts = [0] + [m.end() for m in self._SENTENCE_END.finditer(text)]
        ends = [m.start() for m in self._SENTENCE_END.finditer(text)] + [len(text)]
        return list(zip(starts, ends))


def load_hook(spec: str) -> Callable:
    """`package.module:callable` -> the callable."""
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


class ForModalities(BaseFilter):
    """Applies `inner` to documents of the given modalities and passes the others."""

    def __init__(self, inner: BaseFilter, modalities: tuple[str, ...], exclusion_writer=None):
        super().__init__(exclusion_writer)
        self.inner = inner
        self.modalities = modalities
        self.name = inner.name

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        if doc.metadata["modality"] not in self.modalities:
            return True
        return self.inner.filter(doc)


class CharLengthFilter(BaseFilter):
    name = "char length"

    def __init__(self, min_chars: int, max_chars: int, reason_prefix: str,
                 exclusion_writer=None):
        super().__init__(exclusion_writer)
        self.min_chars = min_chars
        self.max_chars = max_chars
        self.reason_prefix = reason_prefix

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        n = len(doc.text.strip())
        if n < self.min_chars:
            return False, f"{self.reason_prefix}too_short"
        if n > self.max_chars:
            return False, f"{self.reason_prefix}too_long"
        return True


class ClassifierFilter(BaseFilter):
    """Keeps documents whose score from the configured classifier reaches the minimum."""

    name = "classifier score"

    def __init__(self, scorer: str, min_score: float, exclusion_writer=None):
        super().__init__(exclusion_writer)
        self.scorer = scorer
        self.min_score = min_score
        self._fn = None

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        if self._fn is None:
            self._fn = load_hook(self.scorer)
        score = float(self._fn(doc.text))
        doc.metadata["quality_score"] = score
        return score >= self.min_score or (False, "classifier_score_below_min")


class ImageGeometryFilter(BaseFilter):
    """Raw picture size checks (on each picture's first frame, before resizing)."""

    name = "image geometry"

    def __init__(self, image: ImageConfig, exclusion_writer=None):
        super().__init__(exclusion_writer)
        self.image = image

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        for width, height in doc.metadata.get("raw_sizes", ()):  # none: a chat without images
            if min(width, height) < self.image.min_side:
                return False, "image_too_small"
            if width * height > self.image.max_raw_pixels:
                return False, "image_too_large"
            if max(width, height) / min(width, height) > self.image.max_aspect_ratio:
                return False, "image_aspect_ratio"
        return True


def quality_filters(cfg: DataConfig, output_dir: str) -> list[BaseFilter]:
    """Text, caption and image-geometry filters in the order they run, each writing its drops
    to the ledger stage filter_<name>."""
    t = cfg.text_filters

    def ledgered(stage: str, inner: BaseFilter, modalities: tuple[str, ...]) -> BaseFilter:
        return ForModalities(inner, modalities, LedgerWriter(output_dir, f"filter_{stage}"))

    steps = [
        ledgered("image_geometry", ImageGeometryFilter(cfg.image), PICTURED),
        ledgered("caption_length", CharLengthFilter(cfg.captions.min_chars,
                                                    cfg.captions.max_chars, "caption_"), VISUAL),
        ledgered("text_length", CharLengthFilter(t.min_chars, t.max_chars, "text_"), ("text",)),
    ]
    if t.gopher_quality:
        steps.append(ledgered("gopher_quality", GopherQualityFilter(
            min_doc_words=t.min_doc_words, max_doc_words=t.max_doc_words,
            min_avg_word_length=t.min_avg_word_length, max_avg_word_length=t.max_avg_word_length,
            max_symbol_word_ratio=t.max_symbol_word_ratio,
            max_bullet_lines_ratio=t.max_bullet_lines_ratio,
            max_ellipsis_lines_ratio=t.max_ellipsis_lines_ratio,
            max_non_alpha_words_ratio=t.max_non_alpha_words_ratio,
            min_stop_words=t.min_stop_words, language=GopherWordTokenizer()), ("text",)))
    if t.gopher_repetition:
        steps.append(ledgered("gopher_repetition", GopherRepetitionFilter(
            dup_line_frac=t.dup_line_frac, dup_para_frac=t.dup_para_frac,
            dup_line_char_frac=t.dup_line_char_frac, dup_para_char_frac=t.dup_para_char_frac,
            language=GopherWordTokenizer()), ("text",)))
    if t.classifier is not None:
        steps.append(ledgered("classifier", ClassifierFilter(t.classifier,
                                                             t.min_classifier_score), ("text",)))
    return steps
