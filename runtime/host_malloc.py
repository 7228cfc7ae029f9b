"""Host memory allocator settings for training on CPUs (glibc's malloc, through mallopt).

torch's CPU tensors come from the C library's malloc. glibc's defaults suit programs that allocate little:
blocks above its mmap threshold (128 KiB at start, raised on the fly as large blocks are freed) are mapped
fresh, and free memory at the top of the heap above its trim threshold goes back to the kernel. A training
step allocates and frees the same large tensors every step (gradients, activations, gradient buckets), so
under those defaults each step touches freshly mapped pages again, one page fault per 4 KiB. On the 2-core
machine (4 gloo ranks, GPT of 1.7M and 3.3M parameters, dp=4) that was 440 and 2,550 minor faults per step
per rank, and the steps ran 10% and 15% slower than with large blocks kept on the heap (README, planner
suite), a cost that grows with the model's bytes and that no calibration of
compute or links prices.

`tune()` keeps them: blocks up to 32 MiB (glibc's largest allowed mmap threshold on 64-bit) come from the
heap and up to 2 GiB of freed heap memory stays with the process (the trim threshold). Setting either one alone turns
glibc's adjustment off and is worse than the defaults (measured: every block above 128 KiB mapped fresh,
5,500 faults per step), so both are set together. The price: a process's resident memory stays near its
peak after tensors are freed, and the heap's fragments raise the peak too (a ZeRO-3 run of a 476 MiB model on 4
ranks: 1,465-1,623 MiB per rank against 1,085 with glibc's defaults). So it is opt-in:
`meshc.mesh(host_malloc=True)` calls it for CPU worlds; the default leaves the C library's settings alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: 2 GiB


@functools.lru_cache(maxsize=1)
def tune() -> bool:
    """Set glibc's mmap and trim thresholds for a training process, once; False where the C library is not
    glibc (no mallopt) or refuses a setting."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) & bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
