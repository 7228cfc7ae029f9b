"""Triton on first use: the kernel files import without triton, and jit their kernels when one first runs.

A kernel file writes its Triton kernels as plain functions, keeps `triton = tl = None` as module globals,
and builds its loader once:

    _triton = lazy_triton(globals(), ("_tile", "_gelu_kernel"))

`_triton()` then imports triton (reading TRITON_INTERPRET at that moment), binds `triton` and `tl` in the
file's globals (where the jitted kernels look them up), replaces each named function by `triton.jit` of
it, and returns the triton module; later calls return it at once.
"""
from __future__ import annotations

import functools
from typing import Any, Callable


def lazy_triton(namespace: dict[str, Any], kernels: tuple[str, ...]) -> Callable[[], Any]:
    """A cached loader that imports triton and jits `kernels` (names in `namespace`) in place."""

    @functools.cache
    def load():
        import triton
        import triton.language as tl

        namespace["triton"], namespace["tl"] = triton, tl
        for name in kernels:
            namespace[name] = triton.jit(namespace[name])
        return triton

    return load
