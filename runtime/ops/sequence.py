"""Redistributions on the cp axis (context parallelism): what the graph nodes inserted by passes/context.py call.

Layout. A value sharded on the sequence, S(dim, chunks=c) on cp, views `dim` as c equal blocks (c > 1 when
the sequence was flattened with the batch: (b, s) -> b·s rows) and cuts each block into 2·cp chunks; rank i
holds chunks i and 2·cp−1−i of every block, concatenated ("zigzag": under causal attention every rank then
has the same work). mesh.shard_batch lays the inputs out this way.

Gradients. cp is a data axis: every rank computes its own loss, on its own tokens, and the job averages the
losses and the gradients over dp (which holds cp). So a replicated value's gradient on a rank is that rank's
share, never the whole: each redistribution's backward is the exact transpose of its forward (sum over
ranks where the forward copied), unlike tensor parallelism's, where a replicated value's gradient is whole:

    seq_slice           R -> S   forward local slice     backward zero-padded gradient (no communication)
    seq_gather          S -> R   forward all-gather      backward reduce-scatter (sum)
    seq_reduce          P -> R   forward all-reduce      backward all-reduce
    seq_reduce_scatter  P -> S   forward reduce-scatter  backward all-gather
"""
from __future__ import annotations

import torch

from meshc.compiler.ir import torch_compat as compat


def _blocks(x: torch.Tensor, dim: int, chunks: int, parts: int) -> torch.Tensor:
    """x with `dim` moved first and split as (chunks, parts, piece, *rest)."""
    moved = x.movedim(dim, 0)
    piece = moved.shape[0] // (chunks * parts)
    return moved.reshape(chunks, parts, piece, *moved.shape[1:])


def _order(size: int, device) -> torch.Tensor:
    """Global chunk index of each local chunk, rank-major: rank r holds chunks r and 2·size−1−r."""
    r = torch.arange(size, device=device)
    return torch.stack([r, 2 * size - 1 - r], dim=1).reshape(-1)


def zigzag_slice(x: torch.Tensor, dim: int, chunks: int, size: int, index: int) -> torch.Tensor:
    """Rank `index`'s part of a whole sequence dim."""
    b = _blocks(x, dim, chunks, 2 * size)
    part = b[:, [index, 2 * size - 1 - index]]  # (c, 2, piece, *rest)
    return part.flatten(0, 2).movedim(0, dim).contiguous()


def zigzag_pad(x: torch.Tensor, dim: int, chunks: int, size: int, index: int) -> torch.Tensor:
    """The whole dim with this rank's part in place and zeros elsewhere (the transpose of zigzag_slice)."""
    b = _blocks(x, dim, chunks, 2)
    out = b.new_zeros(chunks, 2 * size, *b.shape[2:])
    out[:, index], out[:, 2 * size - 1 - index] = b[:, 0], b[:, 1]
    return out.flatten(0, 2).movedim(0, dim)


def zigzag_gather(x: torch.Tensor, dim: int, chunks: int, size: int, group: str) -> torch.Tensor:
    """The whole dim from every rank's part (all-gather, then chunks put back in sequence order)."""
    b = _blocks(x, dim, chunks, 2)  # (c, 2, piece, *rest)
    full = compat.all_gather(b.contiguous(), size, group)  # (size·c, 2, piece, *rest), rank-major
    full = full.reshape(size, chunks, 2, *b.shape[2:]).transpose(0, 1).reshape(chunks, 2 * size, *b.shape[2:])
    out = torch.empty_like(full)
    out[:, _order(size, x.device)] = full  # rank-major (r, half) -> global chunk
    return out.flatten(0, 2).movedim(0, dim)


def zigzag_reduce_scatter(x: torch.Tensor, dim: int, chunks: int, size: int, group: str) -> torch.Tensor:
    """Sum over the group of a whole dim, each rank keeping its part."""
    b = _blocks(x, dim, chunks, 2 * size)  # (c, 2·size, piece, *rest)
    ranked = b[:, _order(size, x.device)].reshape(chunks, size, 2, *b.shape[2:]).transpose(0, 1)
    out = compat.reduce_scatter_sum(ranked.reshape(size * chunks, *ranked.shape[2:]).contiguous(), size, group)
    return out.flatten(0, 2).movedim(0, dim).contiguous()


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, chunks, size, index):
        ctx.args = (dim, chunks, size, index)
        return zigzag_slice(x, dim, chunks, size, index)

    @staticmethod
    def backward(ctx, grad):
        return zigzag_pad(grad, *ctx.args), None, None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, chunks, size, group):
        ctx.args = (dim, chunks, size, group)
        return zigzag_gather(x, dim, chunks, size, group)

    @staticmethod
    def backward(ctx, grad):
        return zigzag_reduce_scatter(grad, *ctx.args), None, None, None, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return compat.all_reduce_sum(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return compat.all_reduce_sum(grad.contiguous(), ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, chunks, size, group):
        ctx.args = (dim, chunks, size, group)
        return zigzag_reduce_scatter(x, dim, chunks, size, group)

    @staticmethod
    def backward(ctx, grad):
        return zigzag_gather(grad, *ctx.args), None, None, None, None


def seq_slice(x: torch.Tensor, *, dim: int, chunks: int, size: int, index: int, group: str) -> torch.Tensor:
    """R -> S(dim): this rank's zigzag part; backward pads the gradient with zeros (no communication)."""
    return _Slice.apply(x, dim, chunks, size, index)


def seq_gather(x: torch.Tensor, *, dim: int, chunks: int, size: int, index: int, group: str) -> torch.Tensor:
    """S(dim) -> R: the whole sequence; backward reduce-scatters the ranks' gradients."""
    return _Gather.apply(x, dim, chunks, size, group)


def seq_reduce(x: torch.Tensor, *, group: str) -> torch.Tensor:
    """P -> R: the sum over the cp group; backward sums the ranks' gradients too."""
    return _Reduce.apply(x, group)


def seq_reduce_scatter(x: torch.Tensor, *, dim: int, chunks: int, size: int, group: str) -> torch.Tensor:
    """P -> S(dim): the sum, each rank keeping its zigzag part; backward all-gathers."""
    return _ReduceScatter.apply(x, dim, chunks, size, group)
