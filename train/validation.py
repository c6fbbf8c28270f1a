"""Validation loss on the held-out split (`k3-data`'s validation/ shards): every `eval.every`
steps, the token-weighted mean loss over the first `eval.batches` global batches of the split.
The same batches every time (so evaluations are comparable), the same rows for every
data-parallel layout (the loader's global-batch contract), forward only, with Quantile Balancing
statistics untouched (the model is in eval mode)."""

from __future__ import annotations

import torch

from data_pipeline.loader import K3DataLoader
from model.errors import ConfigError

from .distributed import DistEnv


class Validator:
    def __init__(self, cfg, manifest, dp_rank: int, dp_size: int):
        try:
            self.source = K3DataLoader.from_stage(manifest, cfg.stage, dp_rank=dp_rank,
                                                  dp_world_size=dp_size, vision=cfg.model.vision,
                                                  split="validation").source
        except ValueError as e:  # too few held-out rows for one global batch
            raise ConfigError(
                f"eval.every={cfg.eval.every}: the validation split of {manifest} is too small "
                f"({e}); raise data.validation_fraction (re-run k3-data), lower "
                "stage.global_batch_size, or set eval.every=0") from e
        self.micro_batches = cfg.eval.batches * self.source.grad_accum

    @staticmethod
    def due(cfg, step: int) -> bool:
        every = cfg.eval.every
        return every > 0 and (step % every == 0 or step == cfg.steps)

    @torch.no_grad()
    def loss(self, model: torch.nn.Module, env: DistEnv, precision, parallel) -> float:
        """Mean loss over the held-out batches. `parallel` (the layout's ParallelPlan) gives
        this rank's part of each (its context-parallel fragment), the forwards (through the
        pipeline's stages under pipeline parallelism), the loss context (vocabulary-parallel
        cross entropy) and the sums over the ranks that hold different tokens (dp x cp:
        tensor-parallel ranks see the same ones)."""
        was_training = model.training
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=env.device)  # loss sum, tokens
        per_batch = self.source.grad_accum  # a global batch's micro-batches: one schedule run
        try:
            for first in range(0, self.micro_batches, per_batch):
                batches = [parallel.local_batch(self.source[s]).to(env.device)
                           for s in range(first, first + per_batch)]
                with parallel.loss_context(), precision.autocast():
                    total += parallel.eval_loss_sums(model, batches).to(env.device)
        finally:
            model.train(was_training)
        loss_sum, tokens = parallel.sum_loss_tokens(total).tolist()
        return loss_sum / max(tokens, 1.0)
