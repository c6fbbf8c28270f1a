"""Typed configuration of the data pipeline (`data` group) and the context-length stages (`stage`
group). configs/data/*.yaml and configs/stage/*.yaml mirror these dataclasses field by field.

Every `validate(path)` raises model.config.ConfigError naming the field path, the value and what
would be valid, before any file is read or process started.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.config import VisionConfig
from model.errors import ConfigError

SAMPLE_DIR = Path(__file__).resolve().parent / "sample"
BUNDLED = "bundled://"

MODALITY_FORMATS = {
    "text": ("jsonl", "parquet"),
    "image": ("webdataset", "image_folder", "image_text"),
    "video": ("frame_folder", "video_files"),
    "chat": ("jsonl",),
}
EXECUTORS = ("local", "slurm")
CHAT_OVERFLOW = ("truncate", "drop")


def resolve_path(path: str) -> str:
    """`bundled://x` -> the bundled sample's folder x; other paths unchanged."""
    return str(SAMPLE_DIR / path[len(BUNDLED):]) if path.startswith(BUNDLED) else path


def _fail(path: str, value, valid: str) -> None:
    raise ConfigError(f"{path}={value!r} is invalid: {valid}")


def _positive(path: str, value) -> None:
    if not value > 0:
        _fail(path, value, "must be > 0")


def _fraction(path: str, value) -> None:
    if not 0 <= value <= 1:
        _fail(path, value, "must be in [0, 1]")


def _hook(path: str, value: str | None) -> None:
    if value is not None and value.count(":") != 1:
        _fail(path, value, "must be 'package.module:callable' or null")


@dataclass
class SourceConfig:
    """One raw input: files in one format (sources.py: a file, a folder or a glob pattern).
    `bundled://x` is data_pipeline/sample/x."""

    name: str = "web"
    modality: str = "text"  # text | image | video | chat (conversations for fine-tuning)
    format: str = "jsonl"  # see MODALITY_FORMATS
    path: str = "bundled://text/web"
    glob: str | None = None  # file pattern inside a folder `path`; null: the format's default
    text_key: str | None = None  # field holding the text; null: "text" ("caption": image_text)
    image_key: str = "image"  # image_text: field holding the image path
    id_key: str = "id"  # the record's own id field (named in the ledger)
    weight: float | None = None  # mixture weight; null: proportional to the source's rows
    rephrase: bool = False  # route the kept documents through the rephrasing hook

    def validate(self, path: str) -> None:
        if not self.name or "/" in self.name:
            _fail(f"{path}.name", self.name, "must be a non-empty name without '/'")
        if self.modality not in MODALITY_FORMATS:
            _fail(f"{path}.modality", self.modality, f"must be one of {sorted(MODALITY_FORMATS)}")
        if self.format not in MODALITY_FORMATS[self.modality]:
            _fail(f"{path}.format", self.format,
                  f"must be one of {list(MODALITY_FORMATS[self.modality])} for modality "
                  f"{self.modality!r}")
        if not self.path:
            _fail(f"{path}.path", self.path, "must name a file, a folder or a glob pattern")
        if self.weight is not None and not self.weight > 0:
            _fail(f"{path}.weight", self.weight, "must be > 0 or null")
        if self.rephrase and self.modality != "text":
            _fail(f"{path}.rephrase", self.rephrase, "only text sources can be rephrased")


@dataclass
class TextFilterConfig:
    """Length, Gopher quality and repetition rules (datatrove's), and a classifier-score hook."""

    min_chars: int = 200
    max_chars: int = 200_000
    gopher_quality: bool = True
    min_doc_words: int = 50
    max_doc_words: int = 100_000
    min_avg_word_length: int = 3
    max_avg_word_length: int = 10
    max_symbol_word_ratio: float = 0.1
    max_bullet_lines_ratio: float = 0.9
    max_ellipsis_lines_ratio: float = 0.3
    max_non_alpha_words_ratio: float = 0.8  # datatrove's name; it is a minimum alphabetic ratio
    min_stop_words: int = 2
    gopher_repetition: bool = True
    dup_line_frac: float = 0.3
    dup_para_frac: float = 0.3
    dup_line_char_frac: float = 0.2
    dup_para_char_frac: float = 0.2
    classifier: str | None = None  # "module:callable", (text) -> score; null: no classifier
    min_classifier_score: float = 0.5

    def validate(self, path: str) -> None:
        for name in ("min_chars", "max_chars", "min_doc_words", "max_doc_words",
                     "min_avg_word_length", "max_avg_word_length"):
            _positive(f"{path}.{name}", getattr(self, name))
        if self.min_chars > self.max_chars:
            _fail(f"{path}.min_chars", self.min_chars, f"must be <= max_chars={self.max_chars}")
        for name in ("max_symbol_word_ratio", "max_bullet_lines_ratio", "max_ellipsis_lines_ratio",
                     "max_non_alpha_words_ratio", "dup_line_frac", "dup_para_frac",
                     "dup_line_char_frac", "dup_para_char_frac"):
            _fraction(f"{path}.{name}", getattr(self, name))
        if self.min_stop_words < 0:
            _fail(f"{path}.min_stop_words", self.min_stop_words, "must be >= 0")
        _hook(f"{path}.classifier", self.classifier)


@dataclass
class CaptionFilterConfig:
    """Length bounds for the text of image and video documents."""

    min_chars: int = 3
    max_chars: int = 2000

    def validate(self, path: str) -> None:
        _positive(f"{path}.min_chars", self.min_chars)
        if self.min_chars > self.max_chars:
            _fail(f"{path}.min_chars", self.min_chars, f"must be <= max_chars={self.max_chars}")


@dataclass
class ImageConfig:
    """Image filters (on the raw picture) and the resize onto the encoder's patch grid."""

    min_side: int = 28  # px; smaller raw images are filtered
    max_raw_pixels: int = 50_000_000  # larger raw images are filtered (decompression bombs)
    max_aspect_ratio: float = 4.0
    max_pixels: int = 112 * 112  # pixel budget after resizing (sets the placeholder count)
    patch_size: int = 14  # model.vision.patch_size
    merge_size: int = 2  # model.vision.merge_size
    frames_per_chunk: int = 4  # model.vision.time_table_size
    max_frames: int = 8  # frames sampled uniformly from a video

    @property
    def unit(self) -> int:
        """Side lengths are multiples of this so that the 2x2 merge tiles the patch grid."""
        return self.patch_size * self.merge_size

    @property
    def vision(self) -> VisionConfig:
        """The encoder settings that size a picture's placeholders and patches."""
        return VisionConfig(patch_size=self.patch_size, merge_size=self.merge_size,
                            time_table_size=self.frames_per_chunk)

    def validate(self, path: str) -> None:
        for name in ("min_side", "max_raw_pixels", "patch_size", "merge_size", "frames_per_chunk",
                     "max_frames"):
            _positive(f"{path}.{name}", getattr(self, name))
        if not self.max_aspect_ratio >= 1:
            _fail(f"{path}.max_aspect_ratio", self.max_aspect_ratio, "must be >= 1")
        if self.max_pixels < self.unit**2:
            _fail(f"{path}.max_pixels", self.max_pixels,
                  f"must be >= (patch_size*merge_size)^2 = {self.unit**2}")


@dataclass
class DedupConfig:
    """Exact (normalised-text hash), near (MinHash-LSH, verified Jaccard) and perceptual dedup."""

    exact: bool = True
    near: bool = True
    ngram: int = 5  # word n-gram shingles
    bands: int = 20  # LSH bands; a pair at Jaccard 0.8 becomes a candidate with p = 0.998
    rows_per_band: int = 6  # num_perm = bands * rows_per_band
    jaccard_threshold: float = 0.8  # candidates at or above this exact Jaccard are duplicates
    seed: int = 1
    images: bool = True  # perceptual hash dedup of images and video frames
    phash_max_distance: int = 6  # of 64 bits
    color_max_difference: int = 24  # largest per-cell mean colour difference (0..255)

    @property
    def num_perm(self) -> int:
        return self.bands * self.rows_per_band

    def validate(self, path: str) -> None:
        for name in ("ngram", "bands", "rows_per_band"):
            _positive(f"{path}.{name}", getattr(self, name))
        if not 0 < self.jaccard_threshold <= 1:
            _fail(f"{path}.jaccard_threshold", self.jaccard_threshold, "must be in (0, 1]")
        if not 0 <= self.phash_max_distance < 64:
            _fail(f"{path}.phash_max_distance", self.phash_max_distance, "must be in [0, 64)")
        if not 0 <= self.color_max_difference <= 255:
            _fail(f"{path}.color_max_difference", self.color_max_difference,
                  "must be in [0, 255]")


@dataclass
class RephraseConfig:
    """LLM rewriting of knowledge text. The rewriter is `module:callable`, (text, doc_id) ->
    list of rewritten texts; the default is off."""

    enabled: bool = False
    rewriter: str | None = None
    keep_original: bool = True

    def validate(self, path: str) -> None:
        _hook(f"{path}.rewriter", self.rewriter)
        if self.enabled and self.rewriter is None:
            _fail(f"{path}.rewriter", self.rewriter, "must be set when rephrase.enabled is true")


@dataclass
class TokenizerConfig:
    """Byte-level BPE trained on the kept corpus, or a tokenizer.json loaded from `path`."""

    path: str | None = None
    vocab_size: int = 2048
    min_frequency: int = 2

    def validate(self, path: str) -> None:
        from .tokenizer import RESERVED_TOKENS

        if self.vocab_size < 256 + len(RESERVED_TOKENS):
            _fail(f"{path}.vocab_size", self.vocab_size,
                  f"must be >= {256 + len(RESERVED_TOKENS)} (bytes + special tokens)")
        _positive(f"{path}.min_frequency", self.min_frequency)


@dataclass
class PackConfig:
    """Rows of `seq_len` tokens holding whole documents (longer text documents are split)."""

    seq_len: int = 512
    max_docs_per_row: int = 64  # document slots per row, padding included (fixes cu_seqlens)

    def validate(self, path: str) -> None:
        _positive(f"{path}.seq_len", self.seq_len)
        if self.max_docs_per_row < 2:
            _fail(f"{path}.max_docs_per_row", self.max_docs_per_row,
                  "must be >= 2 (a document and the padding slot)")


@dataclass
class LongDocConfig:
    """Synthetic long documents: facts spread over the context, a multi-hop question at the end.
    Each document is exactly the pack (stage) sequence length."""

    num_docs: int = 0
    hops: int = 3  # facts the answer needs
    distractor_chains: int = 4  # other fact chains of the same shape
    weight: float | None = None  # mixture weight of the synthetic source; null: by rows
    seed: int = 0

    def validate(self, path: str) -> None:
        if self.num_docs < 0:
            _fail(f"{path}.num_docs", self.num_docs, "must be >= 0")
        if self.hops < 2:
            _fail(f"{path}.hops", self.hops, "must be >= 2 (the answer combines several facts)")
        if self.distractor_chains < 0:
            _fail(f"{path}.distractor_chains", self.distractor_chains, "must be >= 0")
        if self.weight is not None and not self.weight > 0:
            _fail(f"{path}.weight", self.weight, "must be > 0 or null")


@dataclass
class ExecutorConfig:
    """Where the datatrove stages run: in this process / a local pool, or as Slurm job arrays."""

    kind: str = "local"  # local | slurm
    tasks: int = 2  # shards of the parallel stages
    workers: int = 1  # local: processes running tasks at once; slurm: array concurrency (-1 all)
    start_method: str = "forkserver"  # local worker processes: forkserver | fork | spawn
    partition: str = "debug"
    time: str = "01:00:00"
    cpus_per_task: int = 1
    mem_per_cpu_gb: int = 2
    venv_path: str | None = None  # slurm: the venv's bin/activate
    sbatch_args: dict[str, str] = field(default_factory=dict)
    job_name: str = "k3-data"

    def validate(self, path: str) -> None:
        if self.kind not in EXECUTORS:
            _fail(f"{path}.kind", self.kind, f"must be one of {list(EXECUTORS)}")
        _positive(f"{path}.tasks", self.tasks)
        if self.workers == 0 or self.workers < -1:
            _fail(f"{path}.workers", self.workers, "must be >= 1, or -1 for all tasks at once")
        if self.start_method not in ("forkserver", "fork", "spawn"):
            _fail(f"{path}.start_method", self.start_method,
                  "must be one of ['fork', 'forkserver', 'spawn']")
        _positive(f"{path}.cpus_per_task", self.cpus_per_task)
        _positive(f"{path}.mem_per_cpu_gb", self.mem_per_cpu_gb)


def _sample_sources() -> list[SourceConfig]:
    return [
        SourceConfig("web", "text", "jsonl", "bundled://text/web"),
        SourceConfig("knowledge", "text", "parquet", "bundled://text/knowledge", rephrase=True),
        SourceConfig("shapes", "image", "webdataset", "bundled://images/wds"),
        SourceConfig("shapes_folder", "image", "image_folder", "bundled://images/folder"),
        SourceConfig("motion", "video", "frame_folder", "bundled://video/frames"),
        SourceConfig("motion_gif", "video", "video_files", "bundled://video/gif"),
    ]


@dataclass
class DataConfig:
    """The whole curation run. The defaults are the bundled sample (configs/data/sample.yaml)."""

    name: str = "sample"
    sources: list[SourceConfig] = field(default_factory=_sample_sources)
    output_dir: str = "outputs/data/sample"
    resume: bool = False  # keep finished datatrove tasks of an interrupted run
    overwrite: bool = False  # k3-data: replace a non-empty output_dir (once the new one is done)
    use_prepared: bool = False  # k3-train: the dataset in output_dir whatever sources made it
    progress: bool = True  # progress bars
    verbose: bool = False  # datatrove's and megatron's INFO logs
    text_filters: TextFilterConfig = field(default_factory=TextFilterConfig)
    captions: CaptionFilterConfig = field(default_factory=CaptionFilterConfig)
    image: ImageConfig = field(default_factory=ImageConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    rephrase: RephraseConfig = field(default_factory=RephraseConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    pack: PackConfig = field(default_factory=PackConfig)
    long_docs: LongDocConfig = field(default_factory=lambda: LongDocConfig(num_docs=8))
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    validation_fraction: float = 0.05  # documents held out (by content hash) for validation
    # chat sources: the template (a Jinja file or a tokenizer_config.json; null: the K3
    # default) and what becomes of a conversation longer than the row (truncate | drop)
    chat_template: str | None = None
    chat_overflow: str = "truncate"

    def check_sources_exist(self, path: str = "data") -> None:
        """Every source path is there and readable (checked before a run reads anything)."""
        from .sources import list_source_files

        for i, source in enumerate(self.sources):
            list_source_files(resolve_path(source.path), source.format, source.glob,
                              f"{path}.sources[{i}].path")

    def validate(self, path: str = "data") -> DataConfig:
        if not self.sources:
            _fail(f"{path}.sources", self.sources, "must list at least one source")
        names = [s.name for s in self.sources]
        for i, source in enumerate(self.sources):
            source.validate(f"{path}.sources[{i}]")
            if source.name in names[:i]:
                _fail(f"{path}.sources[{i}].name", source.name, "must be unique among sources")
        if not self.output_dir:
            _fail(f"{path}.output_dir", self.output_dir, "must name a folder")
        self.text_filters.validate(f"{path}.text_filters")
        self.captions.validate(f"{path}.captions")
        self.image.validate(f"{path}.image")
        self.dedup.validate(f"{path}.dedup")
        self.rephrase.validate(f"{path}.rephrase")
        self.tokenizer.validate(f"{path}.tokenizer")
        _fraction(f"{path}.validation_fraction", self.validation_fraction)
        if self.chat_overflow not in CHAT_OVERFLOW:
            _fail(f"{path}.chat_overflow", self.chat_overflow,
                  f"must be one of {list(CHAT_OVERFLOW)}")
        self.pack.validate(f"{path}.pack")
        self.long_docs.validate(f"{path}.long_docs")
        self.executor.validate(f"{path}.executor")
        return self


@dataclass
class StageConfig:
    """A context-length stage: the loader's row length and batch, and its synthetic long
    documents. Full model: 8K, 64K, 256K, 1M; the tiny stages are their scaled-down equivalents."""

    name: str = "tiny"
    seq_len: int = 512
    micro_batch_size: int = 8  # rows per data-parallel rank per forward
    global_batch_size: int = 8  # rows per optimizer step over all ranks
    max_docs_per_row: int = 64  # document slots per row (cu_seqlens has B * this + 1 entries)
    num_workers: int = 0  # loader worker processes
    seed: int = 1234  # data order
    # token: the loss is the mean over the global batch's loss tokens (pre-training's, and
    # SFT's usual choice); sequence: each document's (conversation's) mean, averaged over the
    # documents with a loss token
    loss_normalization: str = "token"
    long_docs: LongDocConfig = field(default_factory=lambda: LongDocConfig(num_docs=8))

    def validate(self, path: str = "stage") -> StageConfig:
        for name in ("seq_len", "micro_batch_size", "global_batch_size"):
            _positive(f"{path}.{name}", getattr(self, name))
        if self.global_batch_size % self.micro_batch_size:
            _fail(f"{path}.global_batch_size", self.global_batch_size,
                  f"must be a multiple of micro_batch_size={self.micro_batch_size}")
        if self.max_docs_per_row < 2:
            _fail(f"{path}.max_docs_per_row", self.max_docs_per_row,
                  "must be >= 2 (a document and the padding slot)")
        if self.num_workers < 0:
            _fail(f"{path}.num_workers", self.num_workers, "must be >= 0")
        if self.loss_normalization not in ("token", "sequence"):
            _fail(f"{path}.loss_normalization", self.loss_normalization,
                  "must be one of ['sequence', 'token']")
        self.long_docs.validate(f"{path}.long_docs")
        return self


def from_dict(cls: type, data: Any, path: str):
    """Builds dataclass `cls` from a plain (e.g. OmegaConf container) dict; unknown keys are
    ConfigErrors. Used when a caller hands in a DictConfig instead of the dataclass."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        _fail(path, data, f"must be a mapping for {cls.__name__}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in known:
            _fail(f"{path}.{key}", value, f"is not a field of {cls.__name__}: {sorted(known)}")
        kwargs[key] = _convert(known[key], value, f"{path}.{key}")
    return cls(**kwargs)


def _convert(f: dataclasses.Field, value: Any, path: str):
    """Nested config dataclasses (and lists of them) from dicts, by the field's annotation."""
    nested = {c.__name__: c for c in (SourceConfig, TextFilterConfig, CaptionFilterConfig,
                                      ImageConfig, DedupConfig, RephraseConfig, TokenizerConfig,
                                      PackConfig, LongDocConfig, ExecutorConfig)}
    annotation = str(f.type)
    if value is None:
        return value
    if annotation.startswith("list[") and annotation[5:-1] in nested:
        if not isinstance(value, list):
            _fail(path, value, f"must be a list of {annotation[5:-1]}")
        return [from_dict(nested[annotation[5:-1]], v, f"{path}[{i}]")
                for i, v in enumerate(value)]
    if annotation in nested:
        return from_dict(nested[annotation], value, path)
    return value


def as_data_config(cfg: Any) -> DataConfig:
    """A validated DataConfig from a DataConfig, a DictConfig or a plain dict."""
    if not isinstance(cfg, DataConfig):
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
        cfg = from_dict(DataConfig, cfg, "data")
    return cfg.validate()
