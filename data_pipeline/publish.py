"""A dataset is never deleted or overwritten implicitly. A run builds into `<output_dir>.partial`
beside the output and, once the manifest is written, swaps it in for output_dir in one atomic
rename (renameat2 RENAME_EXCHANGE; where the file system has no exchange, two renames through
`<output_dir>.replaced`). Until then output_dir keeps the dataset it held; a non-empty
output_dir is replaced only with data.overwrite=true.

    python -m data_pipeline.publish <partial> <output_dir>   # the last line of the Slurm job
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
from pathlib import Path

from model.errors import ConfigError

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def partial_dir(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def replaced_dir(out: Path) -> Path:
    return out.with_name(out.name + ".replaced")


def is_empty(out: Path) -> bool:
    return not out.exists() or (out.is_dir() and next(out.iterdir(), None) is None)


def check_writable(out: Path, overwrite: bool) -> None:
    """Refuses to start a run that would replace something without data.overwrite=true."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"data.output_dir={str(out)!r} is invalid: it is a file, not a folder")
    if replaced_dir(out).exists():
        raise ConfigError(f"{replaced_dir(out)} holds the dataset an interrupted swap replaced "
                          f"(the new one is {out if out.exists() else partial_dir(out)}); move "
                          f"or remove it first")
    if not overwrite and not is_empty(out):
        what = ("a complete dataset" if (out / "manifest.json").exists()
                else "files (an unfinished dataset or other data)")
        raise ConfigError(f"data.output_dir={str(out)!r} holds {what}; k3-data does not "
                          f"replace it implicitly. Choose another data.output_dir, or add "
                          f"data.overwrite=true to replace it once the new dataset is complete")


def _exchange(a: Path, b: Path) -> bool:
    """Swaps two paths atomically; False where the file system cannot (e.g. NFS)."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def publish(partial: Path, out: Path) -> None:
    """Puts the finished build `partial` at `out`, then removes what `out` held before."""
    if not out.exists():
        partial.rename(out)
        return
    if _exchange(partial, out):
        shutil.rmtree(partial)  # now the replaced dataset
        return
    old = replaced_dir(out)
    out.rename(old)
    partial.rename(out)
    shutil.rmtree(old)


if __name__ == "__main__":
    publish(Path(sys.argv[1]), Path(sys.argv[2]))
