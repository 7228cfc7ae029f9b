"""Offloaded parameter shards read for ZeRO-3's gather, then their pages dropped: `meshc_offload::pack_dropping`.

    local = pack_dropping(shards, dtype)   # the bucket's send buffer; the shards' mapped pages let go

With Plan.offload_params the master shards are views of a file's shared mapping (runtime/zero/offload.py): reading
one faults its pages into the process. A bucket's gather reads its shards once into the buffer it sends, and after
that the pages are dead weight until the next gather, so this op packs the shards (one rank's part of the bucket:
the flat shards cast and concatenated) and then drops their pages (madvise(MADV_DONTNEED): the values stay in the
file and the page cache; the next read faults them in again). It is one op in the graph, not a call behind it,
so the same thing runs whether the program runs as FX code or as Inductor's code, where it is an extern kernel
called in the gather's place, forward and in the backward's recomputed gather alike. Inductor cannot fuse the pack
into its own kernels then: only buckets of offloaded shards take this op (passes/zero.py, the gather's
`offloaded`).

Only pages of a registered mapping are dropped (`register`: the offload's file mapping, held weakly): MADV_DONTNEED
on anonymous memory would zero it. A tensor is dropped where its storage is a registered mapping's, alive; any
other tensor is only read.
"""
from __future__ import annotations

import ctypes
import weakref

import torch
from torch import Tensor

PAGE = 4096
MADV_DONTNEED = 4

# storage address -> the mapping tensor that registered it (weak: a mapping that dies is forgotten)
_MAPPINGS: "weakref.WeakValueDictionary[int, Tensor]" = weakref.WeakValueDictionary()
_LIBC = None


def register(mapping: Tensor) -> None:
    """Pages of tensors in `mapping`'s storage (a shared file mapping) may be dropped from now on."""
    if mapping.numel() > 0:
        _MAPPINGS[mapping.untyped_storage().data_ptr()] = mapping


def unregister(mapping: Tensor) -> None:
    if mapping.numel() > 0:
        _MAPPINGS.pop(mapping.untyped_storage().data_ptr(), None)


def drop(tensors) -> None:
    """Drop from this process the pages of `tensors` that lie in a registered mapping (others are left alone)."""
    for t in tensors:
        mapping = _MAPPINGS.get(t.untyped_storage().data_ptr()) if t.numel() > 0 else None
        if mapping is None:
            continue
        lo = mapping.untyped_storage().data_ptr()
        hi = lo + mapping.untyped_storage().nbytes()
        start = max(lo, t.data_ptr() // PAGE * PAGE)
        end = min(hi, -(-(t.data_ptr() + t.numel() * t.element_size()) // PAGE) * PAGE)
        if start < end:
            _madvise(start, end - start)


def pack_dropping(shards: list[Tensor], dtype: torch.dtype) -> Tensor:
    return torch.ops.meshc_offload.pack_dropping(list(shards), dtype)


@torch.library.custom_op("meshc_offload::pack_dropping", mutates_args=())
def _pack_dropping(shards: list[Tensor], dtype: torch.dtype) -> Tensor:
    out = torch.cat([t.reshape(-1).to(dtype) for t in shards])  # a new tensor, never a view of a shard
    drop(shards)
    return out


@_pack_dropping.register_fake
def _pack_dropping_fake(shards, dtype):
    return torch.empty(sum(t.numel() for t in shards), dtype=dtype, device=shards[0].device)


def _madvise(address: int, length: int) -> None:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _LIBC.madvise(address, length, MADV_DONTNEED)  # advice only: a failure leaves the pages resident, nothing else
