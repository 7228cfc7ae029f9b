"""Local shards of full tensors, and full tensors back from shards, by a ParamSpec's placements."""
from __future__ import annotations

import torch

from meshc.compiler import _torch_compat as compat
from meshc.compiler.placement import Partial, Shard
from meshc.compiler.program import ParamSpec


def local_shard(full: torch.Tensor, spec: ParamSpec, mesh, rank: int | None = None) -> torch.Tensor:
    """The part of `full` that `rank` holds: its chunk along every Shard axis (a copy, contiguous)."""
    coords = mesh.coords(rank)
    out = full
    for axis, p in spec.placements.items():
        if isinstance(p, Partial):
            raise ValueError(f"{spec.fqn}: a stored tensor cannot be Partial on {axis}")
        if isinstance(p, Shard):
            out = out.chunk(mesh.sizes[axis], p.dim)[coords[axis]]
    return out.detach().clone().contiguous()


def full_tensor(local: torch.Tensor, spec: ParamSpec, mesh) -> torch.Tensor:
    """The whole tensor, gathered from every rank's shard along each Shard axis (a collective)."""
    out = local.detach()
    for axis, p in reversed(list(spec.placements.items())):
        if isinstance(p, Shard) and mesh.sizes[axis] > 1:
            moved = out.movedim(p.dim, 0)
            gathered = compat.all_gather(moved, mesh.sizes[axis], mesh.group_name(axis))
            out = gathered.movedim(0, p.dim)
    return out.contiguous()
