"""`k3-data`: the curation pipeline as a Hydra app (configs/data_pipeline.yaml).

    k3-data                          # the bundled sample, locally, into outputs/data/sample
    k3-data data.output_dir=/scratch/c4 data.executor.kind=slurm data.executor.tasks=64
    k3-data stage=tiny_s2            # pack rows for another context-length stage
    k3-data data.output_dir=X data.overwrite=true   # replace the dataset in X once done
    k3-data data.verbose=true        # datatrove's and megatron's INFO logs
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from model.errors import ConfigError

from .config import DataConfig, StageConfig
from .pipeline import STAGES, ensure_prepared, run_pipeline

__all__ = ["main", "run_pipeline", "ensure_prepared", "format_summary"]

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


@dataclass
class DataPipelineApp:
    """k3-data's schema: the data config and the stage whose rows it packs."""

    data: DataConfig = field(default_factory=DataConfig)
    stage: StageConfig = field(default_factory=StageConfig)


ConfigStore.instance().store(name="data_pipeline_schema", node=DataPipelineApp)


def _counts(title: str, counts: dict) -> list[str]:
    lines = [f"  {title}: {sum(counts.values())}"]
    lines += [f"    {reason}: {n}" for reason, n in sorted(counts.items(), key=lambda x: -x[1])]
    return lines


def format_summary(summary: dict) -> str:
    inp, out = summary["input"], summary["outcomes"]
    lines = [f"input: {inp['records']} records, {inp['bytes'] / 1e6:.2f} MB",
             f"  kept: {out['kept']}"]
    for outcome in ("filtered", "duplicate", "quarantined"):
        lines += _counts(outcome, out[outcome])
    lines.append(f"accounted: {summary['accounted']} of {inp['records']} "
                 f"({'balanced' if summary['balanced'] else 'NOT BALANCED'})")
    o = summary["output"]
    lines.append(f"output: {o['tokens']} tokens in {o['rows']} rows of {o['seq_len']} "
                 f"(fill {o['fill']:.1%}); derived documents: {summary['derived'] or 'none'}")
    for name, counts in o["by_source"].items():
        if counts.get("truncated") or counts.get("dropped"):
            lines.append(f"  {name}: conversations longer than {o['seq_len']} tokens: "
                         f"{counts['truncated']} truncated, {counts['dropped']} dropped")
    for stage, t in summary["timing"].items():
        extra = "".join(f", {k.replace('_per_s', '/s')} {t[k]}" for k in ("docs_per_s",
                                                                          "mb_per_s") if k in t)
        lines.append(f"  {stage}: {t['wall_s']:.2f} s{extra}")
    return "\n".join(lines)


def _to_app(cfg: DictConfig) -> DataPipelineApp:
    try:
        return OmegaConf.to_object(cfg)
    except Exception as e:  # omegaconf's ValidationError carries the full key
        raise ConfigError(f"{str(e).splitlines()[0]} (field: {getattr(e, 'full_key', '?')})") \
            from e


def _run(cfg: DictConfig) -> int:
    try:
        app = _to_app(cfg)
        app.stage.validate("stage")
        summary = run_pipeline(app.data)
    except ConfigError as e:
        print(f"k3-data: config error: {e}", file=sys.stderr)
        return 2
    if "submitted" in summary:
        out = Path(app.data.output_dir).resolve()
        if all(job == -1 for job in summary["submitted"]):
            print(f"k3-data: every stage in {out} had finished; nothing submitted")
            return 0
        print(f"k3-data: submitted Slurm jobs {' '.join(map(str, summary['submitted']))} "
              f"({', '.join(STAGES)}); the last one writes {out}/summary.json "
              f"and {out}/manifest.json. If a job fails, rerun with data.resume=true.")
        return 0
    out = Path(app.data.output_dir).resolve()
    print(format_summary(summary))
    print(f"summary: {out / 'summary.json'}")
    if summary["outcomes"]["kept"] == 0:
        read = summary["input"]["records"]
        why = ("no input record was read (are the sources' files empty?)" if read == 0 else
               f"none of the {read} input records survived curation (see the reasons above, "
               f"{out / 'quarantine.jsonl'} and the ledger in {out / 'ledger'})")
        print(f"k3-data: the dataset in {out} is empty: {why}. k3-train refuses it.")
    return 0 if summary["balanced"] else 1


@hydra.main(config_path=CONFIG_DIR, config_name="data_pipeline", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    code = _run(cfg)
    if code:
        sys.exit(code)


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
