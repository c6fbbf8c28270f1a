"""The error types shared across the project's layers (model, parallel, train, data_pipeline,
slurm): each of them raises these, and the command-line entry points turn them into exit codes."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field, the value and what is valid."""
