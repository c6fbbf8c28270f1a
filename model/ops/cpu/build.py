"""Builds native_kernels.c with the system C compiler into a per-user cache directory and loads
it; the next processes load the built library from there without compiling. Where that cannot
be done (no compiler, a cache directory of others, a library that does not load) it warns and
returns None."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("native_kernels.c")
# -march=native: the library is built by and for this machine (its cache key holds the CPU
# flags, and the default cache directory is local to the node).
# -fno-math-errno lets the vectoriser call libmvec's expf/tanhf; no -ffast-math (NaN and inf
# behave as in torch).
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")


def load() -> ctypes.CDLL | None:
    """The library, built first where the cache has none for this source, compiler and CPU."""
    compiler = os.environ.get("CC", "cc")
    compiler_path = shutil.which(compiler)
    if compiler_path is None:
        return _unavailable(f"no C compiler {compiler!r} (set CC or install gcc)")
    try:  # a cache directory that cannot be made, a compiler that cannot run
        cache = cache_dir()
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        owner = cache.stat()
        if owner.st_uid != os.getuid() or owner.st_mode & 0o022:
            return _unavailable(f"{cache} is not this user's own directory (set "
                                f"K3_NATIVE_CACHE to one)")
        built = cache / f"k3_native_kernels-{_build_key(compiler_path)}.so"
        if not built.exists():
            error = _build(compiler, built)
            if error is not None:
                return _unavailable(error)
        try:  # e.g. a C library without glibc's vector math functions
            return ctypes.CDLL(str(built))
        except OSError as err:
            return _unavailable(f"the built library does not load: {err}")
    except OSError as err:
        return _unavailable(f"building them failed: {err}")


def cache_dir() -> Path:
    """Where built libraries stay for the next process: K3_NATIVE_CACHE, else this user's
    directory in the machine's temporary directory (local to the node, as the -march=native
    build must be)."""
    configured = os.environ.get("K3_NATIVE_CACHE")
    return Path(configured or Path(tempfile.gettempdir()) / f"k3-native-{os.getuid()}")


def _build_key(compiler_path: str) -> str:
    """The source, flags, compiler and CPU a library was built from: a change builds anew."""
    cpu = Path("/proc/cpuinfo")
    flags = [line for line in cpu.read_text().splitlines()
             if line.startswith("flags")][:1] if cpu.exists() else []
    stat = os.stat(compiler_path)
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(repr((FLAGS, compiler_path, stat.st_size, stat.st_mtime_ns,
                        platform.machine(), flags)).encode())
    return digest.hexdigest()[:24]


def _build(compiler: str, built: Path) -> str | None:
    """Compiles into `built` (written whole under another name, then renamed: processes that
    build at once each get a complete library); the error, or None."""
    fd, partial = tempfile.mkstemp(dir=built.parent, suffix=".so.partial")
    os.close(fd)
    try:
        cmd = [compiler, *FLAGS, str(SOURCE), "-o", partial, "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            return f"`{' '.join(cmd)}` failed: {result.stderr.strip()[-500:]}"
        os.replace(partial, built)
        return None
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _unavailable(why: str) -> None:
    warnings.warn(f"native CPU kernels unavailable, using torch ops: {why}", stacklevel=4)
    return None
