"""ZeroContext: one step of a ZeRO program, and ZeroStats, what its gathers did.

The ZeRO ops (runtime/ops/zero.py) find the context of the step being run through ops.zero.active_context():
zero_gather registers each gathered bucket with it, so that autograd's saved-tensor hooks keep handles
instead of gathered parameters (re-gathered in backward); zero_reduce finds the master shards through it.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch

from meshc.compiler.ir import torch_compat as compat

from meshc.runtime.ops.zero import BucketMeta, PendingGrads, activate, unpack_bucket, deactivate, zero_gather_start


@dataclass
class ZeroStats:
    """What the gathers did in the last step: counts, and bytes of gathered parameters alive."""

    gathers_forward: int = 0
    gathers_backward: int = 0
    live_bytes: int = 0
    peak_bytes_backward: int = 0
    live_after_forward: int = 0
    kept_bytes: int = 0  # the bucket kept gathered from forward to backward (Plan.zero_keep_last)
    bucket_bytes: dict = field(default_factory=dict)


@dataclass
class _Saved:
    bucket: int
    index: int
    size: tuple
    stride: tuple
    offset: int


HELD = 2  # buckets holding() keeps gathered at most


class ZeroContext:
    """One step of a ZeRO program: keeps gathered parameters out of autograd's saved tensors (handles
    instead, re-gathered in backward) and tells zero_reduce where the master shards are."""

    def __init__(self, masters: dict[str, torch.Tensor], stats: ZeroStats, overlap: bool = True):
        self.masters = masters
        self.stats = stats
        # storage (weak, by identity: distinct even for empty storages) -> (bucket, index, token of the entry)
        self.storages: dict = {}
        self.buckets: dict[int, tuple[BucketMeta, tuple]] = {}
        self.outstanding: dict[int, int] = {}  # bucket -> saved handles not yet unpacked
        self.regathered: dict[int, list] = {}
        self.prefetched: dict[int, tuple[torch.Tensor, int]] = {}  # bucket -> (un-waited gather, bytes)
        self.pending = PendingGrads() if overlap else None  # None: gradients return through autograd
        self._token = None
        self._hooks = None
        self.held: list[int] | None = None  # inside holding(): the buckets kept gathered, least recently used first

    def __enter__(self):
        self._token = activate(self)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._hooks = None  # it holds our bound methods: kept, it would make a reference cycle of every step's
        # context, freed by the cyclic collector at an arbitrary moment on whatever thread runs it
        deactivate(self._token)
        self.stats.live_after_forward = self.stats.live_bytes
        return False

    def register(self, meta: BucketMeta, shards: tuple, full: tuple, recompute: bool = True) -> None:
        self.buckets[meta.bucket] = (meta, shards)
        self.stats.gathers_forward += 1
        self.stats.bucket_bytes[meta.bucket] = sum(t.numel() * t.element_size() for t in full)
        if not recompute:
            self.stats.kept_bytes += self.stats.bucket_bytes[meta.bucket]
            return
        for i, t in enumerate(full):
            self._track(t, meta.bucket, i)

    def _track(self, t: torch.Tensor, bucket: int, index: int) -> None:
        key, token = compat.storage_key(t), object()
        self.storages[key] = (bucket, index, token)
        nbytes = t.numel() * t.element_size()
        self.stats.live_bytes += nbytes
        # a plain function over the dict and the stats, not a bound method: a tracked tensor does not keep
        # the whole context alive, and its death removes its own entry only
        weakref.finalize(t, _release, self.storages, key, token, self.stats, nbytes)

    def _pack(self, t: torch.Tensor):
        where = self.storages.get(compat.storage_key(t)) if t.device.type != "meta" else None
        if where is None:
            return t
        bucket, index, _ = where
        self.outstanding[bucket] = self.outstanding.get(bucket, 0) + 1
        return _Saved(bucket, index, tuple(t.size()), tuple(t.stride()), t.storage_offset())

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        full = self.regathered.get(saved.bucket)
        if full is None:
            full = self._regather(saved.bucket)
        self.outstanding[saved.bucket] -= 1
        if self.outstanding[saved.bucket] <= 0:  # a retained graph may unpack again: it gathers again then
            self._done_with(saved.bucket)
        self.stats.peak_bytes_backward = max(self.stats.peak_bytes_backward, self.stats.live_bytes)
        return full[saved.index].as_strided(saved.size, saved.stride, saved.offset)

    @contextlib.contextmanager
    def holding(self):
        """Inside the block, gather each bucket once however often autograd unpacks it, keeping the last HELD.

        Zero-bubble's W (runtime/pipeline/backward_split.py) runs again nodes that I ran on a retained graph; autograd
        unpacks every saved tensor of a node it runs, needed or not, so each of those nodes unpacks its saved
        parameters once more, after I released their buckets. Without this, each such unpack gathered its whole
        bucket again (a ZeRO-3 stage's W: one all-gather per weight op instead of one per bucket)."""
        self.held = []
        try:
            yield self
        finally:
            for bucket in self.held:
                self.regathered.pop(bucket, None)
            self.held = None

    def _done_with(self, bucket: int) -> None:
        """No saved handle of `bucket` waits to be unpacked: release it, or inside holding() keep it among the
        HELD buckets used last (W reruns its nodes in I's order, layer after layer: the buckets of a layer are
        unpacked together, so W gathers each once while holding no more than B does)."""
        if self.held is None:
            self.regathered.pop(bucket, None)
            return
        if bucket in self.held:
            self.held.remove(bucket)
        self.held.append(bucket)
        while len(self.held) > HELD:
            self.regathered.pop(self.held.pop(0), None)

    def _regather(self, bucket: int) -> list[torch.Tensor]:
        meta, shards = self.buckets[bucket]
        if bucket in self.prefetched:
            raw, nbytes = self.prefetched.pop(bucket)
            self.stats.live_bytes -= nbytes
        else:
            raw = self._start(bucket)
        full = unpack_bucket(compat.wait(raw), meta)
        for i, t in enumerate(full):
            self._track(t, bucket, i)
        self.regathered[bucket] = full
        self.stats.gathers_backward += 1
        self._prefetch_before(bucket)
        return full

    def _start(self, bucket: int) -> torch.Tensor:
        meta, shards = self.buckets[bucket]
        return zero_gather_start(*shards, group=meta.group, size=meta.n, dtype=meta.dtype, fused=meta.fused,
                                 offloaded=meta.offloaded)

    def _prefetch_before(self, bucket: int) -> None:
        """Backward needs the buckets in reverse: issue the next one's gather now, to overlap this block."""
        waiting = [b for b, count in self.outstanding.items()
                   if count > 0 and b < bucket and b not in self.regathered and b not in self.prefetched]
        if waiting:
            b = max(waiting)
            nbytes = self.stats.bucket_bytes[b]
            self.prefetched[b] = (self._start(b), nbytes)
            self.stats.live_bytes += nbytes
            self.stats.peak_bytes_backward = max(self.stats.peak_bytes_backward, self.stats.live_bytes)


def _release(storages: dict, key, token, stats: ZeroStats, nbytes: int) -> None:
    """A tracked gathered parameter died: drop its entry (if still the one it registered) and its bytes."""
    entry = storages.get(key)
    if entry is not None and entry[2] is token:
        del storages[key]
    stats.live_bytes -= nbytes
