"""Quiet by default: the console shows one progress bar per stage and the summary; datatrove's
and megatron's INFO logs only with data.verbose=true (k3-train: logging.verbose=true). Every
task's full log stays in <output_dir>/logs/<stage>/logs/.

datatrove sets up each task's loguru sinks itself (console at INFO, the task's log file at
DEBUG) and restores its default console sink after the task; the two functions here replace
that set-up, with the console level from K3_DATA_VERBOSE, an environment variable so that worker
processes and Slurm jobs (sbatch --export=ALL) see it. The replacement is installed on import:
records.py, which every pipeline step uses, imports this module, so worker processes and jobs
install it too.
"""

from __future__ import annotations

import logging
import os
import sys

import datatrove.executor.base as executor_base
from datatrove.utils.logging import logger  # loguru

VERBOSE_ENV = "K3_DATA_VERBOSE"
_FORMAT = ("{time:YYYY-MM-DD HH:mm:ss.SSS} | <level>{level: <8}</level> | "
           "{name}:{function}:{line} - <level>{message}</level>")


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def console_level(local_rank: int = 0) -> str:
    return "INFO" if verbose() and local_rank == 0 else "WARNING"


def _console() -> None:
    """This process's loguru sinks: only the console."""
    logger.remove()
    logger.add(sys.stderr, level=console_level(), format=_FORMAT)


def quiet_task_logger(logging_dir, rank: int, local_rank: int = 0, node_rank: int = -1):
    logger.remove()
    logfile = logging_dir.open(f"logs/task_{rank:05d}.log", "w")
    prefix = f"[NODE {node_rank}] " if node_rank != -1 else ""
    logger.add(sys.stderr, level=console_level(local_rank), format=prefix + _FORMAT)
    logger.add(logfile, level="DEBUG", format=prefix + _FORMAT, colorize=False)
    return logfile


def quiet_close_task_logger(logfile) -> None:
    logger.complete()
    _console()
    logfile.close()


# looked up at each task's start and end
executor_base.add_task_logger = quiet_task_logger
executor_base.close_task_logger = quiet_close_task_logger


def set_verbosity(verbose_logs: bool) -> None:
    """For this process and the workers and jobs it starts."""
    os.environ[VERBOSE_ENV] = "1" if verbose_logs else "0"
    _console()
    if verbose_logs:
        logging.basicConfig(level=logging.INFO)
    logging.getLogger("megatron").setLevel(logging.INFO if verbose_logs else logging.WARNING)
