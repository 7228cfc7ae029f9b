"""Gradient prologue of a reduce-scatter: `meshc::grad_prologue`.

    flat = grad_prologue(grads, torch.bfloat16, scale=1 / dp, world_size=dp)   # (ceil(T / dp) * dp,)
    shard = reduce_scatter(flat)                                               # this rank's (T / dp,)

Where it sits: before the data-parallel gradient reduce-scatter of ZeRO-1/2 (and the all-reduce of
plain data parallelism, with world_size=1). It flattens a bucket of gradients (each in its own
dtype, usually fp32 or bf16) into one buffer in the reduce dtype, multiplies by the pre-scale
(1/dp, so the sum the collective takes is already the mean, as DDP's `gradient_predivide_factor`),
and zero-pads the end to a multiple of world_size so every rank gets an equal slice. Unfused that is
a cast, a multiply and a copy per gradient plus a padding copy; here it is one launch of zero_copy's
multi-tensor kernel (one program column per gradient).

The layout is the concatenation of the flattened gradients in order (T elements), then the padding.
Scaling is in fp32 (fp64 stays fp64 on the CPU path) before rounding to `dtype`.

Autograd (for completeness: gradients of gradients are rare): backward slices the flat gradient
back into the gradients' shapes and dtypes, times the scale; padding gets no gradient.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from meshc.compiler.ir.errors import MeshcValueError
from meshc.kernels.zero_copy import triton_to_flat

__all__ = ["grad_prologue", "padded_numel", "triton_grad_prologue"]


def grad_prologue(grads: Sequence[Tensor], dtype: torch.dtype, scale: float = 1.0, world_size: int = 1) -> Tensor:
    """One flat buffer of `dtype`: the flattened `grads` times `scale`, zero-padded to a multiple of
    world_size. # (padded_numel(grads, world_size),)"""
    return torch.ops.meshc.grad_prologue(list(grads), dtype, float(scale), int(world_size))


def padded_numel(grads: Sequence[Tensor], world_size: int) -> int:
    """Total elements of `grads` rounded up to a multiple of world_size."""
    if world_size < 1:
        raise MeshcValueError(f"grad_prologue world_size: expected >= 1, got {world_size}")
    total = sum(g.numel() for g in grads)
    return -(-total // world_size) * world_size


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op("meshc::grad_prologue", mutates_args=())
def _op(grads: list[Tensor], dtype: torch.dtype, scale: float, world_size: int) -> Tensor:
    """CPU implementation: scale in fp32 (fp64 for fp64), cast, concatenate, zero-pad."""
    padded = padded_numel(grads, world_size)
    device = grads[0].device if grads else "cpu"
    parts = [(g.reshape(-1).to(_compute_dtype(g.dtype)) * scale).to(dtype) for g in grads]
    total = sum(p.numel() for p in parts)
    parts.append(torch.zeros(padded - total, dtype=dtype, device=device))
    return torch.cat(parts)


@_op.register_fake
def _fake(grads, dtype, scale, world_size):
    device = grads[0].device if grads else "cpu"
    return torch.empty(padded_numel(grads, world_size), dtype=dtype, device=device)


@_op.register_kernel("cuda")
def _cuda(grads, dtype, scale, world_size):
    return triton_grad_prologue(grads, dtype, scale, world_size)


def triton_grad_prologue(grads: Sequence[Tensor], dtype: torch.dtype, scale: float, world_size: int) -> Tensor:
    """The Triton grad_prologue (zero_copy's multi-tensor kernel with a scale and a zeroed tail)."""
    grads = list(grads)
    numels = [g.numel() for g in grads]
    return triton_to_flat(grads, dtype, 1, numels, scale=scale, out_numel=padded_numel(grads, world_size))


def _setup(ctx, inputs, output):
    grads, _dtype, scale, _world_size = inputs
    ctx.shapes = [g.shape for g in grads]
    ctx.dtypes = [g.dtype for g in grads]
    ctx.scale = scale


def _backward(ctx, grad_flat):
    out, offset = [], 0
    for shape, dtype in zip(ctx.shapes, ctx.dtypes):
        numel = shape.numel()
        piece = grad_flat[offset:offset + numel].view(shape)
        out.append((piece.to(_compute_dtype(dtype)) * ctx.scale).to(dtype))
        offset += numel
    return out, None, None, None


_op.register_autograd(_backward, setup_context=_setup)
