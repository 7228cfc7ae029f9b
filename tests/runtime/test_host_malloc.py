"""runtime/host_malloc.py through meshc.mesh(): large blocks come from the heap, and the heap a step freed stays with
the process for the next step. Each case runs in a fresh interpreter (mallopt settings are per process)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys
import torch
import meshc

def heap():
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith("[heap]"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                return lo, hi
    return 0, 0

mesh = meshc.mesh(host_malloc=True) if sys.argv[1] == "1" else meshc.mesh()  # the default: glibc's settings
big = torch.ones(4 * 2**20)  # 16 MiB: above glibc's first mmap threshold (128 KiB), below the tuned one (32 MiB)
lo, hi = heap()
on_heap = lo <= big.data_ptr() < hi
del big
xs = [torch.ones(2**18) for _ in range(100)]  # a step's 100 MiB of 1 MiB tensors, then freed
def size():
    lo, hi = heap()
    return hi - lo

grown = size()
del xs
print(json.dumps({"tuned": mesh.host_malloc, "on_heap": on_heap, "grown": grown, "kept": size()}))
"""


def _run(flag: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, "1" if flag else "0"], capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc/self/maps")
def test_host_malloc_keeps_large_blocks_on_the_heap_and_the_default_leaves_glibc_alone():
    tuned, default = _run(True), _run(False)
    assert tuned["tuned"] and not default["tuned"]
    assert tuned["on_heap"] and not default["on_heap"], (tuned, default)  # glibc's default maps 16 MiB apart
    # the 100 MiB freed stays in the heap for the next step (glibc's default trims what is free at its top)
    assert tuned["grown"] >= 100 * 2**20 and tuned["kept"] >= tuned["grown"], tuned
