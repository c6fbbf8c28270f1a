"""Step metrics: a console line, `metrics.jsonl` in the run directory, W&B (rank 0 only), and a
loss/throughput plot at the end."""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
from pathlib import Path

log = logging.getLogger("k3.train")


def _fmt_tokens(x: float) -> str:
    return f"{x / 1e3:.1f}k" if x < 1e6 else f"{x / 1e6:.2f}M"


def console_line(row: dict, total_steps: int) -> str:
    parts = [f"step {row['step']}/{total_steps}", f"loss {row['loss']:.4f}",
             f"lr {row['lr']:.2e}", f"gnorm {row['grad_norm']:.3f}",
             f"{_fmt_tokens(row['tokens_per_s'])} tok/s",
             f"MFU {100 * row['mfu']:.2f}% ({row['mfu_peak_source']})"]
    if "moe/cv_mean" in row:
        parts.append(f"moe cv {row['moe/cv_mean']:.3f} max/mean {row['moe/max_over_mean_max']:.2f}")
    if "attn/max_logit" in row:
        parts.append(f"max logit {row['attn/max_logit']:.1f}")
    parts.append(f"mem {row['peak_mem_gb']:.2f}GB")
    if row.get("skipped"):
        parts.append("SKIPPED (non-finite)")
    return " | ".join(parts)


class MetricsLogger:
    """Writes one row per logged step. On resume it drops rows past the resumed step (they were
    trained after the last checkpoint and are trained again) and continues the same W&B run."""

    def __init__(self, run_dir: Path, rank: int, cfg, total_steps: int, resume_step: int,
                 run_config: dict):
        self.rank = rank
        self.total_steps = total_steps
        self.path = run_dir / "metrics.jsonl"
        self.rows: list[dict] = []
        self.wandb_run = None
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
            self.wandb_run = self._init_wandb(run_dir, cfg, run_config)

    @staticmethod
    def _init_wandb(run_dir: Path, cfg, run_config: dict):
        import wandb

        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        id_file.write_text(run_id)
        run = wandb.init(mode=cfg.wandb_mode, dir=str(run_dir), project=cfg.wandb_project,
                         entity=cfg.wandb_entity, id=run_id, resume="allow", config=run_config,
                         name=run_dir.name)
        log.info("W&B run %s (%s) in %s", run_id, cfg.wandb_mode, run_dir / "wandb")
        return run

    def log(self, row: dict) -> None:
        if self.rank != 0:
            return
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


def plot_run(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if isinstance(r.get("loss"), float)]
    steps = [r["step"] for r in rows]
    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax_loss.plot(steps, [r["loss"] for r in rows])
    ax_loss.set(xlabel="step", ylabel="loss", title="training loss")
    ax_tps.plot(steps, [r["tokens_per_s"] for r in rows])
    ax_tps.set(xlabel="step", ylabel="tokens/s", title="throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
