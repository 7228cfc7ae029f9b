"""Local shards of full tensors, and full tensors back from shards, by a ParamSpec's placements."""
from __future__ import annotations

import torch

from meshc.compiler.placement import Partial, Shard
from meshc.compiler.program import ParamSpec

from .collectives import gather_shard, slice_shard


def local_shard(full: torch.Tensor, spec: ParamSpec, mesh, rank: int | None = None) -> torch.Tensor:
    """The part of `full` that `rank` holds: its part along every Shard axis (a contiguous copy)."""
    coords = mesh.coords(rank)
    out = full.detach()
    for axis, p in spec.placements.items():
        if isinstance(p, Partial):
            raise ValueError(f"{spec.fqn}: a stored tensor cannot be Partial on {axis}")
        if isinstance(p, Shard) and mesh.sizes[axis] > 1:
            out = slice_shard(out, p.dim, p.chunks, mesh.sizes[axis], coords[axis])
    return out.clone().contiguous()


def full_tensor(local: torch.Tensor, spec: ParamSpec, mesh) -> torch.Tensor:
    """The whole tensor, gathered from every rank's shard along each Shard axis (a collective)."""
    out = local.detach()
    for axis, p in reversed(list(spec.placements.items())):
        if isinstance(p, Shard) and mesh.sizes[axis] > 1:
            out = gather_shard(out, p.dim, p.chunks, mesh.sizes[axis], mesh.group_name(axis))
    return out.contiguous()
