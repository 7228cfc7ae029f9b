"""Collective matmuls (asynchronous tensor parallelism): the all-gather before column-parallel linears,
and the reduce-scatter after a row-parallel one, decomposed into chunks passed around a ring of
point-to-point transfers, so that each transfer overlaps a matmul.

    all_gather_matmul(x_local, W1, b1, W2, b2, ...)  = [linear(all_gather(x_local), Wk, bk) for each k]
    matmul_reduce_scatter(x, W)                      = reduce_scatter(linear(x, W))

Two rings, both overlapped, in forward and backward alike:
    gather_ring   chunk by chunk, the next transfer is started before the chunk at hand is multiplied.
    scatter_ring  the partial sum of one chunk is sent on, the next chunk's product is computed while it
                  travels, then the partial sum that arrived meanwhile is added to it.
all_gather_matmul's forward is a gather ring and its backward a scatter ring (the gathered input's
gradient, reduce-scattered: the all-gather was sequence parallel's, whose consumers are all sharded),
with the weight gradients computed chunk by chunk inside it; matmul_reduce_scatter's forward is a
scatter ring and its backward a gather ring of the output gradient. n − 1 transfers per ring.
Runs on gloo and NCCL alike; the fuse_comm pass inserts them where Plan.collective_matmul asks or the
cost model predicts that the overlap pays.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshc.compiler.ir import torch_compat as compat


def _ring(ranks: tuple, index: int):
    n = len(ranks)
    return ranks[(index + 1) % n], ranks[(index - 1) % n]


def _exchange(send: torch.Tensor, recv: torch.Tensor, nxt: int, prv: int, pg, tag: int) -> list:
    return [dist.isend(send, nxt, group=pg, tag=tag), dist.irecv(recv, prv, group=pg, tag=tag)]


def gather_ring(x: torch.Tensor, n: int, index: int, group: str, ranks: tuple,
                consume: Callable[[torch.Tensor, int], None]) -> None:
    """Pass every rank's `x` around the ring: consume(chunk, owner) runs on each of the n chunks (this
    rank's first) while the transfer of the next one is in flight."""
    pg = compat.resolve_process_group(group) if n > 1 else None
    nxt, prv = _ring(ranks, index)
    cur = x.contiguous()
    for step in range(n):
        works, buf = [], None
        if step < n - 1:
            buf = torch.empty_like(cur)
            works = _exchange(cur, buf, nxt, prv, pg, step)
        consume(cur, (index - step) % n)  # overlaps the transfer above
        for work in works:
            work.wait()
        cur = buf


def scatter_ring(partial: Callable[[int], torch.Tensor], n: int, index: int, group: str,
                 ranks: tuple) -> torch.Tensor:
    """Σ over ranks of partial(index): every rank's contribution to chunk j, computed by partial(j), summed
    around the ring (chunk j's sum starts at rank j + 1 and ends at rank j). Each partial product is
    computed while the previous partial sum travels."""
    pg = compat.resolve_process_group(group) if n > 1 else None
    nxt, prv = _ring(ranks, index)
    acc = partial((index - 1) % n)
    for step in range(n - 1):
        send = acc.contiguous()
        buf = torch.empty_like(send)
        works = _exchange(send, buf, nxt, prv, pg, step)
        part = partial((index - step - 2) % n)  # overlaps the transfer above
        for work in works:
            work.wait()
        acc = part.add_(buf)
    return acc


def _rows(t: torch.Tensor, dim: int, j: int, rows: int) -> torch.Tensor:
    return t.narrow(dim, j * rows, rows)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, meta, *wb):
        dim, n, index, group, ranks = meta
        rows = x.shape[dim]
        weights, biases = wb[0::2], wb[1::2]
        outs = [x.new_empty((*x.shape[:dim], rows * n, *x.shape[dim + 1:-1], w.shape[0])) for w in weights]
        pieces = [None] * n

        def consume(chunk, owner):
            for out, w, b in zip(outs, weights, biases):
                _rows(out, dim, owner, rows).copy_(F.linear(chunk, w, b))
            pieces[owner] = chunk
        gather_ring(x, n, index, group, ranks, consume)
        ctx.meta = meta
        ctx.save_for_backward(torch.cat(pieces, dim), *wb)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        dim, n, index, group, ranks = ctx.meta
        x_full, *wb = ctx.saved_tensors
        weights, biases = wb[0::2], wb[1::2]
        rows = x_full.shape[dim] // n
        used = [(k, g) for k, g in enumerate(grads) if g is not None]
        grad_w = {k: torch.zeros_like(weights[k]) for k, _ in used}

        def partial(j):  # this rank's part of chunk j's input gradient; its weight gradients on the way
            x_j = _flat(_rows(x_full, dim, j, rows))
            part = None
            for k, g in used:
                g_j = _rows(g, dim, j, rows)
                grad_w[k].addmm_(_flat(g_j).t(), x_j)
                p = g_j @ weights[k]
                part = p if part is None else part.add_(p)
            return part
        local = scatter_ring(partial, n, index, group, ranks)
        out = []
        for k, (w, b) in enumerate(zip(weights, biases)):
            g = grads[k]
            out += [grad_w.get(k), _flat(g).sum(0) if g is not None and b is not None else None]
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
        out = scatter_ring(lambda j: F.linear(_rows(x, dim, j, rows), w), n, index, group, ranks)
        ctx.meta = meta
        ctx.save_for_backward(x, w)
        return out

    @staticmethod
    def backward(ctx, grad):
        dim, n, index, group, ranks = ctx.meta
        x, w = ctx.saved_tensors
        rows = x.shape[dim] // n
        grad_x = torch.empty_like(x)
        grad_w = torch.zeros_like(w)

        def consume(g_j, j):  # the output gradient of chunk j, gathered: its input and weight gradients
            _rows(grad_x, dim, j, rows).copy_(g_j @ w)
            grad_w.addmm_(_flat(g_j).t(), _flat(_rows(x, dim, j, rows)))
        gather_ring(grad, n, index, group, ranks, consume)
        return grad_x, grad_w, None


def matmul_reduce_scatter(x: torch.Tensor, w: torch.Tensor, *, dim: int, size: int, index: int, group: str,
                          ranks: tuple) -> torch.Tensor:
    """reduce_scatter(linear(x, w), dim): each chunk's partial products summed around the ring."""
    return _MatmulReduceScatter.apply(x, w, (dim, size, index, group, tuple(ranks)))
