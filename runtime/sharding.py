"""Local shards of full tensors, and full tensors back from shards, by a ParamSpec's placements."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.placement import FlatShard, Owned, Partial, Shard, owned_elsewhere
from meshc.compiler.ir.program import ParamSpec

from meshc.runtime.ops.collectives import gather_shard, slice_shard
from meshc.runtime.ops.zero import flat_shard, shard_size


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
        if owned_elsewhere(p, coords[axis]):  # another rank's: none of it here
            out = out[:0]
    for axis, p in spec.placements.items():  # a flat shard applies to what the dim shards leave
        if isinstance(p, FlatShard):
            out = flat_shard(out, mesh.sizes[axis], coords[axis])
    return out.clone().contiguous()


def allocate_local(full: torch.Tensor, spec: ParamSpec, mesh) -> torch.Tensor:
    """This rank's part of `full` on the mesh's device; of a meta tensor, an uninitialized one of its shape (the
    values come later: job.init_weights, job.load_pretrained)."""
    part = local_shard(full, spec, mesh)
    if part.device.type == "meta":
        return torch.empty(part.shape, dtype=part.dtype, device=mesh.device)
    return part.to(mesh.device)


def read_local(read, spec: ParamSpec, mesh) -> torch.Tensor:
    """What local_shard(full, spec, mesh) returns, reading only the part of `full` this rank holds: `read(indices)`
    gets one index tensor per dim (global positions, in the order the local tensor holds them) and returns
    full at their cross product. A ZeRO flat shard reads only the rows that its window of the flattened
    (tp-local) tensor touches, padded with zeros as flat_shard pads."""
    coords = mesh.coords()
    indices = [torch.arange(n) for n in spec.shape]
    for axis, p in spec.placements.items():
        if isinstance(p, Partial):
            raise MeshcValueError(f"{spec.fqn}: a stored tensor cannot be Partial on {axis}")
        if isinstance(p, Shard) and mesh.sizes[axis] > 1:
            indices[p.dim] = slice_shard(indices[p.dim], 0, p.chunks, mesh.sizes[axis], coords[axis])
        if owned_elsewhere(p, coords[axis]) and indices:
            indices[0] = indices[0][:0]
    flats = [axis for axis, p in spec.placements.items() if isinstance(p, FlatShard)]
    if not flats:
        return read(indices).contiguous()
    if len(flats) > 1 or not indices:  # nested flat shards or a scalar: cut what the dim shards leave
        out = read(indices)
        for axis in flats:
            out = flat_shard(out, mesh.sizes[axis], coords[axis])
        return out
    n, index = mesh.sizes[flats[0]], coords[flats[0]]
    numel, row = math.prod(len(i) for i in indices), math.prod(len(i) for i in indices[1:])
    s = shard_size(numel, n)
    lo, hi = min(index * s, numel), min((index + 1) * s, numel)
    first = None
    if hi > lo:
        r0, r1 = lo // row, -(-hi // row)
        first = read([indices[0][r0:r1], *indices[1:]]).reshape(-1)[lo - r0 * row: hi - r0 * row]
    out = torch.zeros(s, dtype=spec.dtype if first is None else first.dtype)
    if first is not None:
        out[: hi - lo] = first
    return out


def take(full: torch.Tensor, indices: list[torch.Tensor]) -> torch.Tensor:
    """full at the cross product of per-dim `indices` (a Reader over a tensor in memory)."""
    out = full.detach()
    for dim, ix in enumerate(indices):
        if len(ix) != out.shape[dim] or not torch.equal(ix, torch.arange(out.shape[dim])):
            out = out.index_select(dim, ix.to(out.device))
    return out


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
        if isinstance(p, Owned) and mesh.sizes[axis] > 1:  # from its owner, to every rank of the axis
            whole = out.new_empty(spec.shape) if owned_elsewhere(p, mesh.coords()[axis]) else out
            out = whole.contiguous()
            torch.distributed.broadcast(out, src=mesh.group_ranks(axis)[p.coord], group=mesh.group(axis))
    return out.contiguous()
