"""Autograd-aware collectives: the functions that graph nodes inserted by meshc's passes call.

Each is an ordinary function over plain local tensors, wrapping torch's functional collectives in an
autograd.Function so that backward performs the conjugate collective (DESIGN.md §4): the passes only
rewrite the forward graph and autograd derives the rest. Groups are passed by their registered name,
so a graph names exactly the groups its rank uses and nothing is looked up in a global.
"""
from __future__ import annotations

import torch

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.ir.errors import MeshcInternalError
from meshc.compiler.ir.placement import Whole, has_whole, local_blocks


class _GradSync(torch.autograd.Function):
    """Forward: identity on a bucket of parameters. Backward: their gradients summed over each group in
    turn, then divided by `size` (the dp size: an average over data-parallel replicas)."""

    @staticmethod
    def forward(ctx, groups: tuple[str, ...], size: int, *params: torch.Tensor):
        ctx.groups, ctx.size = groups, size
        ctx.shapes = [p.shape for p in params]
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        flat = torch.cat([
            (g if g is not None else torch.zeros(s, dtype=_dtype(grads), device=_device(grads))).reshape(-1)
            for g, s in zip(grads, ctx.shapes)
        ])
        for group in ctx.groups:
            flat = compat.all_reduce_sum(flat, group)
        if ctx.size != 1:
            flat = flat.div_(ctx.size)
        outs = [chunk.view(s) for chunk, s in zip(flat.split([s.numel() for s in ctx.shapes]), ctx.shapes)]
        return (None, None, *outs)


def _dtype(grads) -> torch.dtype:
    return next(g for g in grads if g is not None).dtype


def _device(grads) -> torch.device:
    return next(g for g in grads if g is not None).device


def grad_sync(*params: torch.Tensor, groups: tuple[str, ...], size: int) -> tuple[torch.Tensor, ...]:
    """Gradient reduction for one bucket: identity forward; backward one flat all-reduce per group, then /size.

    Backward runs once autograd has every gradient of the bucket, so a bucket of the parameters one block
    uses is reduced as soon as backward leaves that block.
    """
    return _GradSync.apply(tuple(groups), size, *params)


# ------------------------------------------------------------------------------------------------
# Redistributions between placements on one mesh axis (tensor parallelism, sequence parallelism).
#
# Each is identity, gather, slice or reduction in forward and its conjugate in backward, so that a
# value's gradient always has the placement its forward value has (R -> R, S -> S, P -> R):
#
#   all_reduce        P -> R   forward all-reduce           backward identity        (Megatron g)
#   grad_all_reduce   R -> R   forward identity             backward all-reduce      (Megatron f)
#   all_gather        S -> R   forward all-gather           backward local slice
#   local_slice       R -> S   forward local slice          backward all-gather
#   reduce_scatter    P -> S   forward reduce-scatter       backward all-gather      (sequence parallel)
#   all_gather_rs     S -> R   forward all-gather           backward reduce-scatter  (sequence parallel,
#                                                            when only sharded consumers use the result)
#
# A shard S(dim, chunks=c) views `dim` as c equal blocks and shards each block over the axis; the local
# tensor is the concatenation of this rank's part of every block (a fused qkv projection is 3 blocks).
# ------------------------------------------------------------------------------------------------


# With unequal blocks, chunks is the tuple of their whole sizes (q|k|v under grouped-query attention).


def gather_shard(x: torch.Tensor, dim: int, chunks: int | tuple, size: int, group: str) -> torch.Tensor:
    moved = x.movedim(dim, 0).contiguous()  # (c*b, ...)
    full = compat.all_gather(moved, size, group)  # (n*c*b, ...) in rank-major order
    rest = moved.shape[1:]
    if isinstance(chunks, tuple):  # rank-major (n, local blocks...) -> block-major; a Whole block: any rank's copy
        local = local_blocks(chunks, sum(chunks), size)
        parts = full.view(size, moved.shape[0], *rest).split(list(local), dim=1)
        return torch.cat([p[0] if isinstance(c, Whole) else p.reshape(-1, *rest)
                          for p, c in zip(parts, chunks)]).movedim(0, dim)
    block = moved.shape[0] // chunks
    full = full.view(size, chunks, block, *rest).transpose(0, 1).reshape(chunks * size * block, *rest)
    return full.movedim(0, dim)


def slice_shard(x: torch.Tensor, dim: int, chunks: int | tuple, size: int, index: int) -> torch.Tensor:
    moved = x.movedim(dim, 0)
    rest = moved.shape[1:]
    if isinstance(chunks, tuple):  # this rank's part of each block, all of a Whole one
        part = torch.cat([b if isinstance(c, Whole) else b.reshape(size, b.shape[0] // size, *rest)[index]
                          for b, c in zip(moved.split([int(c) for c in chunks]), chunks)])
        return part.movedim(0, dim).contiguous()
    block = moved.shape[0] // (chunks * size)
    part = moved.reshape(chunks, size, block, *rest)[:, index].reshape(chunks * block, *rest)
    return part.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, chunks: int | tuple, size: int, group: str) -> torch.Tensor:
    moved = x.movedim(dim, 0)
    rest = moved.shape[1:]
    if has_whole(chunks):
        raise MeshcInternalError(f"reduce-scatter: expected blocks that all split over the axis, got {chunks}: a "
                                 "partial sum of a block held whole needs an all-reduce")
    if isinstance(chunks, tuple):
        ordered = torch.cat([b.reshape(size, b.shape[0] // size, *rest) for b in moved.split(list(chunks))], dim=1)
        ordered = ordered.reshape(-1, *rest)  # rank-major
    else:
        block = moved.shape[0] // (chunks * size)
        ordered = moved.reshape(chunks, size, block, *rest).transpose(0, 1).reshape(-1, *rest)  # rank-major
    return compat.reduce_scatter_sum(ordered, size, group).movedim(0, dim)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return compat.all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return compat.all_reduce_sum(grad.contiguous(), ctx.group), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, chunks, size, index, group, scatter_grad):
        ctx.args = (dim, chunks, size, index, group, scatter_grad)
        return gather_shard(x, dim, chunks, size, group)

    @staticmethod
    def backward(ctx, grad):
        dim, chunks, size, index, group, scatter_grad = ctx.args
        if scatter_grad:
            out = _reduce_scatter(grad, dim, chunks, size, group)
        else:
            out = slice_shard(grad, dim, chunks, size, index)
        return out, None, None, None, None, None, None


class _LocalSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, chunks, size, index, group):
        ctx.args = (dim, chunks, size, group)
        out = slice_shard(x, dim, chunks, size, index)
        # a view (of x, or of a tensor made here) is one autograd forbids modifying in place (Mixtral's router
        # divides its top-k weights in place under sequence parallelism): hand out a tensor of its own
        return out.clone() if compat.is_view(out) else out

    @staticmethod
    def backward(ctx, grad):
        dim, chunks, size, group = ctx.args
        return gather_shard(grad, dim, chunks, size, group), None, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, chunks, size, group):
        ctx.args = (dim, chunks, size, group)
        out = _reduce_scatter(x, dim, chunks, size, group)
        # a view leaving a Function may not be modified in place (Falcon's `mlp_output += attention_output`):
        # return a tensor of its own (movedim's view is copied; contiguous() of a contiguous view would not be)
        return out.contiguous() if not out.is_contiguous() else out.clone()

    @staticmethod
    def backward(ctx, grad):
        dim, chunks, size, group = ctx.args
        return gather_shard(grad, dim, chunks, size, group), None, None, None, None


def all_reduce(x: torch.Tensor, *, group: str) -> torch.Tensor:
    """P -> R: sum the partial values of the group; backward passes the gradient through."""
    return _AllReduce.apply(x, group)


def grad_all_reduce(x: torch.Tensor, *, group: str) -> torch.Tensor:
    """R -> R: identity; backward sums the partial gradients that sharded consumers produced."""
    return _GradAllReduce.apply(x, group)


def all_gather(x: torch.Tensor, *, dim: int, chunks: int, size: int, index: int, group: str) -> torch.Tensor:
    """S(dim) -> R; backward keeps this rank's slice of the (replicated) gradient."""
    return _AllGather.apply(x, dim, chunks, size, index, group, False)


def all_gather_rs(x: torch.Tensor, *, dim: int, chunks: int, size: int, index: int, group: str) -> torch.Tensor:
    """S(dim) -> R for sharded consumers only; backward reduce-scatters their partial gradients."""
    return _AllGather.apply(x, dim, chunks, size, index, group, True)


def local_slice(x: torch.Tensor, *, dim: int, chunks: int, size: int, index: int, group: str) -> torch.Tensor:
    """R -> S(dim): this rank's part, no communication; backward all-gathers the gradient."""
    return _LocalSlice.apply(x, dim, chunks, size, index, group)


def reduce_scatter(x: torch.Tensor, *, dim: int, chunks: int, size: int, group: str) -> torch.Tensor:
    """P -> S(dim): sum over the group, each rank keeping its part; backward all-gathers."""
    return _ReduceScatter.apply(x, dim, chunks, size, group)
