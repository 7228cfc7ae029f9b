"""meshc.mesh: sizes, errors, coordinates and the groups of every axis."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import meshc
from meshc.compiler.ir.mesh_spec import MeshSpec, parse_sizes, spec_sizes
from meshc.runtime.mesh import world_axes
from tests.harness import run_ranks


def test_world_of_one_without_torchrun(single_mesh):
    assert single_mesh.sizes == {"pp": 1, "dp": 1, "tp": 1}
    assert single_mesh.rank == 0 and single_mesh.world_size == 1
    x = torch.arange(6).view(3, 2)
    assert torch.equal(single_mesh.shard_batch(x), x)


def test_sizes_must_multiply_to_world(single_mesh):
    with pytest.raises(ValueError, match=r"expected dp×cp×tp×pp to equal the world size 1, got 2×1×1×1"):
        meshc.mesh(dp=2)
    with pytest.raises(ValueError, match="cp×tp×pp = 1×2×1 = 2 does not divide the world of 1"):
        meshc.mesh(tp=2)


def test_cp_is_a_factor_of_the_world_and_the_old_spelling_is_told_what_to_write():
    """world = dp × cp × tp × pp, as Megatron-Core and torchtitan count; MeshSpec's dp is the gradient group."""
    assert world_axes(8, dp=None, cp=2, tp=2, pp=1) == 2
    with pytest.raises(ValueError, match=r"dp×cp×tp×pp to equal the world size 4, got 4×2×1×1 = 8; cp is an axis of "
                                         r"its own.*write dp=2, cp=2"):
        world_axes(4, dp=4, cp=2, tp=1, pp=1)  # the old meaning: dp counted the cp ranks
    spec = MeshSpec(spec_sizes(dp=2, cp=2, tp=2))
    assert spec.world_size == 8 and spec.size("dp") == 4 and spec.group_ranks("dp", 0) == (0, 2, 4, 6)
    assert spec.group_ranks("cp", 0) == (0, 2) and spec.axes == {"dp": 2, "cp": 2, "tp": 2, "pp": 1}
    assert spec.describe().startswith("dp=2 × cp=2 × tp=2 × pp=1 (8 ranks")


def test_unknown_axis_and_bad_sizes(single_mesh):
    with pytest.raises(ValueError, match="unknown axis 'sp': expected axes among dp, ep, cp, tp, pp"):
        meshc.mesh(sp=2)
    with pytest.raises(ValueError, match=r"cp×tp×pp = 2×1×1 = 2 does not divide the world of 1 ranks"):
        meshc.mesh(cp=2)  # a world of one
    with pytest.raises(ValueError, match="expected tp to be a positive int, got 0"):
        meshc.mesh(tp=0)
    with pytest.raises(ValueError, match="unknown axis 'sp'"):
        parse_sizes("dp=2,sp=2")
    with pytest.raises(ValueError, match="expected ep to divide dp"):
        MeshSpec({"dp": 6, "ep": 4})
    with pytest.raises(ValueError, match="'axis=size' pairs"):
        parse_sizes("dp:2")


def test_expert_axes_fold_into_dp():
    """ep splits dp as edp × ep, ep innermost: experts over consecutive dp ranks, their replicas every ep-th."""
    spec = MeshSpec({"dp": 4, "ep": 2, "tp": 2, "pp": 2})
    assert spec.world_size == 16 and spec.sizes == {"pp": 2, "dp": 4, "tp": 2, "ep": 2, "edp": 2}
    # rank 13 = pp 1, dp 2, tp 1; dp 2 = edp 1 × ep 0
    assert spec.coords(13) == {"pp": 1, "dp": 2, "tp": 1, "ep": 0, "edp": 1}
    assert spec.group_ranks("dp", 13) == (9, 11, 13, 15)
    assert spec.group_ranks("ep", 13) == (13, 15)
    assert spec.group_ranks("edp", 13) == (9, 13)
    assert spec.all_groups("ep") == [(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)]
    assert all(spec.rank_at(spec.coords(r)) == r for r in range(16))
    assert "ep" not in MeshSpec({"dp": 4}).sizes  # a mesh without experts keeps exactly pp, dp, tp
    assert MeshSpec({"dp": 4}).size("ep") == 1 and parse_sizes("dp=4,ep=2") == {"dp": 4, "ep": 2}


def test_coordinates_tp_innermost(fake_mesh):
    mesh = fake_mesh(dp=2, tp=2, pp=2, rank=5)  # rank 5 = pp 1, dp 0, tp 1
    assert mesh.coords() == {"pp": 1, "dp": 0, "tp": 1}
    assert mesh.group_ranks("tp") == (4, 5)
    assert mesh.group_ranks("dp") == (5, 7)
    assert mesh.group_ranks("pp") == (1, 5)
    assert mesh.all_groups("dp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert all(mesh.rank_at(mesh.coords(r)) == r for r in range(8))


def test_shard_batch_needs_divisible_batch(fake_mesh):
    mesh = fake_mesh(dp=4, rank=1)
    assert torch.equal(mesh.shard_batch(torch.arange(8)), torch.tensor([2, 3]))
    with pytest.raises(ValueError, match="divisible by dp=4.*shape \\(6,\\)"):
        mesh.shard_batch(torch.arange(6))


def _groups_on_rank() -> dict:
    mesh = meshc.mesh(tp=2, timeout_s=30)
    out = {"coords": mesh.coords(), "names": {a: mesh.group_name(a) for a in ("dp", "tp")},
           "other": {r: mesh.group_name("tp", r) for r in range(4)}}
    # each axis group really connects the ranks it names
    for axis in ("dp", "tp"):
        t = torch.tensor([float(mesh.rank)])
        dist.all_reduce(t, group=mesh.group(axis))
        out[f"sum_{axis}"] = t.item()
    out["device_mesh"] = mesh.device_mesh.mesh_dim_names
    return out


def test_groups_across_four_processes():
    results = run_ranks(_groups_on_rank, 4, timeout=60)
    assert [r["coords"] for r in results] == [
        {"pp": 0, "dp": d, "tp": t} for d in range(2) for t in range(2)]
    assert [r["sum_tp"] for r in results] == [1, 1, 5, 5]
    assert [r["sum_dp"] for r in results] == [2, 4, 2, 4]
    # every rank knows the name of every rank's group, and they agree with the owners'
    for r in results:
        assert r["other"] == {q: results[q]["names"]["tp"] for q in range(4)}
    assert results[0]["device_mesh"] == ("pp", "dp", "tp")
