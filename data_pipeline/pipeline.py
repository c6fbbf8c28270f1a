"""The curation run as four datatrove stages, on the local executor or on Slurm:

    curate    (tasks)  read -> decode media -> quality filters -> resize media -> dedup signatures
                       -> curated JSONL
    global    (1 task) dedup clusters over all signatures -> tokenizer (train or load)
    tokenize  (tasks)  curated JSONL -> drop duplicates -> rephrase hook -> tokens -> shards
    finalize  (1 task) summary, quarantine, manifest

Stages hand over through files under output_dir, so each stage can be a Slurm job array that
depends on the previous one. Output layout: ledger/, counts/, work/, logs/, shards/,
validation/ (the held-out split), tokenizer.json, summary.json, quarantine.jsonl, manifest.json.
"""

from __future__ import annotations

import fcntl
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.base import PipelineStep

from model.config import ConfigError

from .config import DataConfig, as_data_config
from .dedup import DedupStep, DropDuplicates, SignatureStep
from .filters import quality_filters
from .intermediate import CuratedReader, CuratedWriter
from .manifest import FinalizeStep, fingerprint, manifest_path, timings_path
from .media import DecodeMedia, NormalizeMedia
from .readers import build_reader
from .records import write_json
from .rephrase import Rephrase
from .tokenize_shards import TokenizerStep, TokenizeToShards

REPO_ROOT = Path(__file__).resolve().parent.parent
RUN_OUTPUTS = ("ledger", "counts", "work", "logs", "shards", "validation", "tokenizer.json",
               "summary.json", "quarantine.jsonl", "manifest.json")


def stages(cfg: DataConfig, out: str) -> list[tuple[str, list[PipelineStep], int]]:
    """(name, pipeline, tasks) in run order."""
    work = f"{out}/work"
    curate = [build_reader(s, i, out, cfg.progress) for i, s in enumerate(cfg.sources)]
    curate += [DecodeMedia(cfg.image, out), *quality_filters(cfg, out), NormalizeMedia(cfg.image),
               SignatureStep(cfg.dedup, work), CuratedWriter(work)]
    tokenize: list[PipelineStep] = [CuratedReader(work, cfg.progress), DropDuplicates(out, work)]
    if cfg.rephrase.enabled:
        tokenize.append(Rephrase(cfg.rephrase))
    tokenize.append(TokenizeToShards(cfg, out))
    tasks = cfg.executor.tasks
    return [
        ("curate", curate, tasks),
        ("global", [DedupStep(cfg.dedup, work, cfg.progress),
                    TokenizerStep(cfg.tokenizer, out, work, cfg.progress)], 1),
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


def _slurm(cfg: DataConfig, name: str, pipeline, tasks: int, out: str, depends):
    from datatrove.executor import SlurmPipelineExecutor

    e = cfg.executor
    return SlurmPipelineExecutor(
        pipeline, tasks=tasks, time=e.time, partition=e.partition, cpus_per_task=e.cpus_per_task,
        mem_per_cpu_gb=e.mem_per_cpu_gb, workers=e.workers, job_name=f"{e.job_name}-{name}",
        env_command=_job_setup(e.venv_path), sbatch_args=dict(e.sbatch_args) or None,
        depends=depends, logging_dir=f"{out}/logs/{name}",
        slurm_logs_folder=f"{out}/logs/slurm/{name}", skip_completed=cfg.resume)


def _clear(out: Path) -> None:
    for name in RUN_OUTPUTS:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def run_pipeline(cfg) -> dict:
    """Runs the configured curation (a DataConfig, a DictConfig or a dict). Local: returns the
    summary (also in <output_dir>/summary.json); the output does not depend on the number of
    workers. Slurm: submits the four stages as dependent job arrays and returns at once with
    {"submitted": [job id of each stage, in run order]}; the finalize job writes summary.json and,
    last, manifest.json with "complete": true. After a failed job, the same config with
    resume=True resubmits only the tasks that did not finish (a finished stage's id is -1).

    With executor.workers > 1 and the forkserver or spawn start method, worker processes import
    the caller's main module: a script calling this needs the `if __name__ == "__main__":`
    guard (as for any multiprocessing pool)."""
    cfg = as_data_config(cfg)
    cfg.check_sources_exist()
    out = Path(cfg.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not cfg.resume:
        _clear(out)
    if cfg.executor.kind == "slurm":
        executors = []
        for name, pipeline, tasks in stages(cfg, str(out)):
            executors.append(_slurm(cfg, name, pipeline, tasks, str(out),
                                    executors[-1] if executors else None))
        executors[-1].run()  # submits the chain; a stage with every task done gets job id -1
        return {"submitted": [e.job_id for e in executors]}
    timings: dict[str, dict] = {}  # the finalize stage puts them into the summary
    for name, pipeline, tasks in stages(cfg, str(out)):
        if name == "finalize":
            write_json(timings_path(out), timings)
        t0 = time.perf_counter()
        _local(cfg, name, pipeline, tasks, str(out)).run()
        timings[name] = {"wall_s": time.perf_counter() - t0}
    return json.loads((out / "summary.json").read_text())


def is_prepared(cfg: DataConfig) -> bool:
    path = manifest_path(Path(cfg.output_dir).resolve())
    if not path.exists():
        return False
    manifest = json.loads(path.read_text())
    return manifest.get("complete") is True and manifest.get("fingerprint") == fingerprint(cfg)


def ensure_prepared(data_cfg) -> Path:
    """The manifest of `data_cfg`'s output, running the pipeline first (locally) when there is
    no complete manifest made from the same config. Safe to call from several processes at
    once: one runs the pipeline, the others wait for it."""
    cfg = as_data_config(data_cfg)
    out = Path(cfg.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_prepared(cfg):
            if cfg.executor.kind != "local":
                raise ConfigError(f"data.executor.kind={cfg.executor.kind!r}: the data in {out} "
                                  "is not prepared; run k3-data with this config first")
            print(f"k3: preparing data {cfg.name!r} into {out}", file=sys.stderr)
            run_pipeline(cfg)
    return manifest_path(out)
