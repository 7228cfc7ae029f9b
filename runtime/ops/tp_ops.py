"""Tensor-parallel compute that is more than a placement change: vocab-parallel embedding lookups.

Graph nodes call these plain, differentiable functions on local tensors (autograd derives backward).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def vocab_parallel_embedding(weight: torch.Tensor, indices: torch.Tensor, *, start: int, end: int,
                             padding_idx: int = -1) -> torch.Tensor:
    """Rows [start, end) of the embedding live on this rank: look those up, zeros elsewhere (a partial
    sum over the axis, completed by the all-reduce the pass places after it)."""
    outside = (indices < start) | (indices >= end)
    local = (indices - start).masked_fill(outside, 0)  # (B, T) rows of this rank's slice
    out = F.embedding(local, weight)  # (B, T, H)
    if 0 <= padding_idx and start <= padding_idx < end:
        outside = outside | (indices == padding_idx)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits whose vocabulary dim is split over a group (Megatron's loss-parallel):
    the max, the softmax denominator and the target logit are each one all-reduce of (tokens,) values,
    never of the (tokens, vocab) logits."""

    @staticmethod
    def forward(ctx, logits, target, start, end, ignore_index, reduction, group):
        from meshc.compiler.ir import torch_compat as compat

        ctx.dtype = logits.dtype
        logits = logits.float()  # (N, V/n)
        local_max = logits.max(dim=-1).values
        global_max = compat.all_reduce(local_max, "max", group)  # (N,)
        shifted = logits - global_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = compat.all_reduce(exp.sum(dim=-1), "sum", group)  # (N,)
        inside = (target >= start) & (target < end)
        local_target = (target - start).masked_fill(~inside, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        target_logit = compat.all_reduce(picked, "sum", group)  # (N,)
        valid = target != ignore_index
        losses = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        count = valid.sum().clamp(min=1)
        ctx.save_for_backward(exp, sum_exp, local_target, inside, valid, count)
        ctx.reduction = reduction
        if reduction == 0:  # none
            return losses
        return losses.sum() / count if reduction == 1 else losses.sum()

    @staticmethod
    def backward(ctx, grad):
        exp, sum_exp, local_target, inside, valid, count = ctx.saved_tensors
        soft = exp / sum_exp.unsqueeze(-1)  # (N, V/n)
        soft.scatter_add_(-1, local_target.unsqueeze(-1), -inside.to(soft.dtype).unsqueeze(-1))
        scale = grad / count if ctx.reduction == 1 else grad
        scale = scale.unsqueeze(-1) if ctx.reduction == 0 else scale
        out = soft * (valid.to(soft.dtype).unsqueeze(-1) * scale)
        return out.to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, start: int, end: int,
                                 ignore_index: int = -100, reduction: int = 1, group: str) -> torch.Tensor:
    """aten.cross_entropy_loss for logits (N, V) held as (N, V/n) vocabulary shards [start, end)."""
    return _VocabParallelCrossEntropy.apply(logits, target, start, end, ignore_index, reduction, group)


def join_blocks(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """A fused projection's local output put back together from the matmul of its sharded blocks and the one of
    the blocks every rank holds whole (passes/tp_whole.py): torch.cat. Its own function so that the
    tensor-parallel pass sees that a replicated part joins whole blocks (no Megatron f: its gradient is whole)."""
    return torch.cat(parts, dim)
