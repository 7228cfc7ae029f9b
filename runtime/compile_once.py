"""One compile per distinct graph across the ranks of a run (issue 42, item 5).

Ranks whose programs differ only in which group of an axis they use (the dp ranks of a tp slice, the tp ranks of a
ZeRO-3 model: same shapes, other groups) hand Inductor the same graph once their collectives name each axis by its
alias (Mesh.aliases: "dp@5" on every rank). Inductor's FX graph cache would then serve every rank but the first,
were they not all compiling at the same moment: each would miss and compile it again. So each compile holds a file
lock named by the graph (its code, its inputs' metadata, the constants it reads and the compile options) in
Inductor's cache folder: the first rank compiles, the others wait and then read its result from the cache. Graphs
that differ take different locks and compile side by side, as before.

A rank holds a lock only while compiling, which waits on nobody (no collective runs in a compile), so no lock waits
on a collective; the operating system releases the lock of a rank that dies. AOTAutograd's backward is compiled with
its forward (compat.inductor_compile), so both are done under the lock.
"""
from __future__ import annotations

import contextlib
import hashlib
import os

import filelock
import torch
from torch import fx

from meshc.compiler.ir import torch_compat as compat

LOCK_TIMEOUT_S = 1800.0  # longer than any compile; past it, a rank compiles by itself


def graph_key(gm: fx.GraphModule, args: list, options: object) -> str:
    """A name for what Inductor would compile: the graph's code, its inputs' metadata, its constants' values (a
    rank's own offsets may live there) and the options; equal keys on two ranks mean equal compiles."""
    h = hashlib.sha256(gm.code.encode())
    for a in args:
        h.update(repr(signature(a)).encode())
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = _attr(gm, node.target)
            h.update(f"{node.target}={signature(value)}".encode())
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    h.update(repr(options).encode())
    return h.hexdigest()[:40]


@contextlib.contextmanager
def compiling_once(key: str):
    """Hold the run's lock for the graph named `key` while compiling it (module docstring)."""
    folder = os.path.join(compat.inductor_cache_dir(), "meshc-locks")
    os.makedirs(folder, exist_ok=True)
    lock = filelock.FileLock(os.path.join(folder, f"{key}.lock"))
    try:
        lock.acquire(timeout=LOCK_TIMEOUT_S)
    except filelock.Timeout:  # a compile past any reasonable time: do not wait on it
        yield
        return
    try:
        yield
    finally:
        lock.release()


def signature(a: object) -> object:
    """What compiled code is specialized to in an input: a tensor's shape, strides (the code asserts them), dtype,
    device and requires_grad; anything else by its repr."""
    if isinstance(a, torch.Tensor):
        return (tuple(a.shape), tuple(a.stride()), a.dtype, a.device.type, a.requires_grad)
    return repr(a)


def _attr(gm: fx.GraphModule, target: str) -> object:
    value: object = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value
