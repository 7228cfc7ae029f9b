"""ZeRO ops at run time: flat shards, bucketed gathers with recompute in backward, and reduce-scatters.

Graph nodes inserted by passes/zero.py call these functions on plain local tensors:

    raw  = zero_gather_start(*shards, ...)      issue the bucket's all-gather (async), no autograd
    full = zero_gather(raw, *shards, ...)       wait, copy out each full parameter; backward: one
                                                reduce-scatter of the bucket's gradients (ZeRO-3)
    full = zero_reduce(*params, ...)            identity; backward: reduce-scatter the bucket's
                                                gradients into the master shards' .grad (ZeRO-2)

A gathered parameter must not live until backward. While a job runs its graph under a ZeroContext
(runtime/zero/context.py),
autograd's saved-tensor hooks replace every saved gathered parameter (or view of one) by a handle; the
parameter is freed after its last forward use, and backward gathers its bucket again when it first
needs it (SimpleFSDP's recompute of the all-gather), keeping it only until its last saved use.

Flat shard layout: a parameter of n elements is zero-padded to s*N (s = ceil(n / N)) and rank r holds
elements [r*s, (r+1)*s). A bucket's collective buffer is rank-major: rank r's part is the concatenation
of its shards of every parameter in the bucket.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass

import torch

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.ir.errors import MeshcRuntimeError
from meshc.runtime.ops.pages import pack_dropping

# The ZeRO context of the step being run (runtime/zero/context.ZeroContext), if any: the gather registers
# its buckets with it and the ZeRO-2 reduce finds the master shards through it. Set by that context alone.
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("meshc_zero", default=None)


def active_context():
    """The ZeRO context of the step being run, or None."""
    return _ACTIVE.get()


def activate(context) -> contextvars.Token:
    """Make `context` the active ZeRO context (the runtime's ZeroContext on entering a step)."""
    return _ACTIVE.set(context)


@contextlib.contextmanager
def no_context():
    """No ZeRO context inside: a graph traced for Inductor (runtime/inductor.py) in the middle of a step whose
    gathers run as FX code must record the graph's own ZeRO ops (gradients returned, not handed to the context's
    pending reduce-scatters), since the compiled code runs without Python."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def deactivate(token: contextvars.Token) -> None:
    _ACTIVE.reset(token)


def shard_size(numel: int, n: int) -> int:
    return -(-numel // n)


def flat_shard(t: torch.Tensor, n: int, index: int) -> torch.Tensor:
    """Rank `index`'s flat shard of `t` (a padded copy)."""
    s = shard_size(t.numel(), n)
    flat = t.detach().reshape(-1)
    out = torch.zeros(s, dtype=t.dtype, device=t.device)
    part = flat[index * s: (index + 1) * s]
    out[: part.numel()] = part
    return out


def pack(tensors: list[torch.Tensor], sizes: list[int], dtype: torch.dtype, n: int) -> torch.Tensor:
    """Rank-major flat buffer of `n` chunks: chunk r holds the r-th padded slice of every tensor."""
    rows = []
    for t, s in zip(tensors, sizes):
        flat = t.reshape(-1).to(dtype)
        if flat.numel() < s * n:
            flat = torch.cat([flat, flat.new_zeros(s * n - flat.numel())])
        rows.append(flat.view(n, s))
    return torch.cat(rows, dim=1).reshape(-1)  # (n * sum(sizes),)


def unpack(buffer: torch.Tensor, sizes: list[int], numels: list[int], shapes: list, n: int) -> list[torch.Tensor]:
    """Copy each tensor out of a rank-major gathered buffer (contiguous, its own storage)."""
    table = buffer.view(n, sum(sizes))
    out, offset = [], 0
    for s, numel, shape in zip(sizes, numels, shapes):
        out.append(table[:, offset: offset + s].reshape(-1)[:numel].reshape(shape).clone())
        offset += s
    return out


def _pack(tensors: list[torch.Tensor], sizes: list[int], dtype: torch.dtype, n: int, fused: bool) -> torch.Tensor:
    if fused:  # one kernel: cast, pad and interleave every tensor (kernels/zero_copy.py)
        from meshc.kernels.zero_copy import pack_cast

        return pack_cast(tensors, dtype, world_size=n, shard_numels=sizes)
    return pack(tensors, sizes, dtype, n)


def unpack_bucket(buffer: torch.Tensor, meta) -> list[torch.Tensor]:
    if meta.fused:
        from meshc.kernels.zero_copy import unpack as unpack_kernel

        return list(unpack_kernel(buffer, meta.shapes, world_size=meta.n, shard_numels=meta.sizes))
    return unpack(buffer, meta.sizes, meta.numels, meta.shapes, meta.n)


def _reduce_scatter_start(grads, meta) -> torch.Tensor:
    """Issue the bucket's gradient reduction: summed over the partial groups, then a reduce-scatter over
    the bucket's group of the gradients pre-scaled by 1/dp (an average over data parallelism: the group is dp,
    or edp for experts, whose ep group's sum is already in); returns the un-waited local result."""
    filled = [g if g is not None else torch.zeros(shape, dtype=meta.reduce_dtype) for g, shape in zip(grads, meta.shapes)]
    flat = _pack(filled, meta.sizes, meta.reduce_dtype, meta.n, meta.fused).div_(meta.average or meta.n)
    for g in meta.partial:
        flat = compat.all_reduce_sum(flat, g)
    return compat.reduce_scatter_start(flat, meta.n, meta.group)  # (sum(sizes),) once waited


def reduced(raw: torch.Tensor, meta) -> torch.Tensor:
    """A bucket's reduce-scatter waited; under hybrid sharding (meta.replicas: the dpr group) its shard summed over
    the replica groups too, so every copy of the shard ends with the gradient of all dp ranks."""
    local = compat.wait(raw)
    return compat.all_reduce_sum(local, meta.replicas) if meta.replicas else local


class PendingGrads:
    """One backward's reduce-scatters in flight: backward goes on computing while they run. At most
    IN_FLIGHT are: issuing one more first completes the oldest (each holds its bucket's whole packed
    gradients until waited: unbounded, a rank would hold the gradients of the whole model at the end of
    backward, measured 400 MiB of a 424 MiB model on 4 ranks, as ZeRO-3 must not). What is left is completed
    by a callback autograd runs after the last node. Completing one adds its result to its shards' .grad."""

    IN_FLIGHT = 2

    def __init__(self):
        self.items: list[tuple[torch.Tensor, tuple, list]] = []
        self.queued = False

    def add(self, raw: torch.Tensor, targets: tuple, meta: "BucketMeta") -> None:
        if not self.queued:
            compat.queue_backward_callback(self.finish)
            self.queued = True
        while len(self.items) >= self.IN_FLIGHT:
            self._complete(*self.items.pop(0))
        self.items.append((raw, targets, meta))

    def finish(self) -> None:
        items, self.items, self.queued = self.items, [], False
        for item in items:
            self._complete(*item)

    @staticmethod
    def _complete(raw: torch.Tensor, targets: tuple, meta: "BucketMeta") -> None:
        for shard, g in zip(targets, reduced(raw, meta).split(meta.sizes)):
            if not shard.requires_grad:
                continue
            g = g.to(shard.dtype)
            shard.grad = g if shard.grad is None else shard.grad.add_(g)


# ---------------------------------------------------------------------------------------- ZeRO-3
def zero_gather_start(*shards: torch.Tensor, group: str, size: int, dtype: torch.dtype,
                      fused: bool = False, offloaded: bool = False) -> torch.Tensor:
    """Issue the all-gather of a bucket of flat shards (cast to the compute dtype); not yet waited. `offloaded`
    shards (Plan.offload_params) are read by meshc_offload::pack_dropping, which then drops their pages
    (ops/pages.py)."""
    with torch.no_grad():
        flat = [s.detach() for s in shards]
        sizes = [s.numel() for s in flat]
        local = pack_dropping(flat, dtype) if offloaded else _pack(flat, sizes, dtype, 1, fused)
        return compat.all_gather_start(local, size, group)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, raw, meta, pending, *shards):
        ctx.meta, ctx.pending, ctx.shards = meta, pending, shards
        return tuple(unpack_bucket(compat.wait(raw), meta))

    @staticmethod
    def backward(ctx, *grads):
        m = ctx.meta
        raw = _reduce_scatter_start(grads, m)
        if ctx.pending is not None:  # overlapped: added to the shards' .grad when backward ends
            ctx.pending.add(raw, ctx.shards, m)
            return (None, None, None, *[None for _ in ctx.shards])
        return (None, None, None, *[g.to(m.master_dtype) for g in reduced(raw, m).split(m.sizes)])


@dataclass(frozen=True)
class BucketMeta:
    bucket: int
    sizes: list
    numels: list
    shapes: list
    n: int
    group: str
    partial: tuple
    reduce_dtype: torch.dtype
    master_dtype: torch.dtype
    dtype: torch.dtype  # the compute dtype the bucket is gathered in
    fused: bool = False  # copy-in, copy-out and the gradient prologue run as meshc kernels
    average: int = 0  # what the summed gradients are divided by: dp (0: n, the group is dp itself)
    replicas: str | None = None  # hybrid sharding: the dpr group the reduce-scattered shard is all-reduced over
    offloaded: bool = False  # the shards live in the offload's file (Plan.offload_params): read by pack_dropping


def zero_gather(raw: torch.Tensor, *shards: torch.Tensor, bucket: int, shapes: tuple, group: str, size: int,
                dtype: torch.dtype, partial: tuple = (), reduce_dtype: torch.dtype = torch.float32,
                keep: bool = False, fused: bool = False, average: int = 0,
                replicas: str | None = None, offloaded: bool = False) -> tuple[torch.Tensor, ...]:
    """The bucket's full parameters from its gathered buffer; backward reduce-scatters their gradients.

    With `keep`, autograd keeps them for backward (the bucket used last in forward) instead of a re-gather.
    """
    numels = [math.prod(s) for s in shapes]
    meta = BucketMeta(bucket, [shard_size(k, size) for k in numels], numels, [tuple(s) for s in shapes], size,
                      group, tuple(partial), reduce_dtype, shards[0].dtype, dtype, fused, average, replicas, offloaded)
    context = active_context()
    full = _Gather.apply(raw, meta, context.pending if context is not None else None, *shards)
    if context is not None:
        context.register(meta, shards, full, recompute=not keep)
    return full


# ---------------------------------------------------------------------------------------- ZeRO-2
class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, meta, masters, pending, *params):
        ctx.meta, ctx.masters, ctx.pending = meta, masters, pending
        return tuple(p.detach() for p in params)

    @staticmethod
    def backward(ctx, *grads):
        ctx.pending.add(_reduce_scatter_start(grads, ctx.meta), ctx.masters, ctx.meta)
        return (None, None, None, *[None for _ in grads])


def zero_reduce(*params: torch.Tensor, bucket: int, fqns: tuple, group: str, size: int, partial: tuple = (),
                reduce_dtype: torch.dtype = torch.float32, fused: bool = False,
                average: int = 0, replicas: str | None = None) -> tuple[torch.Tensor, ...]:
    """Identity; backward reduce-scatters the bucket's gradients into its master shards' .grad (ZeRO-2)."""
    context = active_context()
    if context is None:
        if compat.is_fake(params[0]):  # shapes being propagated at compile time: nothing to reduce
            return tuple(p.view_as(p) for p in params)
        raise MeshcRuntimeError("zero_reduce: expected to run inside a meshc job (its master shards receive the gradients)")
    numels = [p.numel() for p in params]
    meta = BucketMeta(bucket, [shard_size(k, size) for k in numels], numels, [tuple(p.shape) for p in params], size,
                      group, tuple(partial), reduce_dtype, torch.float32, params[0].dtype, fused, average, replicas)
    return _Reduce.apply(meta, tuple(context.masters[f] for f in fqns), context.pending, *params)


class _ReduceInto(torch.autograd.Function):
    """ZeRO-2 as a graph: identity on the bucket's parameters; backward returns their gradients reduce-scattered as
    the gradients of the master shards (inputs too), where the FX path's _Reduce writes them behind the graph."""

    @staticmethod
    def forward(ctx, meta, n, *tensors):
        ctx.meta, ctx.n = meta, n
        return tuple(p.detach() for p in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        m = ctx.meta
        shards = reduced(_reduce_scatter_start(grads, m), m).split(m.sizes)
        return (None, None, *[None for _ in grads], *[g.to(m.master_dtype) for g in shards])


def zero_reduce_into(*tensors: torch.Tensor, bucket: int, fqns: tuple, group: str, size: int, partial: tuple = (),
                     reduce_dtype: torch.dtype = torch.float32, fused: bool = False, average: int = 0,
                     replicas: str | None = None) -> tuple[torch.Tensor, ...]:
    """zero_reduce with the bucket's master shards passed after its parameters (`tensors` = params + masters):
    what a compiled program calls (runtime/inductor.py rewrites zero_reduce nodes into it), traceable, no context."""
    n = len(fqns)
    params, masters = tensors[:n], tensors[n:]
    numels = [p.numel() for p in params]
    meta = BucketMeta(bucket, [shard_size(k, size) for k in numels], numels, [tuple(p.shape) for p in params], size,
                      group, tuple(partial), reduce_dtype, masters[0].dtype, params[0].dtype, fused, average, replicas)
    return _ReduceInto.apply(meta, n, *params, *masters)
