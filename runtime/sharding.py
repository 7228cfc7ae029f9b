"""Local shards of full tensors, and full tensors back from shards, by a ParamSpec's placements."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from meshc.compiler import _torch_compat as compat
from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.placement import FlatShard, Partial, Shard
from meshc.compiler.ir.program import ParamSpec

from .ops.collectives import gather_shard, slice_shard
from .ops.zero import flat_shard


@dataclass(frozen=True)
class LocalShard:
    """This rank's part of a parameter or buffer, with what is needed to place it in the whole."""

    tensor: torch.Tensor
    global_shape: tuple
    placements: dict


def local_shard(full: torch.Tensor, spec: ParamSpec, mesh, rank: int | None = None) -> torch.Tensor:
    """The part of `full` that `rank` holds: its part along every Shard axis (a contiguous copy)."""
    coords = mesh.coords(rank)
    out = full.detach()
    for axis, p in spec.placements.items():
        if isinstance(p, Partial):
            raise MeshcValueError(f"{spec.fqn}: a stored tensor cannot be Partial on {axis}")
        if isinstance(p, Shard) and mesh.sizes[axis] > 1:
            out = slice_shard(out, p.dim, p.chunks, mesh.sizes[axis], coords[axis])
    for axis, p in spec.placements.items():  # a flat shard applies to what the dim shards leave
        if isinstance(p, FlatShard):
            out = flat_shard(out, mesh.sizes[axis], coords[axis])
    return out.clone().contiguous()


def full_tensor(local: torch.Tensor, spec: ParamSpec, mesh) -> torch.Tensor:
    """The whole tensor, gathered from every rank's shard along each Shard axis (a collective)."""
    out = local.detach()
    for axis, p in spec.placements.items():
        if isinstance(p, FlatShard):
            n = mesh.sizes[axis]
            whole = compat.all_gather(out.reshape(-1), n, mesh.group_name(axis)) if n > 1 else out
            shape = spec.unflat_shape(mesh.sizes)
            out = whole[: math.prod(shape)].view(shape)
    for axis, p in reversed(list(spec.placements.items())):
        if isinstance(p, Shard) and mesh.sizes[axis] > 1:
            out = gather_shard(out, p.dim, p.chunks, mesh.sizes[axis], mesh.group_name(axis))
    return out.contiguous()
