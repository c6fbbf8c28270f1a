"""k3_tiny on the bundled sample with AdamW and with Per-Head Muon, same data, seed and steps:
prints both loss curves' tails side by side and their ratio.

    python -m benchmarks.muon_vs_adamw --steps 150 [--data-dir outputs/data/sample]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def train(run_dir: Path, data_dir: str, steps: int, optim: str, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "train.cli", f"run_dir={run_dir}", f"data.output_dir={data_dir}",
           f"steps={steps}", f"optim={optim}", "checkpoint.every=0",
           "checkpoint.save_at_end=false", "logging.wandb=false", "logging.plot=false", *extra]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--data-dir", default="outputs/data/sample")
    parser.add_argument("overrides", nargs="*", help="extra k3-train overrides for both runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = {opt: train(Path(tmp) / opt, args.data_dir, args.steps, opt, args.overrides)
                for opt in ("adamw", "muon")}
    window = max(1, args.steps // 10)
    print(f"k3_tiny, {args.steps} steps, overrides {args.overrides or 'none'}")
    print(f"{'step':>6} {'adamw':>8} {'muon':>8}")
    for i in range(0, args.steps, max(1, args.steps // 10)):
        print(f"{i + 1:>6} {rows['adamw'][i]['loss']:>8.4f} {rows['muon'][i]['loss']:>8.4f}")
    tail = {opt: sum(r["loss"] for r in rows[opt][-window:]) / window for opt in rows}
    print(f"mean loss of the last {window} steps: adamw {tail['adamw']:.4f}, "
          f"muon {tail['muon']:.4f}, muon/adamw {tail['muon'] / tail['adamw']:.3f}")


if __name__ == "__main__":
    main()
