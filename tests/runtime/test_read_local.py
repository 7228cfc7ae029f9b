"""sharding.read_local reads exactly what local_shard cuts, for every placement meshc stores, on every rank.

Checked bitwise (both are copies of the same elements) over tp block shards (equal and unequal blocks), ZeRO
flat shards (sizes that divide and sizes that pad), both together and a scalar; and the rows a flat shard
reads are only those its window touches.
"""
from __future__ import annotations

import math

import pytest
import torch

from meshc.compiler.ir.mesh_spec import MeshSpec
from meshc.compiler.ir.placement import FlatShard, Owned, Replicate, Shard
from meshc.compiler.ir.program import ParamSpec
from meshc.runtime.sharding import local_shard, read_local, take


class _Rank:
    """A MeshSpec seen from one rank, as the runtime Mesh is."""

    def __init__(self, spec: MeshSpec, rank: int):
        self.spec, self.rank, self.sizes = spec, rank, spec.sizes

    def coords(self, rank=None):
        return self.spec.coords(self.rank if rank is None else rank)


CASES = [
    ((12, 6), {"tp": Shard(0)}),
    ((12, 6), {"tp": Shard(1)}),
    ((24, 4), {"tp": Shard(0, 3)}),  # a fused q|k|v of equal blocks
    ((16, 4), {"tp": Shard(0, (8, 4, 4))}),  # unequal blocks (grouped-query attention)
    ((7, 5), {"dp": FlatShard()}),  # 35 elements over 2 or 4: padded
    ((12, 6), {"dp": FlatShard(), "tp": Shard(0)}),
    ((24, 4), {"dp": FlatShard(), "tp": Shard(0, 3)}),
    ((9,), {"dp": FlatShard(), "tp": Replicate()}),
    ((), {"dp": FlatShard()}),
    ((8, 4), {"tp": Owned(0)}),  # a head's weight, whole on the first tp rank, none of it on the others
    ((8, 4), {"dp": FlatShard(), "tp": Owned(0)}),
]


@pytest.mark.parametrize("sizes", [{"dp": 2, "tp": 2}, {"dp": 4, "tp": 1}, {"dp": 1, "tp": 2}], ids=str)
@pytest.mark.parametrize("shape,placements", CASES, ids=[f"{s}-{p}" for s, p in CASES])
def test_read_local_equals_local_shard(shape, placements, sizes):
    spec_mesh = MeshSpec(sizes)
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + 1
    spec = ParamSpec(fqn="w", shape=shape, dtype=full.dtype, placements=placements, kind="param", requires_grad=True)
    for rank in range(spec_mesh.world_size):
        mesh = _Rank(spec_mesh, rank)
        rows = []

        def read(indices):
            rows.append(len(indices[0]) if indices else 1)
            return take(full, indices)
        got = read_local(read, spec, mesh)
        want = local_shard(full, spec, mesh)
        assert torch.equal(got, want), (rank, got, want)
        if isinstance(placements.get("dp"), FlatShard) and sizes["dp"] > 1 and len(shape) == 2:
            local_rows = want.numel() // math.prod(shape[1:]) + 2  # the window's rows, and two it starts/ends in
            assert sum(rows) <= local_rows, f"rank {rank} read {sum(rows)} rows for a shard of {want.numel()} elements"


def test_an_owned_tensor_is_whole_on_its_owner_and_empty_elsewhere():
    spec_mesh = MeshSpec({"dp": 2, "tp": 2})
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    spec = ParamSpec(fqn="w", shape=(8, 4), dtype=full.dtype, placements={"dp": Replicate(), "tp": Owned(1)})
    for rank in range(4):
        mesh = _Rank(spec_mesh, rank)
        got = local_shard(full, spec, mesh)
        if mesh.coords()["tp"] == 1:
            assert torch.equal(got, full), rank
        else:
            assert got.shape == (0, 4), (rank, got.shape)
        spec.held = mesh.coords()["tp"] == 1  # as the tp_placement pass marks each rank's program
        assert spec.local_shape(spec_mesh.sizes) == tuple(got.shape)
