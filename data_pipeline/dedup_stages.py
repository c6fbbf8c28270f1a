"""Deduplication at scale, as pipeline steps around datatrove's sharded MinHash stages, so that no
task holds every MinHash signature or shingle set:

    curate   (tasks)  SignatureStep: per task, <work>/signatures/<rank>.npz (ids, order, exact
                      hash, perceptual hashes), the text documents' shingles and exact hashes
                      (<work>/text/<rank>.*.npy) and their MinHash signatures as datatrove's
                      bucket files (<work>/minhash/sigs/bucket_XXX/<rank>.minhash.sig, sorted
                      and verified by datatrove's MinhashDedupSignature)
    buckets  (bands)  datatrove's MinhashDedupBuckets: one task per LSH band finds the
                      documents with equal band signatures; VerifyCandidates keeps the pairs
                      whose exact Jaccard of shingles reaches the threshold (reading only the
                      candidates' shingles, memory-mapped)
    global   (1)      datatrove's MinhashDedupCluster: the verified pairs into clusters;
                      DedupStep: exact and perceptual duplicates, and of each near-duplicate
                      cluster the first copy in `order` kept -> <work>/duplicates.jsonl

The decisions equal dedup.find_duplicates' in-memory reference: the signatures are the same
MinHasher's (datatrove reads 64-bit values below 2^61 - 1, so each is shifted right by 3 bits),
a bucket group is a reference band group, and exact copies (whose signatures are identical, so
they always share every group) are dropped from the groups as the reference drops them before
its near-duplicate search. The global task still reads every document's id, order key and
exact hash (about 100 bytes a document), but no signature or shingle set.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.dedup.minhash import (
    MinhashConfig,
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupSignature,
)
from datatrove.utils.hashing import HashConfig

from .config import DedupConfig
from .dedup import (
    MODALITY_CODES,
    Duplicate,
    MinHasher,
    Signatures,
    UnionFind,
    exact_hash,
    find_duplicates,
    jaccard,
    word_shingles,
    write_duplicates,
)
from .filters import GopherWordTokenizer
from .imaging import COLOR_VALUES, decode_image, perceptual_signature

PER_DOCUMENT = ("ids", "order", "modality", "exact", "phash", "colors", "frame_offsets")
TEXT_ARRAYS = ("shingles", "offsets", "exact", "order")  # of the text documents, in task order


def minhash_config(cfg: DedupConfig) -> MinhashConfig:
    return MinhashConfig(n_grams=cfg.ngram, num_buckets=cfg.bands,
                         hashes_per_bucket=cfg.rows_per_band, seed=cfg.seed,
                         hash_config=HashConfig(precision=64))


def _folders(work_dir: str) -> dict[str, Path]:
    work = Path(work_dir)
    return {"signatures": work / "signatures", "text": work / "text",
            "sigs": work / "minhash" / "sigs", "candidates": work / "minhash" / "candidates",
            "verified": work / "minhash" / "verified", "clusters": work / "minhash" / "clusters"}


def _text_path(work_dir: str, rank: int, name: str) -> Path:
    return _folders(work_dir)["text"] / f"{rank:05d}.{name}.npy"


def write_bucket_signatures(minhash: np.ndarray, work_dir: str, rank: int,
                            cfg: DedupConfig) -> None:
    """The text documents' signatures [n, bands * rows] in datatrove's bucket file layout
    (per band: rows uint64 values, then the document's index in this task), sorted and
    verified by datatrove's signature stage."""
    folder = _folders(work_dir)["sigs"]
    rows = cfg.rows_per_band
    dtype = np.dtype([(f"h{i}", "<u8") for i in range(rows)] + [("doc", "<u4")])
    values = minhash >> np.uint64(3)  # < 2^61 - 1, datatrove's 64-bit hash range
    for b in range(cfg.bands):
        records = np.zeros(len(minhash), dtype=dtype)
        for i in range(rows):
            records[f"h{i}"] = values[:, b * rows + i]
        records["doc"] = np.arange(len(minhash), dtype=np.uint32)
        path = folder / f"bucket_{b:03d}" / f"{rank:05d}.minhash.sig"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(records.tobytes())
    # with the files in place, datatrove's step only sorts and verifies them
    MinhashDedupSignature(str(folder), minhash_config(cfg), language=GopherWordTokenizer(),
                          skip_existing_sigs=True).run(iter(()), rank)


def save_task_signatures(sig: Signatures, work_dir: str, rank: int, cfg: DedupConfig) -> None:
    folders = _folders(work_dir)
    folders["signatures"].mkdir(parents=True, exist_ok=True)
    with open(folders["signatures"] / f"{rank:05d}.npz", "wb") as f:
        np.savez(f, **{k: getattr(sig, k) for k in PER_DOCUMENT})
    text = np.flatnonzero(sig.modality == MODALITY_CODES["text"])
    arrays = {"shingles": sig.shingles,  # only text documents have shingles
              "offsets": np.r_[sig.shingle_offsets[text], sig.shingle_offsets[-1]],
              "exact": sig.exact[text], "order": sig.order[text]}
    folders["text"].mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        np.save(_text_path(work_dir, rank, name), array)
    write_bucket_signatures(sig.minhash[text], work_dir, rank, cfg)


class TextArrays:
    """The text documents' shingles, exact hashes and order keys of every task, memory-mapped
    on first use: a (task, index) pair reads only what it touches."""

    def __init__(self, work_dir: str):
        self.work_dir = work_dir
        self._tasks: dict[int, dict[str, np.ndarray]] = {}

    def task(self, rank: int) -> dict[str, np.ndarray]:
        if rank not in self._tasks:
            self._tasks[rank] = {name: np.load(_text_path(self.work_dir, rank, name),
                                               mmap_mode="r") for name in TEXT_ARRAYS}
        return self._tasks[rank]

    def shingles(self, node: tuple[int, int]) -> np.ndarray:
        t = self.task(node[0])
        return np.asarray(t["shingles"][t["offsets"][node[1]]:t["offsets"][node[1] + 1]])

    def exact(self, node: tuple[int, int]) -> int:
        return int(self.task(node[0])["exact"][node[1]])

    def order(self, node: tuple[int, int]) -> str:
        return str(self.task(node[0])["order"][node[1]])


class SignatureStep(PipelineStep):
    """Computes every passing document's dedup signature; passes the documents on."""

    name = "dedup signatures"
    type = "DEDUP"

    def __init__(self, cfg: DedupConfig, work_dir: str):
        super().__init__()
        self.cfg = cfg
        self.work_dir = work_dir

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        hasher = MinHasher(self.cfg.num_perm, self.cfg.seed)
        rows: dict[str, list] = {k: [] for k in ("ids", "order", "modality", "exact", "minhash",
                                                 "shingles", "phash", "colors")}
        shingle_counts, frame_counts = [], []
        for doc in data:
            with self.track_time():
                modality = doc.metadata["modality"]
                rows["ids"].append(doc.id)
                rows["order"].append(doc.metadata["order"])
                rows["modality"].append(MODALITY_CODES[modality])
                if MODALITY_CODES[modality] == MODALITY_CODES["text"]:
                    sh = word_shingles(doc.text, self.cfg.ngram)
                    rows["exact"].append(exact_hash(doc.text))
                    rows["minhash"].append(hasher.signature(sh))
                    rows["shingles"].append(sh)
                    shingle_counts.append(len(sh))
                    frame_counts.append(0)
                else:
                    rows["exact"].append(0)
                    rows["minhash"].append(np.zeros(self.cfg.num_perm, dtype=np.uint64))
                    shingle_counts.append(0)
                    for m in doc.media:
                        phash, colors = perceptual_signature(decode_image(m.media_bytes))
                        rows["phash"].append(phash)
                        rows["colors"].append(colors)
                    frame_counts.append(len(doc.media))
            yield doc
        save_task_signatures(Signatures(
            ids=np.array(rows["ids"], dtype=str), order=np.array(rows["order"], dtype=str),
            modality=np.array(rows["modality"], dtype=np.int8),
            exact=np.array(rows["exact"], dtype=np.uint64),
            minhash=np.array(rows["minhash"], dtype=np.uint64).reshape(-1, self.cfg.num_perm),
            shingles=(np.concatenate(rows["shingles"]) if rows["shingles"]
                      else np.zeros(0, np.uint32)),
            shingle_offsets=np.r_[0, np.cumsum(shingle_counts)].astype(np.int64),
            phash=np.array(rows["phash"], dtype=np.uint64),
            colors=np.array(rows["colors"], dtype=np.uint8).reshape(-1, COLOR_VALUES),
            frame_offsets=np.r_[0, np.cumsum(frame_counts)].astype(np.int64),
        ), self.work_dir, rank, self.cfg)


def _bucket_groups(pairs: np.ndarray) -> list[list[tuple[int, int]]]:
    """datatrove writes a run of equal band signatures as a chain of pairs (a, b), (b, c), ...;
    the chains are the reference's band groups."""
    groups: list[list[tuple[int, int]]] = []
    for f1, d1, f2, d2 in pairs.tolist():
        if groups and groups[-1][-1] == (f1, d1):
            groups[-1].append((f2, d2))
        else:
            groups.append([(f1, d1), (f2, d2)])
    return groups


class VerifyCandidates(PipelineStep):
    """After datatrove's bucket stage, in the same task (one LSH band): the candidate pairs
    whose exact Jaccard reaches the threshold, as datatrove's .dups file for the cluster
    stage. Only pairs between documents not yet connected in this band are checked."""

    name = "verify candidates"
    type = "DEDUP"

    def __init__(self, cfg: DedupConfig, work_dir: str):
        super().__init__()
        self.cfg = cfg
        self.work_dir = work_dir

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        if data:
            yield from data
        folders = _folders(self.work_dir)
        name = f"{rank:05d}_00.dups"  # bucket `rank`, its only worker
        pairs = np.fromfile(folders["candidates"] / name, dtype="<u4").reshape(-1, 4)
        text = TextArrays(self.work_dir)
        verified: list[tuple[int, int, int, int]] = []
        nodes: dict[tuple[int, int], int] = {}
        uf = UnionFind(2 * len(pairs))
        with self.track_time():
            for group in _bucket_groups(pairs) if self.cfg.near else []:
                if self.cfg.exact:  # exact copies are removed before the near search
                    first: dict[int, tuple[int, int]] = {}
                    for node in sorted(group, key=text.order):
                        first.setdefault(text.exact(node), node)
                    group = sorted(first.values(), key=text.order)
                for a, u in enumerate(group):
                    for v in group[a + 1:]:
                        i, j = nodes.setdefault(u, len(nodes)), nodes.setdefault(v, len(nodes))
                        if uf.find(i) != uf.find(j) and jaccard(
                                text.shingles(u), text.shingles(v)) >= self.cfg.jaccard_threshold:
                            uf.union(i, j)
                            verified.append((*u, *v))
        folders["verified"].mkdir(parents=True, exist_ok=True)
        np.array(verified, dtype="<u4").reshape(-1, 4).tofile(folders["verified"] / name)
        self.stat_update("verified_pairs", value=len(verified))
        self.stat_update("candidate_pairs", value=len(pairs))


def buckets_pipeline(cfg: DedupConfig, work_dir: str) -> list[PipelineStep]:
    """One task per band (the stage runs cfg.bands tasks)."""
    folders = _folders(work_dir)
    return [MinhashDedupBuckets(str(folders["sigs"]), str(folders["candidates"]),
                                config=minhash_config(cfg)),
            VerifyCandidates(cfg, work_dir)]


def _task_signatures(work_dir: str) -> list[Signatures]:
    """Every task's per-document signatures, without MinHash values or shingles."""
    parts = []
    for path in sorted(_folders(work_dir)["signatures"].glob("*.npz")):
        with np.load(path) as z:
            d = {k: z[k] for k in PER_DOCUMENT}
        n = len(d["ids"])
        parts.append(Signatures(**d, minhash=np.zeros((n, 0), np.uint64),
                                shingles=np.zeros(0, np.uint32),
                                shingle_offsets=np.zeros(n + 1, np.int64)))
    return parts


def _text_rows(parts: list[Signatures]) -> list[np.ndarray]:
    """Per task: the global index of each of its text documents."""
    start, rows = 0, []
    for p in parts:
        rows.append(start + np.flatnonzero(p.modality == MODALITY_CODES["text"]))
        start += len(p.ids)
    return rows


def near_duplicates_from_clusters(work_dir: str, rows: list[np.ndarray]):
    """dedup.NearDuplicates from the cluster stage's .clusters files (document, cluster id per
    task): of each cluster the member first in `order` is kept."""
    text = TextArrays(work_dir)

    def near(sig: Signatures, pos: np.ndarray, alive: np.ndarray) -> list[Duplicate]:
        # the clusters hold only `alive` documents: VerifyCandidates left exact copies out
        clusters: dict[int, list[tuple[int, int]]] = {}
        for path in sorted(_folders(work_dir)["clusters"].glob("*.clusters")):
            rank = int(path.name.split(".")[0])
            for doc, cluster in np.fromfile(path, dtype="<u4").reshape(-1, 2).tolist():
                clusters.setdefault(cluster, []).append((rank, doc))
        dups = []
        for members in clusters.values():
            members.sort(key=lambda m: pos[rows[m[0]][m[1]]])
            keep = members[0]
            dups += [Duplicate(int(rows[m[0]][m[1]]), "near_duplicate",
                               int(rows[keep[0]][keep[1]]),
                               jaccard(text.shingles(m), text.shingles(keep)))
                     for m in members[1:]]
        return dups
    return near


class DedupStep(PipelineStep):
    """One task, after datatrove's cluster stage: the duplicate list of the whole corpus."""

    name = "dedup clusters"
    type = "DEDUP"

    def __init__(self, cfg: DedupConfig, work_dir: str):
        super().__init__()
        self.cfg = cfg
        self.work_dir = work_dir

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        if data:
            yield from data
        parts = _task_signatures(self.work_dir)
        sig = Signatures.concat(parts, 0)
        with self.track_time():
            dups = find_duplicates(sig, self.cfg, near=near_duplicates_from_clusters(
                self.work_dir, _text_rows(parts)))
        write_duplicates(self.work_dir, sig, dups)
        self.stat_update("duplicates", value=len(dups))


def global_pipeline(cfg: DedupConfig, work_dir: str) -> list[PipelineStep]:
    folders = _folders(work_dir)
    return [MinhashDedupCluster(str(folders["verified"]), str(folders["clusters"]),
                                config=minhash_config(cfg), save_cluster_id=True),
            DedupStep(cfg, work_dir)]


def load_signatures(work_dir: str, cfg: DedupConfig) -> Signatures:
    """Every document's full signature (MinHash recomputed from the shingles): the input of
    the in-memory reference, for comparing it with the sharded stages."""
    hasher = MinHasher(cfg.num_perm, cfg.seed)
    parts = []
    for rank, p in enumerate(_task_signatures(work_dir)):
        text = TextArrays(work_dir).task(rank)
        n, is_text = len(p.ids), p.modality == MODALITY_CODES["text"]
        counts = np.zeros(n, np.int64)
        counts[is_text] = np.diff(text["offsets"])
        p.shingles = np.asarray(text["shingles"])
        p.shingle_offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
        p.minhash = np.zeros((n, cfg.num_perm), np.uint64)
        for i in np.flatnonzero(is_text):
            p.minhash[i] = hasher.signature(p.shingles_of(i))
        parts.append(p)
    return Signatures.concat(parts, cfg.num_perm)

