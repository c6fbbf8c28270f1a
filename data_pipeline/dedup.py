"""Deduplication: exact (normalised-text hash), near (MinHash-LSH candidates, verified by exact
Jaccard of word n-gram shingles) and perceptual (images and video frames).

This module holds the hashing, the plain in-memory reference (`find_duplicates` with every
signature in one process) and DropDuplicates (every task of the tokenize stage: drops the
listed duplicates into the ledger). dedup_stages.py runs the same decisions at scale through
datatrove's sharded MinHash stages. Of each group of duplicates the copy with the smallest
`order` key (source, file, record index) is kept, so the result does not depend on the number
of tasks.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash
from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from tqdm import tqdm

from .config import DedupConfig
from .imaging import COLOR_VALUES
from .records import LedgerWriter

# A conversation is deduplicated as text, on its canonical text (conversations.chat_text).
MODALITY_CODES = {"text": 0, "chat": 0, "image": 1, "video": 2}
_WORD = re.compile(r"\w+")
# odd multipliers that mix the word hashes of an n-gram into one value
_NGRAM_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                       0xD6E8FEB86659FD93, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53,
                       0x2545F4914F6CDD1D, 0x94D049BB133111EB], dtype=np.uint64)


def normalize_text(text: str) -> str:
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def exact_hash(text: str) -> int:
    return xxhash.xxh64_intdigest(normalize_text(text).encode())


def words(text: str) -> list[str]:
    return _WORD.findall(unicodedata.normalize("NFKC", text).casefold())


def word_shingles(text: str, n: int) -> np.ndarray:
    """Sorted unique 32-bit hashes of the word n-grams (the whole text when shorter than n)."""
    if n > len(_NGRAM_MIX):
        raise ValueError(f"ngram={n} > {len(_NGRAM_MIX)}")
    w = np.fromiter((xxhash.xxh64_intdigest(x.encode()) for x in words(text)),
                    dtype=np.uint64)
    if len(w) == 0:
        return np.zeros(0, dtype=np.uint32)
    k = min(n, len(w))
    mixed = np.zeros(len(w) - k + 1, dtype=np.uint64)
    for i in range(k):
        mixed += w[i:len(w) - k + 1 + i] * _NGRAM_MIX[i]
    return np.unique((mixed >> np.uint64(32)).astype(np.uint32))


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard similarity of two sorted unique arrays."""
    if len(a) == 0 and len(b) == 0:
        return 1.0
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / (len(a) + len(b) - inter)


class MinHasher:
    """num_perm hash permutations of 64-bit space: x XOR seed_j through the splitmix64
    finaliser (a bijection with full avalanche; a linear a*x+b of small shingles would be
    nearly monotone and make every permutation pick the same minimum)."""

    def __init__(self, num_perm: int, seed: int):
        rng = np.random.default_rng(seed)
        self.seeds = rng.integers(0, np.iinfo(np.uint64).max, size=num_perm, dtype=np.uint64,
                                  endpoint=True)

    @staticmethod
    def mix(z: np.ndarray) -> np.ndarray:
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    def signature(self, shingles: np.ndarray, block: int = 4096) -> np.ndarray:
        sig = np.full(len(self.seeds), np.iinfo(np.uint64).max, dtype=np.uint64)
        x = shingles.astype(np.uint64)
        for i in range(0, len(x), block):
            h = self.mix(x[i:i + block, None] ^ self.seeds[None, :])
            np.minimum(sig, h.min(axis=0), out=sig)
        return sig


def _groups(keys: np.ndarray, members: np.ndarray) -> list[np.ndarray]:
    """Members sharing a key, for every key held by two or more members."""
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    ends = np.r_[starts[1:], len(k)]
    return [members[order[s:e]] for s, e in zip(starts, ends) if e - s > 1]


def _band_keys(sig: np.ndarray, bands: int, rows: int) -> list[np.ndarray]:
    keys = []
    for b in range(bands):
        block = sig[:, b * rows:(b + 1) * rows]
        key = np.zeros(len(sig), dtype=np.uint64)
        for j in range(rows):
            key = key * np.uint64(0x100000001B3) + block[:, j]
        keys.append(key)
    return keys


def _phash_band_keys(phash: np.ndarray, max_distance: int) -> list[np.ndarray]:
    """max_distance + 1 disjoint bit bands: two hashes within max_distance bits share one
    (pigeonhole), so banding misses no pair."""
    n = max_distance + 1
    edges = [round(i * 64 / n) for i in range(n + 1)]
    keys = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        mask = np.uint64((1 << (hi - lo)) - 1)
        keys.append(((phash >> np.uint64(lo)) & mask) + np.uint64(lo << 56))
    return keys


def hamming(a: int, b: int) -> int:
    return (int(a) ^ int(b)).bit_count()


class UnionFind:
    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        root = i
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[i] != root:
            self.parent[i], i = root, self.parent[i]
        return root

    def union(self, i: int, j: int) -> None:
        ri, rj = self.find(i), self.find(j)
        if ri != rj:
            self.parent[max(ri, rj)] = min(ri, rj)


@dataclass
class Signatures:
    """Signatures of a set of documents, indexed 0..n-1 (concatenated over tasks)."""

    ids: np.ndarray  # str
    order: np.ndarray  # str, the keep-first sort key
    modality: np.ndarray  # int8, MODALITY_CODES
    exact: np.ndarray  # uint64 normalised-text hash (text)
    minhash: np.ndarray  # uint64 [n, num_perm] (text; zeros otherwise)
    shingles: np.ndarray  # uint32, concatenated
    shingle_offsets: np.ndarray  # int64 [n + 1]
    phash: np.ndarray  # uint64 per frame, concatenated (images and videos)
    colors: np.ndarray  # uint8 [frames, COLOR_VALUES]
    frame_offsets: np.ndarray  # int64 [n + 1]

    def shingles_of(self, i: int) -> np.ndarray:
        return self.shingles[self.shingle_offsets[i]:self.shingle_offsets[i + 1]]

    def frames_of(self, i: int) -> slice:
        return slice(self.frame_offsets[i], self.frame_offsets[i + 1])

    @classmethod
    def concat(cls, parts: list[Signatures], num_perm: int) -> Signatures:
        def offsets(name: str) -> np.ndarray:
            lengths = np.concatenate([np.diff(getattr(p, name)) for p in parts] or [[]])
            return np.r_[0, np.cumsum(lengths)].astype(np.int64)

        def cat(name: str, empty) -> np.ndarray:
            arrays = [getattr(p, name) for p in parts]
            return np.concatenate(arrays) if arrays else empty

        return cls(cat("ids", np.zeros(0, str)), cat("order", np.zeros(0, str)),
                   cat("modality", np.zeros(0, np.int8)), cat("exact", np.zeros(0, np.uint64)),
                   cat("minhash", np.zeros((0, num_perm), np.uint64)),
                   cat("shingles", np.zeros(0, np.uint32)),
                   offsets("shingle_offsets"),
                   cat("phash", np.zeros(0, np.uint64)),
                   cat("colors", np.zeros((0, COLOR_VALUES), np.uint8)),
                   offsets("frame_offsets"))


@dataclass
class Duplicate:
    index: int
    reason: str  # exact_duplicate | near_duplicate | image_duplicate | video_duplicate
    keeper: int
    similarity: float


def _cluster(candidates: list[np.ndarray], pos: np.ndarray, same, n: int) -> dict[int, int]:
    """Union of the candidate pairs that `same` confirms; returns member -> keeper (the member
    with the smallest `pos`) for every member of a component that is not its keeper."""
    uf = UnionFind(n)
    touched: set[int] = set()
    for group in candidates:
        group = [int(k) for k in group]
        touched.update(group)
        for a, i in enumerate(group):
            for j in group[a + 1:]:
                if uf.find(i) != uf.find(j) and same(i, j):
                    uf.union(i, j)
    components: dict[int, list[int]] = {}
    for i in touched:
        components.setdefault(uf.find(i), []).append(i)
    keeper: dict[int, int] = {}
    for members in components.values():
        members.sort(key=lambda k: pos[k])
        keeper.update({k: members[0] for k in members[1:]})
    return keeper


def positions(sig: Signatures) -> np.ndarray:
    """Each document's rank in `order` (the keep-first order)."""
    pos = np.empty(len(sig.ids), dtype=np.int64)
    pos[np.argsort(sig.order, kind="stable")] = np.arange(len(sig.ids))
    return pos


NearDuplicates = Callable[[Signatures, np.ndarray, np.ndarray], list[Duplicate]]


def near_duplicates_in_memory(cfg: DedupConfig, progress: bool = False) -> NearDuplicates:
    """The plain reference for near duplicates: LSH bands over every MinHash signature in
    memory, candidates verified by exact Jaccard, components kept by their first copy."""
    def near(sig: Signatures, pos: np.ndarray, alive: np.ndarray) -> list[Duplicate]:
        candidates = [g for keys in _band_keys(sig.minhash[alive], cfg.bands, cfg.rows_per_band)
                      for g in _groups(keys, alive)]

        def similar(i: int, j: int) -> bool:
            return jaccard(sig.shingles_of(i), sig.shingles_of(j)) >= cfg.jaccard_threshold

        return [Duplicate(k, "near_duplicate", keep,
                          jaccard(sig.shingles_of(k), sig.shingles_of(keep)))
                for k, keep in _cluster(tqdm(candidates, desc="near-dup candidates",
                                             disable=not progress), pos, similar,
                                        len(sig.ids)).items()]
    return near


def find_duplicates(sig: Signatures, cfg: DedupConfig, progress: bool = False,
                    near: NearDuplicates | None = None) -> list[Duplicate]:
    """Exact, near and perceptual duplicates, in keep-first order. `near` finds the near
    duplicates among the text documents that are no exact duplicate (`alive`); the default is
    the in-memory reference, the pipeline passes the sharded datatrove stages
    (dedup_stages.near_duplicates_from_clusters)."""
    pos = positions(sig)
    dups: list[Duplicate] = []
    text = np.flatnonzero(sig.modality == MODALITY_CODES["text"])
    if cfg.exact and len(text):
        for group in _groups(sig.exact[text], text):
            keep = min(group, key=lambda k: pos[k])
            dups += [Duplicate(int(k), "exact_duplicate", int(keep), 1.0)
                     for k in group if k != keep]
    if cfg.near and len(text):
        gone = {d.index for d in dups}
        alive = np.array([i for i in text if i not in gone], dtype=np.int64)
        dups += (near or near_duplicates_in_memory(cfg, progress))(sig, pos, alive)
    if cfg.images:
        for name in ("image", "video"):
            dups += _visual_duplicates(sig, cfg, pos, MODALITY_CODES[name], f"{name}_duplicate")
    return sorted(dups, key=lambda d: pos[d.index])


def _visual_duplicates(sig: Signatures, cfg: DedupConfig, pos: np.ndarray, code: int,
                       reason: str) -> list[Duplicate]:
    docs = np.flatnonzero(sig.modality == code)
    if len(docs) == 0:
        return []
    first = sig.phash[sig.frame_offsets[docs]]
    candidates = [g for keys in _phash_band_keys(first, cfg.phash_max_distance)
                  for g in _groups(keys, docs)]

    def distance(i: int, j: int) -> tuple[int, int] | None:
        fi, fj = sig.frames_of(i), sig.frames_of(j)
        if fi.stop - fi.start != fj.stop - fj.start:
            return None
        bits = max(hamming(a, b) for a, b in zip(sig.phash[fi], sig.phash[fj]))
        color = int(np.abs(sig.colors[fi].astype(np.int16) - sig.colors[fj]).max())
        return bits, color

    def same(i: int, j: int) -> bool:
        d = distance(i, j)
        return d is not None and d[0] <= cfg.phash_max_distance and \
            d[1] <= cfg.color_max_difference

    out = []
    for k, keep in _cluster(candidates, pos, same, len(sig.ids)).items():
        d = distance(k, keep)
        out.append(Duplicate(k, reason, keep, 1.0 - d[0] / 64 if d else 0.0))
    return out


def duplicates_path(work_dir: str) -> Path:
    return Path(work_dir) / "duplicates.jsonl"


def write_duplicates(work_dir: str, sig: Signatures, dups: list[Duplicate]) -> None:
    path = duplicates_path(work_dir)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for d in dups:
            f.write(json.dumps({"id": str(sig.ids[d.index]), "reason": d.reason,
                                "of": str(sig.ids[d.keeper]),
                                "similarity": round(d.similarity, 4)}) + "\n")
    tmp.replace(path)


def load_duplicates(work_dir: str) -> dict[str, dict]:
    with open(duplicates_path(work_dir), encoding="utf-8") as f:
        return {rec["id"]: rec for rec in map(json.loads, f)}


class DropDuplicates(PipelineStep):
    """Drops the documents DedupStep marked, each into the ledger as a duplicate."""

    name = "drop duplicates"
    type = "DEDUP"

    def __init__(self, output_dir: str, work_dir: str):
        super().__init__()
        self.output_dir = output_dir
        self.work_dir = work_dir

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        dups = load_duplicates(self.work_dir)
        with LedgerWriter(self.output_dir, "dedup", outcome="duplicate") as ledger:
            for doc in data:
                rec = dups.get(doc.id)
                if rec is None:
                    yield doc
                    continue
                doc.metadata.update(k3_reason=rec["reason"],
                                    k3_detail=f"of {rec['of']} (similarity {rec['similarity']})")
                ledger.write(doc, rank)
                self.stat_update(rec["reason"])
