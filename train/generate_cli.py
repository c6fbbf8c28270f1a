"""`k3-generate`: completions from a k3-train run's checkpoint (saved at any layout: DCP reads it
into one process) or a `k3-export` directory, for prompts given on the command line or in a
JSONL file, tokenised with the run's tokenizer; one JSON line per prompt, printed or written.

    k3-generate run_dir=outputs/k3_tiny prompt="The river" max_new_tokens=32
    k3-generate export_dir=outputs/k3_tiny/export tokenizer=outputs/data/tokenizer.json \
        prompts_file=prompts.jsonl output=completions.jsonl temperature=0.7 top_p=0.9 seed=1

    k3-generate run_dir=outputs/k3_tiny draft_run_dir=outputs/k3_tiny_draft prompt="The river"
    k3-generate run_dir=outputs/k3_tiny_sft chat=true prompt="Where does Wyngor lie?"

Each output line: {"prompt", "completion" (the decoded new tokens), "tokens", "logprobs",
"finish_reason"}. A prompts file holds one {"prompt": str} per line. The run's tokenizer is the
one its data was tokenised with: `data.tokenizer.path` of the run's config when set, else
<data.output_dir>/tokenizer.json; an export directory needs `tokenizer=`. Generation stops at
the end-of-document token (`<eod>`, what ends every training document) unless `stop_tokens`
says otherwise (an empty list: the budget only). `chat=true` (a fine-tuned model): each prompt
is a user turn rendered with the chat template and its generation prompt (`chat_template`, null:
K3's), and the end of the assistant's turn (`<|im_end|>`) stops it too. Prompts are decoded
`batch_size` at a time; a batch's sampling seed is `seed` plus the index of its first prompt,
so a run is reproducible. With a draft (`draft_run_dir=` or `draft_export_dir=`, a K3 trained
with the same tokenizer) the draft proposes `speculative_tokens` tokens a round that the model
verifies in one call: the same completions as without it (greedy) or the same distribution
(sampling).
An existing `output` file is never overwritten.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from model.errors import ConfigError

from .cli import CONFIG_DIR, EXIT_CONFIG_ERROR, hydra_exit_codes
from .generate import sample


@dataclass
class GenerateConfig:
    run_dir: str | None = None  # a k3-train run: its newest complete checkpoint and tokenizer
    checkpoint: str | None = None  # one of the run's checkpoints instead of the newest
    export_dir: str | None = None  # a k3-export directory instead of a run
    tokenizer: str | None = None  # tokenizer.json (default: the run's)
    prompt: str | None = None
    prompts_file: str | None = None  # JSONL, {"prompt": str} per line
    output: str | None = None  # JSONL to write (default: print)
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    stop_tokens: list[str] = field(default_factory=lambda: ["<eod>"])
    batch_size: int = 8  # prompts decoded together
    device: str = "auto"
    # Speculative decoding: a draft K3 of the same tokenizer (a k3-train run, e.g. of
    # model=k3_tiny_draft on the same data, or a k3-export directory) proposing
    # speculative_tokens a round.
    draft_run_dir: str | None = None
    draft_export_dir: str | None = None
    speculative_tokens: int = 4
    # A fine-tuned chat model: each prompt is a user turn rendered with the chat template and
    # its generation prompt, and <|im_end|> (the end of the assistant's turn) stops too.
    chat: bool = False
    chat_template: str | None = None  # a Jinja file or tokenizer_config.json; null: K3's


def run_tokenizer_path(run_dir: Path) -> Path:
    """The run's tokenizer; a relative path in its config is taken from the directory k3-train
    ran in (Hydra records it), wherever k3-generate runs."""
    config = run_dir / ".hydra" / "config.yaml"
    if not config.exists():
        raise ConfigError(f"run_dir={str(run_dir)!r}: no {config} (not a k3-train run?)")
    data = OmegaConf.load(config).data
    path = (Path(data.tokenizer.path) if data.tokenizer.path is not None
            else Path(data.output_dir) / "tokenizer.json")
    hydra_record = run_dir / ".hydra" / "hydra.yaml"
    if not path.is_absolute() and hydra_record.exists():
        path = Path(OmegaConf.load(hydra_record).hydra.runtime.cwd) / path
    return path


def load_model_and_tokenizer(cfg: GenerateConfig):
    """(the model in eval mode on the CPU, the tokenizer, the draft model or None) from a run
    or an export (and the draft's)."""
    from data_pipeline.tokenizer import load_tokenizer

    if (cfg.run_dir is None) == (cfg.export_dir is None):
        raise ConfigError("give exactly one of run_dir (a k3-train run) or export_dir (a "
                          "k3-export directory)")
    if cfg.export_dir is not None and cfg.tokenizer is None:
        raise ConfigError("export_dir needs tokenizer=PATH (the tokenizer.json the run's data "
                          "was tokenised with)")
    model, run_tokenizer = load_model(cfg.run_dir, cfg.checkpoint, cfg.export_dir)
    tokenizer_path = Path(cfg.tokenizer) if cfg.tokenizer else run_tokenizer
    if not tokenizer_path.exists():
        raise ConfigError(f"tokenizer {tokenizer_path} does not exist: give tokenizer=PATH")
    tokenizer = load_tokenizer(tokenizer_path)
    draft = None
    if cfg.draft_run_dir is not None and cfg.draft_export_dir is not None:
        raise ConfigError("give at most one of draft_run_dir or draft_export_dir")
    if cfg.draft_run_dir is not None or cfg.draft_export_dir is not None:
        if cfg.speculative_tokens < 1:
            raise ConfigError(f"speculative_tokens={cfg.speculative_tokens} is invalid with a "
                              f"draft: must be >= 1")
        draft, draft_tokenizer = load_model(cfg.draft_run_dir, None, cfg.draft_export_dir)
        if draft_tokenizer is not None and (not draft_tokenizer.exists() or load_tokenizer(
                draft_tokenizer).to_str() != tokenizer.to_str()):
            raise ConfigError(f"draft_run_dir={cfg.draft_run_dir!r} was trained with tokenizer "
                              f"{draft_tokenizer}, not the model's {tokenizer_path}: a draft "
                              f"proposes the model's tokens")
    return model, tokenizer, draft


def load_model(run_dir: str | None, checkpoint: str | None, export_dir: str | None):
    """(the model in eval mode, the run's tokenizer path or None for an export) from a run's
    checkpoint (the newest unless `checkpoint`; a QAT run's with its MXFP4 forward) or a
    k3-export directory."""
    import warnings

    from .export import latest_checkpoint, load_checkpoint_model, load_exported, read_run_config

    if run_dir is None:
        return load_exported(export_dir), None
    run = Path(run_dir)
    model_cfg, precision = read_run_config(run)
    path = Path(checkpoint) if checkpoint else latest_checkpoint(run)
    with warnings.catch_warnings():  # DCP reading into one process is what is meant here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        model = load_checkpoint_model(model_cfg, path).eval()
    if precision.qat:  # the forward it trained (and its export computes): MXFP4 experts
        from .precision.qat import apply_mx_qat

        apply_mx_qat(model, scale_mode=precision.scale_mode)
    return model, run_tokenizer_path(run)


def read_prompts(cfg: GenerateConfig) -> list[str]:
    if (cfg.prompt is None) == (cfg.prompts_file is None):
        raise ConfigError("give exactly one of prompt=TEXT or prompts_file=PATH (JSONL)")
    if cfg.prompt is not None:
        return [cfg.prompt]
    prompts = []
    for number, line in enumerate(Path(cfg.prompts_file).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompts.append(str(json.loads(line)["prompt"]))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{cfg.prompts_file}:{number}: not a JSON object with a "
                              f"\"prompt\" ({e})") from e
    if not prompts:
        raise ConfigError(f"{cfg.prompts_file}: no prompts")
    return prompts


def run(cfg: GenerateConfig) -> list[dict]:
    """The completion record of every prompt, in order (module docstring)."""
    from data_pipeline.chat import encode_prompt, load_chat_template
    from data_pipeline.tokenizer import encode_text

    if cfg.output is not None and Path(cfg.output).exists():
        raise ConfigError(f"output={cfg.output!r} exists: k3-generate does not overwrite a "
                          f"file, give another path")
    model, tokenizer, draft = load_model_and_tokenizer(cfg)
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available()
                          else "cpu" if cfg.device == "auto" else cfg.device)
    model = model.to(device)
    draft = draft.to(device) if draft is not None else None
    template = load_chat_template(cfg.chat_template) if cfg.chat else None

    def encode(text: str) -> list[int]:
        if template is None:
            return encode_text(tokenizer, text)
        return encode_prompt([{"role": "user", "content": text}], tokenizer, template)

    stops = []
    for name in [*cfg.stop_tokens, *(["<|im_end|>"] if cfg.chat else [])]:
        token = tokenizer.token_to_id(name)
        if token is None:
            raise ConfigError(f"stop_tokens: {name!r} is not a token of the tokenizer")
        stops.append(token)
    texts = read_prompts(cfg)
    records = []
    for start in range(0, len(texts), cfg.batch_size):
        batch = texts[start:start + cfg.batch_size]
        ids = [encode(text) for text in batch]
        for i, tokens in enumerate(ids):
            if not tokens:
                raise ConfigError(f"prompt {start + i} tokenises to nothing: {batch[i]!r}")
        for text, completion in zip(batch, sample(
                model, ids, cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.seed + start,
                stops, draft, cfg.speculative_tokens if draft is not None else 0),
                strict=True):
            records.append({"prompt": text, "completion": tokenizer.decode(completion.tokens),
                            "tokens": completion.tokens, "logprobs": completion.logprobs,
                            "finish_reason": completion.finish_reason})
    return records


ConfigStore.instance().store(name="generate_schema", node=GenerateConfig)
_task_started = False


@hydra.main(config_path=CONFIG_DIR, config_name="generate", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    global _task_started
    _task_started = True
    try:
        records = run(OmegaConf.to_object(cfg))
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"k3-generate: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    lines = "".join(json.dumps(r) + "\n" for r in records)
    output = OmegaConf.select(cfg, "output")
    if output is None:
        sys.stdout.write(lines)
    else:
        Path(output).write_text(lines)


def main() -> None:
    hydra_exit_codes(_hydra_main, lambda: _task_started)


if __name__ == "__main__":
    main()
