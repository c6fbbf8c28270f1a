"""The curation run as five datatrove stages, on the local executor or on Slurm:

    curate    (tasks)  read -> decode media -> quality filters -> resize media -> dedup signatures
                       -> curated JSONL
    buckets   (bands)  MinHash LSH buckets -> candidate pairs verified by exact Jaccard
    global    (1 task) near-duplicate clusters, exact and perceptual duplicates -> tokenizer
    tokenize  (tasks)  curated JSONL -> drop duplicates -> rephrase hook -> tokens -> shards
    finalize  (1 task) summary, quarantine, manifest

Stages hand over through files under the build folder `<output_dir>.partial`, so each stage can
be a Slurm job array that depends on the previous one; once the manifest is written the build is
swapped in for output_dir (publish.py), which keeps the dataset it held until then. Output
layout: ledger/, counts/, work/, logs/, shards/, validation/ (the held-out split),
tokenizer.json, summary.json, quarantine.jsonl, manifest.json. When no document survives
curation the run still ends with the summary, ledger, quarantine and a manifest of no shards
(manifest.py), and k3-train refuses it by name.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import shlex
import shutil
import sys
import threading
import time
from pathlib import Path

from datatrove.executor import LocalPipelineExecutor, SlurmPipelineExecutor
from datatrove.pipeline.base import PipelineStep
from tqdm import tqdm

from model.errors import ConfigError

from .config import DataConfig, as_data_config
from .dedup import DropDuplicates
from .dedup_stages import SignatureStep, buckets_pipeline, global_pipeline
from .filters import quality_filters
from .intermediate import CuratedReader, CuratedWriter
from .logs import set_verbosity
from .manifest import FinalizeStep, data_settings, fingerprint, manifest_path, timings_path
from .media import DecodeMedia, NormalizeMedia
from .publish import check_writable, partial_dir, publish
from .readers import build_reader
from .records import write_json
from .rephrase import Rephrase
from .tokenize_shards import (
    TokenizerStep,
    TokenizeToShards,
    chat_template_of,
    check_tokenizer_inputs,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
STAGES = ("curate", "buckets", "global", "tokenize", "finalize")


def stages(cfg: DataConfig, out: str) -> list[tuple[str, list[PipelineStep], int]]:
    """(name, pipeline, tasks) in run order; `out` is the build folder."""
    work = f"{out}/work"
    steps_progress = cfg.progress and cfg.verbose  # quiet: only the stage bars
    template = chat_template_of(cfg)
    curate = [build_reader(s, i, out, steps_progress, template)
              for i, s in enumerate(cfg.sources)]
    curate += [DecodeMedia(cfg.image, out), *quality_filters(cfg, out), NormalizeMedia(cfg.image),
               SignatureStep(cfg.dedup, work), CuratedWriter(work)]
    tokenize: list[PipelineStep] = [CuratedReader(work, steps_progress),
                                    DropDuplicates(out, work)]
    if cfg.rephrase.enabled:
        tokenize.append(Rephrase(cfg.rephrase))
    tokenize.append(TokenizeToShards(cfg, out))
    tasks = cfg.executor.tasks
    return [
        ("curate", curate, tasks),
        ("buckets", buckets_pipeline(cfg.dedup, work), cfg.dedup.bands),
        ("global", [*global_pipeline(cfg.dedup, work),
                    TokenizerStep(cfg.tokenizer, out, work, steps_progress)], 1),
        ("tokenize", tokenize, tasks),
        ("finalize", [FinalizeStep(cfg, out)], 1),
    ]


def _local(cfg: DataConfig, name: str, pipeline, tasks: int, out: str) -> LocalPipelineExecutor:
    workers = tasks if cfg.executor.workers == -1 else min(cfg.executor.workers, tasks)
    return LocalPipelineExecutor(pipeline, tasks=tasks, workers=workers,
                                 logging_dir=f"{out}/logs/{name}", skip_completed=cfg.resume,
                                 start_method=cfg.executor.start_method)


def _job_setup(venv_path: str | None) -> str:
    """The shell line each Slurm job runs first: the venv, then this checkout on PYTHONPATH, so
    that the pickled pipeline's classes import in the job even where the project is not
    installed into the venv (e.g. `python -m data_pipeline.cli` from a checkout)."""
    path = f"export PYTHONPATH={shlex.quote(str(REPO_ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}"
    return f"source {shlex.quote(venv_path)} && {path}" if venv_path else path


class K3SlurmExecutor(SlurmPipelineExecutor):
    """datatrove's Slurm executor with a shell line run after the stage's tasks (the finalize
    job publishes the build) and without datatrove's stats-merging job: it would write into
    the build folder after the finalize job has swapped it in (the summary has the numbers)."""

    def __init__(self, *args, then: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.then = then

    def get_launch_file_contents(self, sbatch_args: dict, run_script: str) -> str:
        script = f"{run_script}\n{self.then}" if self.then else run_script
        return super().get_launch_file_contents(sbatch_args, script)

    def launch_merge_stats(self) -> None:
        pass


def _slurm(cfg: DataConfig, name: str, pipeline, tasks: int, out: str, depends,
           then: str | None = None) -> K3SlurmExecutor:
    e = cfg.executor
    return K3SlurmExecutor(
        pipeline, tasks=tasks, time=e.time, partition=e.partition, cpus_per_task=e.cpus_per_task,
        mem_per_cpu_gb=e.mem_per_cpu_gb, workers=e.workers, job_name=f"{e.job_name}-{name}",
        env_command=_job_setup(e.venv_path), sbatch_args=dict(e.sbatch_args) or None,
        depends=depends, logging_dir=f"{out}/logs/{name}",
        slurm_logs_folder=f"{out}/logs/slurm/{name}", skip_completed=cfg.resume, then=then)


def _publish_command(build: Path, out: Path) -> str:
    return (f"python -m data_pipeline.publish {shlex.quote(str(build))} "
            f"{shlex.quote(str(out))}")


class _StageBar:
    """The console's one progress bar per stage: tasks done, from datatrove's completion marks
    (written by worker processes too)."""

    def __init__(self, name: str, tasks: int, logging_dir: Path, enabled: bool):
        self.marks = logging_dir / "completions"
        self.bar = tqdm(total=tasks, desc=f"k3-data {name}", unit="task", disable=not enabled,
                        file=sys.stderr)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _done(self) -> int:
        return len(list(self.marks.iterdir())) if self.marks.is_dir() else 0

    def _poll(self) -> None:
        while not self.stop.wait(0.2):
            self.bar.update(self._done() - self.bar.n)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.bar.update(self._done() - self.bar.n)
        self.bar.close()


def run_pipeline(cfg) -> dict:
    """Runs the configured curation (a DataConfig, a DictConfig or a dict). Local: returns the
    summary (also in <output_dir>/summary.json); the output does not depend on the number of
    workers. Slurm: submits the five stages as dependent job arrays and returns at once with
    {"submitted": [job id of each stage, in run order]}; the finalize job writes summary.json and,
    last, manifest.json with "complete": true, then swaps the build in for output_dir. After a
    failed job, the same config with resume=True resubmits only the tasks that did not finish (a
    finished stage's id is -1; every id is -1 once the dataset is published).

    A non-empty output_dir is replaced only with overwrite=True, and only once the new dataset
    is complete (publish.py).

    With executor.workers > 1 and the forkserver or spawn start method, worker processes import
    the caller's main module: a script calling this needs the `if __name__ == "__main__":`
    guard (as for any multiprocessing pool)."""
    cfg = as_data_config(cfg)
    set_verbosity(cfg.verbose)
    cfg.check_sources_exist()
    check_tokenizer_inputs(cfg)
    out = Path(cfg.output_dir).resolve()
    build = partial_dir(out)
    if not cfg.overwrite and not build.exists() and is_prepared(cfg):  # done, same config
        print(f"k3-data: {out} already holds the dataset of this config; nothing to do "
              "(data.overwrite=true rebuilds it)", file=sys.stderr)
        if cfg.executor.kind == "slurm":
            return {"submitted": [-1] * len(STAGES)}
        return json.loads((out / "summary.json").read_text())
    check_writable(out, cfg.overwrite)
    if build.exists() and not cfg.resume:
        print(f"k3-data: removing the unfinished build {build} (data.resume=true would have "
              "continued it)", file=sys.stderr)
        shutil.rmtree(build)
    build.mkdir(parents=True, exist_ok=True)
    if cfg.executor.kind == "slurm":
        executors = []
        for name, pipeline, tasks in stages(cfg, str(build)):
            then = _publish_command(build, out) if name == "finalize" else None
            executors.append(_slurm(cfg, name, pipeline, tasks, str(build),
                                    executors[-1] if executors else None, then))
        executors[-1].run()  # submits the chain; a stage with every task done gets job id -1
        return {"submitted": [e.job_id for e in executors]}
    timings: dict[str, dict] = {}  # the finalize stage puts them into the summary
    for name, pipeline, tasks in stages(cfg, str(build)):
        if name == "finalize":
            write_json(timings_path(build), timings)
        t0 = time.perf_counter()
        with _StageBar(name, tasks, build / "logs" / name, cfg.progress):
            _local(cfg, name, pipeline, tasks, str(build)).run()
        timings[name] = {"wall_s": time.perf_counter() - t0}
    publish(build, out)
    return json.loads((out / "summary.json").read_text())


def _read_manifest(out: Path) -> dict | None:
    path = manifest_path(out)
    if not path.exists():
        return None
    manifest = json.loads(path.read_text())
    return manifest if manifest.get("complete") is True else None


def is_prepared(cfg: DataConfig) -> bool:
    manifest = _read_manifest(Path(cfg.output_dir).resolve())
    return manifest is not None and manifest.get("fingerprint") == fingerprint(cfg)


def _describe(sources: list[dict]) -> str:
    return "; ".join(f"{s['name']} ({s['modality']} {s['format']}: {s['path']})" for s in sources)


def check_usable(cfg: DataConfig, manifest: dict, out: Path) -> None:
    """A prepared dataset is used as it is, if it was curated from the configured sources (or
    data.use_prepared=true) and holds documents; otherwise a ConfigError saying what to do."""
    made = manifest.get("data", {})
    configured = [dataclasses.asdict(s) for s in cfg.sources]
    if not cfg.use_prepared and made.get("sources") != configured:
        origin = (_describe(made["sources"]) if "sources" in made else
                  "sources this manifest does not name (an older k3-data made it)")
        raise ConfigError(
            f"data.output_dir={str(out)!r} holds the dataset {made.get('name', '?')!r} curated "
            f"from: {origin}. The configured data.sources "
            f"({cfg.name!r}) are: {_describe(configured)}. To train on the dataset in "
            f"{out} as it is, add data.use_prepared=true; to re-curate it from the configured "
            f"sources, run k3-data with the same data settings and data.overwrite=true")
    if manifest.get("kept_documents", 0) == 0:
        raise ConfigError(
            f"data.output_dir={str(out)!r}: the dataset {made.get('name', '?')!r} holds no "
            f"documents (no input record survived curation; see {out / 'summary.json'} and "
            f"{out / 'quarantine.jsonl'}); it cannot be trained on")
    if manifest.get("fingerprint") != fingerprint(cfg):
        changed = sorted(k for k, v in data_settings(cfg).items() if made.get(k) != v)
        print(f"k3: using the dataset in {out} as it is (it was curated with other "
              f"{', '.join(changed) or 'settings'}; k3-data ... data.overwrite=true re-curates)",
              file=sys.stderr)


def ensure_prepared(data_cfg) -> Path:
    """The manifest of `data_cfg`'s output. A complete dataset there is used as it is
    (check_usable); where there is none, the pipeline runs first (locally), which never
    replaces a non-empty output_dir without data.overwrite=true. Safe to call from several
    processes at once: one runs the pipeline, the others wait for it."""
    cfg = as_data_config(data_cfg)
    out = Path(cfg.output_dir).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        manifest = _read_manifest(out)
        if manifest is None:
            if cfg.executor.kind != "local":
                raise ConfigError(f"data.executor.kind={cfg.executor.kind!r}: the data in {out} "
                                  "is not prepared; run k3-data with this config first")
            print(f"k3: preparing data {cfg.name!r} into {out}", file=sys.stderr)
            run_pipeline(cfg)
            manifest = _read_manifest(out)
        check_usable(cfg, manifest, out)
    return manifest_path(out)
