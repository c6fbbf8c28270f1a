"""Start-up checks that need more than one field (or a file) to decide: the composed config's
keys against the schema, the model's vocabulary and special-token ids against the data, the
shape of list-valued fields, secrets where they would be written down, and the C++ compiler
that compiled kernels need on CPU. Each failure is a ConfigError naming the field, the value and
what would be valid."""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from data_pipeline.config import resolve_path
from data_pipeline.manifest import manifest_path
from data_pipeline.pipeline import is_prepared
from model.errors import ConfigError

# Environment names whose values are credentials (WANDB_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY;
# not TOKENIZERS_PARALLELISM): never into job scripts or saved configs.
SECRET_NAME = re.compile(r"(^|_)(API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?)(_|$)",
                         re.IGNORECASE)


def unknown_keys(cfg: DictConfig, path: str = "") -> list[str]:
    """Keys of `cfg` that its dataclass schema does not have (e.g. added with `+`), as
    'dotted.path (did you mean ...?)'. Fields typed as plain dicts (slurm.env) take any key."""
    schema = OmegaConf.get_type(cfg)
    found = []
    fields = ({f.name for f in dataclasses.fields(schema)}
              if dataclasses.is_dataclass(schema) else None)
    for key in cfg.keys():
        full = f"{path}.{key}" if path else str(key)
        if fields is not None and key not in fields:
            close = difflib.get_close_matches(str(key), sorted(fields), n=1)
            found.append(full + (f" (did you mean {path + '.' if path else ''}{close[0]}?)"
                                 if close else ""))
            continue
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not node._is_missing() and not node._is_none():
            found += unknown_keys(node, full)
        elif isinstance(node, ListConfig) and not node._is_missing() and not node._is_none():
            for i, item in enumerate(node):
                if isinstance(item, DictConfig):
                    found += unknown_keys(item, f"{full}[{i}]")
    return found


def check_known_keys(cfg: DictConfig) -> None:
    unknown = unknown_keys(cfg)
    if unknown:
        raise ConfigError("unknown config keys (not in the schema, so they would be ignored): "
                          + ", ".join(unknown))


def data_vocabulary(data_cfg) -> tuple[int, dict[str, int], str]:
    """(vocab size, special-token ids, where they come from) of the data this run will train
    on: the prepared manifest, else the configured tokenizer file, else the tokenizer k3-data
    will train."""
    if is_prepared(data_cfg):
        path = manifest_path(Path(data_cfg.output_dir).resolve())
        manifest = json.loads(path.read_text())
        return manifest["vocab_size"], manifest["special_tokens"], str(path)
    from data_pipeline.tokenizer import SPECIAL_TOKENS, load_tokenizer

    specials = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    if data_cfg.tokenizer.path is not None:
        path = resolve_path(data_cfg.tokenizer.path)
        try:
            return load_tokenizer(path).get_vocab_size(), specials, path
        except Exception as e:  # tokenizers raises its own exception type for a bad file
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"data.tokenizer.path={data_cfg.tokenizer.path!r}: cannot read "
                              f"the tokenizer ({e})") from e
    return data_cfg.tokenizer.vocab_size, specials, "data.tokenizer.vocab_size"


def check_model_matches_data(cfg) -> None:
    vocab, specials, source = data_vocabulary(cfg.data)
    if cfg.model.vocab_size < vocab:
        if source == "data.tokenizer.vocab_size":
            raise ConfigError(
                f"data.tokenizer.vocab_size={vocab} is invalid: must be <= model.vocab_size="
                f"{cfg.model.vocab_size} (the model has no embedding for the larger ids)")
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is invalid: the data's tokenizer has "
            f"{vocab} tokens ({source}); set model.vocab_size>={vocab}")
    for field, token in (("pad_token_id", "<pad>"), ("image_token_id", "<image>")):
        value = getattr(cfg.model, field)
        if specials.get(token) != value:
            raise ConfigError(
                f"model.{field}={value} is invalid: the data uses id {specials.get(token)} for "
                f"{token} ({source}); set model.{field}={specials.get(token)}")


def check_betas(betas) -> None:
    if len(betas) != 2:
        raise ConfigError(f"optim.betas={list(betas)!r} is invalid: must be two numbers "
                          "[beta1, beta2], e.g. [0.9, 0.95]")


def _refuse_secret(name: str) -> None:
    if SECRET_NAME.search(name):
        raise ConfigError(
            f"slurm.env.{name} is invalid: a credential there would be written into the job "
            f"script and the saved config. Export {name} in the shell that runs k3-submit "
            "(sbatch passes the environment on) or use `wandb login` (~/.netrc)")


def check_no_secrets(cfg) -> None:
    for name in cfg.slurm.env:
        _refuse_secret(name)


def check_no_secret_overrides(argv: list[str]) -> None:
    """The same check on the command line, before Hydra saves the overrides in the run
    directory (.hydra/overrides.yaml)."""
    for arg in argv:
        key = arg.split("=", 1)[0].lstrip("+~")
        if "=" in arg and key.startswith("slurm.env."):
            _refuse_secret(key[len("slurm.env."):])


def check_kernel_compiler(cfg, device) -> None:
    """fused_kernels=true and compile=true build C++ kernels on CPU (inductor): without a
    working compiler the first step would fail inside torch.compile, after the model was built
    and the data prepared."""
    wanted = [name for name in ("fused_kernels", "compile") if getattr(cfg, name)]
    if device.type != "cpu" or not wanted:
        return
    from torch._inductor import config as inductor_config
    from torch._inductor import cpp_builder, exc

    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        tried = [c for c in inductor_config.cpp.cxx if c is not None]
        raise ConfigError(
            f"{' and '.join(f'{n}=true' for n in wanted)} on CPU needs a C++ compiler (inductor "
            f"builds its kernels with it) and none of {tried} runs: install one (Debian: apt-get "
            f"install g++), point CXX at it, or set {' '.join(f'{n}=false' for n in wanted)}"
        ) from None
