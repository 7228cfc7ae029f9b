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
