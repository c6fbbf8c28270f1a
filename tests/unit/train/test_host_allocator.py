"""k3-train keeps freed host memory for the next step (train/host_allocator.py): a freed block
below 32 MiB is not handed back to the kernel, so the next step does not fault its pages in
again. Each case runs in its own process (malloc's settings are process-wide)."""

import json
import platform
import subprocess
import sys

import pytest

from tests.helpers.train_helpers import REPO

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                                reason="the thresholds are glibc's")

PROBE = """
import ctypes, json
import torch
from train.host_allocator import keep_freed_host_memory

said = keep_freed_host_memory()
libc = ctypes.CDLL(None)
libc.sbrk.restype = ctypes.c_void_p
libc.sbrk.argtypes = [ctypes.c_ssize_t]
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
block = torch.empty(4 << 20)  # 16 MiB: glibc's first threshold is 128 KiB
in_heap = block.data_ptr() < libc.sbrk(0)  # not mapped on its own
del block
blocks = [libc.malloc(4 << 20) for _ in range(16)]  # 64 MiB at the heap's top, then freed
top = libc.sbrk(0)
for b in blocks:
    libc.free(b)
print(json.dumps({"said": said, "in_heap": in_heap, "top_kept": libc.sbrk(0) == top}))
"""


def _probe(keep: str) -> dict:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "K3_KEEP_HOST_MEMORY": keep}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_freed_blocks_stay_in_the_heap():
    got = _probe("1")
    assert got == {"said": "freed blocks up to 32 MiB kept (glibc mmap threshold), heap "
                           "trimmed past 1 GiB", "in_heap": True, "top_kept": True}


def test_the_environment_keeps_glibcs_defaults():
    got = _probe("0")
    assert got == {"said": "glibc defaults (K3_KEEP_HOST_MEMORY=0)", "in_heap": False,
                   "top_kept": False}
