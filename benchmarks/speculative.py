"""Speculative decoding on the demo model: a trained draft's acceptance length and the speed-up
over plain decoding, side by side in one run, on the CPU.

    k3-train && k3-train model=k3_tiny_draft     # the demo model and its draft, same data
    PYTHONPATH=. python -m benchmarks.speculative [--target outputs/k3_tiny] \
        [--draft outputs/k3_tiny_draft] [--k 2 4] [--prompts 8] [--tokens 32]

Prompts are the first words of the bundled web documents, tokenised with the run's tokenizer.
Per setting (greedy and temperature 1; one prompt at a time, and all prompts as one batch): the
wall time (the fastest of three runs) of plain decoding and of speculative decoding with k
drafts a round over the same prompts and seed, the tokens per round (the acceptance length:
1 + the kept drafts, at most k + 1) and their ratio. Greedy completions must equal plain
decoding's (checked). As a control, the same with an untrained draft (the draft's architecture
at its initial weights).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from data_pipeline.tokenizer import encode_text, load_tokenizer
from model.k3 import K3Model
from train.generate import sample
from train.generate_cli import load_model


def _prompts(tokenizer, count: int) -> list[list[int]]:
    texts = []
    for path in sorted(Path("data_pipeline/sample/text/web").glob("*.jsonl")):
        for line in path.read_bytes().splitlines():
            try:  # the sample's deliberately broken records are skipped
                texts.append(json.loads(line.decode("utf-8"))["text"])
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
                continue
    return [encode_text(tokenizer, " ".join(text.split()[:7])) for text in texts[:count]]


class _Counted:
    """Counts a model's decode calls (the speculative rounds are the target's calls after the
    prefill)."""

    def __init__(self, model: K3Model):
        self.calls, self._decode = 0, model.decode
        model.decode = self._count

    def _count(self, *args, **kwargs):
        self.calls += 1
        return self._decode(*args, **kwargs)


REPEATS = 3


def _timed(model, prompts, batch, tokens, temperature, draft=None, k=0):
    """(completions, the fastest of REPEATS wall times): the minimum is the run least disturbed
    by whatever else the machine does."""
    best = float("inf")
    for _ in range(REPEATS):
        completions, start = [], time.perf_counter()
        for i in range(0, len(prompts), batch):
            completions += sample(model, prompts[i:i + batch], tokens, temperature=temperature,
                                  seed=i, draft=draft, speculative_tokens=k)
        best = min(best, time.perf_counter() - start)
    return completions, best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="outputs/k3_tiny")
    parser.add_argument("--draft", default="outputs/k3_tiny_draft")
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer_path = load_model(args.target, None, None)
    draft, _ = load_model(args.draft, None, None)
    untrained = K3Model(draft.cfg, seed=0).eval()
    prompts = _prompts(load_tokenizer(tokenizer_path), args.prompts)
    counter = _Counted(model)
    print(f"target {model.cfg.name} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
          f"parameters, {model.cfg.num_layers} layers), draft {draft.cfg.name} "
          f"({sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M, "
          f"{draft.cfg.num_layers} layers); {len(prompts)} prompts, {args.tokens} new tokens")
    print(f"{'draft':<10}{'T':>4}{'batch':>6}{'k':>3}{'tokens/round':>14}{'plain s':>9}"
          f"{'spec s':>8}{'speed-up':>10}")
    for temperature in (0.0, 1.0):
        for batch in (1, len(prompts)):
            plain, plain_s = _timed(model, prompts, batch, args.tokens, temperature)
            for name, proposer in (("trained", draft), ("untrained", untrained)):
                for k in args.k:
                    counter.calls = 0
                    fast, fast_s = _timed(model, prompts, batch, args.tokens, temperature,
                                          proposer, k)
                    # The target's calls of one run, less its prefills.
                    rounds = counter.calls // REPEATS - len(range(0, len(prompts), batch))
                    if temperature == 0:
                        assert [c.tokens for c in fast] == [c.tokens for c in plain]
                    per_round = sum(len(c.tokens) for c in fast) / rounds / batch
                    print(f"{name:<10}{temperature:>4.1f}{batch:>6}{k:>3}{per_round:>14.2f}"
                          f"{plain_s:>9.2f}{fast_s:>8.2f}{plain_s / fast_s:>9.2f}x")


if __name__ == "__main__":
    main()
