"""Autograd-aware collectives: the functions that graph nodes inserted by meshc's passes call.

Each is an ordinary function over plain local tensors, wrapping torch's functional collectives in an
autograd.Function so that backward performs the conjugate collective (DESIGN.md §4): the passes only
rewrite the forward graph and autograd derives the rest. Groups are passed by their registered name,
so a graph names exactly the groups its rank uses and nothing is looked up in a global.
"""
from __future__ import annotations

import torch

from meshc.compiler import _torch_compat as compat


class _GradSync(torch.autograd.Function):
    """Forward: identity on a bucket of parameters. Backward: their gradients averaged over the group."""

    @staticmethod
    def forward(ctx, group: str, size: int, *params: torch.Tensor):
        ctx.group, ctx.size = group, size
        ctx.shapes = [p.shape for p in params]
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        flat = torch.cat([
            (g if g is not None else torch.zeros(s, dtype=_dtype(grads), device=_device(grads))).reshape(-1)
            for g, s in zip(grads, ctx.shapes)
        ])
        flat = compat.all_reduce_sum(flat, ctx.group).div_(ctx.size)
        outs = [chunk.view(s) for chunk, s in zip(flat.split([s.numel() for s in ctx.shapes]), ctx.shapes)]
        return (None, None, *outs)


def _dtype(grads) -> torch.dtype:
    return next(g for g in grads if g is not None).dtype


def _device(grads) -> torch.device:
    return next(g for g in grads if g is not None).device


def grad_sync(*params: torch.Tensor, group: str, size: int) -> tuple[torch.Tensor, ...]:
    """Data parallelism's gradient averaging for one bucket: identity forward, one flat all-reduce backward.

    Backward runs once autograd has every gradient of the bucket, so a bucket of the parameters one block
    uses is reduced as soon as backward leaves that block.
    """
    return _GradSync.apply(group, size, *params)
