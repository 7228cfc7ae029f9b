"""The compile-time half needs no process group: `meshc explain` (explain_cli.simulate) and the planner's
compiled path run on MeshSpecs alone. torch.distributed's group constructors are made to fail here, so any
process group, real or fake, that either tried to create would fail the test."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshc.compiler.cost import hardware
from meshc.compiler.planner.search import Search
from meshc.compiler.planner.compiled import plan_compiled
from meshc.explain_cli import simulate
from tests import zoo


@pytest.fixture
def no_groups(monkeypatch):
    if dist.is_initialized():
        dist.destroy_process_group()

    def refuse(*args, **kwargs):
        raise AssertionError("a process group was created at compile time")
    for name in ("init_process_group", "new_group", "new_subgroups"):
        monkeypatch.setattr(dist, name, refuse)
    yield
    assert not dist.is_initialized()


def test_explain_compiles_a_rank_of_a_large_mesh_with_no_process_group(no_groups):
    sim = simulate("gpt2-small", {"dp": 4, "tp": 2, "pp": 2}, rank=5, layers=2, batch=8)
    text = str(sim.report)
    assert "rank 5 of 16" in text and "no process group" in text
    assert "tp:S(" in text  # sharded for tp=2: the compiler really ran its passes for that rank
    assert sim.compiled.step_time > 0


def test_planner_compiled_path_with_no_process_group(no_groups):
    x = zoo.batches(1, 4)[0][0]
    search = Search(zero=(0, 3), remat=("none",), schedules=("1f1b",), microbatches=(1, 2),
                    sequence_parallel=(False,), vocab_parallel=(False,), meshes=((2, 1, 1), (1, 2, 1), (1, 1, 2)))
    result = plan_compiled(lambda: zoo.build("reference"), lambda dp: (x[: x.shape[0] // dp],), 2,
                           hardware.load("h100"), memory=80e9, search=search)
    assert {(r.candidate.dp, r.candidate.tp, r.candidate.pp) for r in result.ranked} == {(2, 1, 1), (1, 2, 1), (1, 1, 2)}
    assert torch.isfinite(torch.tensor(result.best.estimate.step_time))
