"""Step metrics: a console line, `metrics.jsonl` in the run directory, W&B (rank 0 only), and
training.png at the end (run_log.py)."""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
from pathlib import Path

from .run_log import format_duration, plot_run

log = logging.getLogger("k3.train")


def _fmt_tokens(x: float) -> str:
    return f"{x / 1e3:.1f}k" if x < 1e6 else f"{x / 1e6:.2f}M"


def posttrain_line(row: dict, total_steps: int) -> str:
    """A post-training row: the rollouts' figures, then the step's (none without a finished
    group)."""
    parts = [f"step {row['step']}/{total_steps}"]
    if "eval_reward" in row:
        parts += [f"eval reward {row['eval_reward']:.3f} (passed "
                  f"{100 * row['eval_passed']:.0f}%, greedy)"]
    if "rollout_time_s" not in row:  # the evaluation before the first step
        return " | ".join(parts)
    if "reward" in row:
        parts += [f"reward {row['reward']:.3f}", f"passed {100 * row['passed']:.0f}%",
                  f"length {row['response_length']:.1f}",
                  f"over budget {100 * row['budget_hits']:.0f}%"]
    if "loss" in row:
        parts += [f"loss {row['loss']:.4f}", f"kl {row['kl']:.4f}", f"gnorm {row['grad_norm']:.3f}"]
    parts += [f"{row['finished_episodes']} finished, {row['paused_episodes']} paused",
              f"rollout {row['rollout_time_s']:.1f}s train {row['train_time_s']:.1f}s"]
    return " | ".join(parts)


def console_line(row: dict, total_steps: int) -> str:
    if "rollout_time_s" in row or "eval_reward" in row:
        return posttrain_line(row, total_steps)
    parts = [f"step {row['step']}/{total_steps}", f"loss {row['loss']:.4f}"]
    if "val_loss" in row:
        parts.append(f"val loss {row['val_loss']:.4f}")
    parts += [f"lr {row['lr']:.2e}", f"gnorm {row['grad_norm']:.3f}",
             f"{_fmt_tokens(row['tokens_per_s'])} tok/s",
             f"MFU {100 * row['mfu']:.2f}% ({row['mfu_peak_source']})"]
    if "moe/cv_mean" in row:
        parts.append(f"moe cv {row['moe/cv_mean']:.3f} max/mean {row['moe/max_over_mean_max']:.2f}")
    if "attn/max_logit" in row:
        parts.append(f"max logit {row['attn/max_logit']:.1f}")
    parts.append(f"mem {row['peak_mem_gb']:.2f}GB")
    if "eta_s" in row:
        parts.append(f"ETA {format_duration(row['eta_s'])}")
    if row.get("skipped"):
        parts.append("SKIPPED (non-finite)")
    return " | ".join(parts)


class MetricsLogger:
    """Writes one row per logged step. On resume it drops the rows past the resumed step (they
    were trained after the checkpoint and are trained again) and rewinds the W&B run to that step
    (W&B's `resume_from`), so that each step is recorded once in both."""

    def __init__(self, run_dir: Path, rank: int, cfg, total_steps: int, resume_step: int,
                 run_config: dict):
        self.rank = rank
        self.total_steps = total_steps
        self.path = run_dir / "metrics.jsonl"
        self.rows: list[dict] = []
        self.wandb_run = None
        self.notes: dict[str, str] = {}  # warnings carried into the next row
        if rank != 0:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = [json.loads(line) for line in self.path.read_text().splitlines() if line]
            self.rows = [r for r in kept if r["step"] <= resume_step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        os.replace(tmp, self.path)
        if cfg.wandb and cfg.wandb_mode != "disabled":
            self.wandb_run = self._init_wandb(run_dir, cfg, run_config, resume_step)

    @staticmethod
    def _init_wandb(run_dir: Path, cfg, run_config: dict, resume_step: int):
        import wandb

        id_file = run_dir / "wandb_run_id"
        common = {"mode": cfg.wandb_mode, "dir": str(run_dir), "project": cfg.wandb_project,
                  "entity": cfg.wandb_entity, "config": run_config, "name": run_dir.name}
        if not id_file.exists():
            run_id = secrets.token_hex(4)
            id_file.write_text(run_id)
            run = wandb.init(id=run_id, **common)
        else:
            run_id = id_file.read_text().strip()
            try:  # rewind: the history past resume_step is dropped, then logged again
                run = wandb.init(resume_from=f"{run_id}?_step={resume_step}", **common)
            except wandb.errors.Error as e:  # a server without rewind: W&B ignores steps
                log.warning("W&B cannot rewind run %s (%s): resuming it; the steps up to the "
                            "last one it holds keep their first values", run_id, e)
                run = wandb.init(id=run_id, resume="allow", **common)
        log.info("W&B run %s (%s) in %s", run_id, cfg.wandb_mode, run_dir / "wandb")
        return run

    def note(self, key: str, text: str) -> None:
        """A warning recorded with the next row (metrics.jsonl, W&B history) and in the W&B
        run summary."""
        if self.rank != 0:
            return
        self.notes[key] = text
        if self.wandb_run is not None:
            self.wandb_run.summary[key] = text

    def log(self, row: dict) -> None:
        if self.rank != 0:
            return
        row = {**row, **self.notes}
        self.notes = {}
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
                 for k, v in row.items()}
        self.rows.append(clean)
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
        log.info(console_line(row, self.total_steps))
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def finish(self, plot_path: Path | None) -> None:
        if self.rank != 0:
            return
        if plot_path is not None and self.rows:
            plot_run(self.rows, plot_path)
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None

