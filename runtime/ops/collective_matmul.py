"""Collective matmuls (asynchronous tensor parallelism): the all-gather before column-parallel linears,
and the reduce-scatter after a row-parallel one, decomposed into chunks passed around a ring of
point-to-point transfers, so that each transfer overlaps a matmul on the chunk already here.

    all_gather_matmul(x_local, W1, b1, W2, b2, ...)  = [linear(all_gather(x_local), Wk, bk) for each k]
    matmul_reduce_scatter(x, W)                      = reduce_scatter(linear(x, W))

Forward runs the ring (n - 1 transfers, each overlapping one chunk's matmuls); backward is the
conjugate in plain collectives: the gathered input's gradient is reduce-scattered (the all-gather was
sequence parallel's, whose consumers are all sharded), and the reduce-scatter's gradient all-gathered.
Runs on gloo and NCCL alike; the fuse_comm pass inserts them when Plan(collective_matmul=True).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshc.compiler import _torch_compat as compat

from .collectives import gather_shard


def _ring(ranks: tuple, index: int):
    n = len(ranks)
    return ranks[(index + 1) % n], ranks[(index - 1) % n]


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, meta, *wb):
        dim, n, index, group, ranks = meta
        rows = x.shape[dim]
        pg = compat.resolve_process_group(group)
        nxt, prv = _ring(ranks, index)
        weights, biases = wb[0::2], wb[1::2]
        outs = [x.new_empty((*x.shape[:dim], rows * n, *x.shape[dim + 1:-1], w.shape[0])) for w in weights]
        pieces = [None] * n
        cur = x.contiguous()
        for step in range(n):
            owner = (index - step) % n
            works, buf = [], None
            if step < n - 1:
                buf = torch.empty_like(cur)
                works = [dist.isend(cur, nxt, group=pg, tag=step), dist.irecv(buf, prv, group=pg, tag=step)]
            for out, w, b in zip(outs, weights, biases):  # overlaps the transfer above
                out.narrow(dim, owner * rows, rows).copy_(F.linear(cur, w, b))
            pieces[owner] = cur
            for work in works:
                work.wait()
            cur = buf
        ctx.meta = meta
        ctx.save_for_backward(torch.cat(pieces, dim), *wb)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        dim, n, index, group, ranks = ctx.meta
        x_full, *wb = ctx.saved_tensors
        weights, biases = wb[0::2], wb[1::2]
        grad_x = None
        out = []
        for g, w, b in zip(grads, weights, biases):
            if g is None:
                out += [None, None]
                continue
            part = g @ w  # (..., in)
            grad_x = part if grad_x is None else grad_x + part
            g2 = g.reshape(-1, g.shape[-1])
            out.append(g2.t() @ x_full.reshape(-1, x_full.shape[-1]))
            out.append(g2.sum(0) if b is not None else None)
        moved = grad_x.movedim(dim, 0).contiguous()
        local = compat.reduce_scatter_sum(moved, n, group).movedim(0, dim)
        return (local, None, *out)


def all_gather_matmul(x: torch.Tensor, *weights_and_biases: torch.Tensor | None, dim: int, size: int, index: int,
                      group: str, ranks: tuple) -> tuple[torch.Tensor, ...]:
    """linear(all_gather(x, dim), W_k, b_k) for every (W_k, b_k) pair, the gather overlapped with the matmuls."""
    return _AllGatherMatmul.apply(x, (dim, size, index, group, tuple(ranks)), *weights_and_biases)


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, meta):
        dim, n, index, group, ranks = meta
        rows = x.shape[dim] // n
        pg = compat.resolve_process_group(group)
        nxt, prv = _ring(ranks, index)
        acc = None
        for step in range(n):  # chunk j's partial sum starts at rank j+1 and ends at rank j
            j = (index - step - 1) % n
            part = F.linear(x.narrow(dim, j * rows, rows), w)
            if acc is not None:
                part = part + acc
            if step == n - 1:
                acc = part
                break
            buf = torch.empty_like(part)
            works = [dist.isend(part.contiguous(), nxt, group=pg, tag=step), dist.irecv(buf, prv, group=pg, tag=step)]
            for work in works:
                work.wait()
            acc = buf
        ctx.meta = meta
        ctx.save_for_backward(x, w)
        return acc

    @staticmethod
    def backward(ctx, grad):
        dim, n, index, group, ranks = ctx.meta
        x, w = ctx.saved_tensors
        full = gather_shard(grad.contiguous(), dim, 1, n, group)
        grad_x = full @ w
        grad_w = full.reshape(-1, full.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad_x, grad_w, None


def matmul_reduce_scatter(x: torch.Tensor, w: torch.Tensor, *, dim: int, size: int, index: int, group: str,
                          ranks: tuple) -> torch.Tensor:
    """reduce_scatter(linear(x, w), dim): each chunk's partial products summed around the ring."""
    return _MatmulReduceScatter.apply(x, w, (dim, size, index, group, tuple(ranks)))
