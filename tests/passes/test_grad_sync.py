"""grad_sync: buckets in first-use order, one backward all-reduce each, counted in the graph and at run time."""
from __future__ import annotations

import torch

import meshc
from meshc.compiler.driver import run_passes
from meshc.compiler.trace.export import trace
from meshc.runtime.monitor.census import CommCensus
from tests import zoo
from tests.harness import run_ranks


def _program(mesh, model=None, **plan):
    model = model or zoo.reference_transformer()
    traced, _ = trace(model, (zoo.batches(1, 2)[0][0],), mesh=mesh, plan=meshc.Plan(verify=True, **plan))
    return run_passes(traced)


def _syncs(program):
    return [n for n in program.gm.graph.nodes if "meshc.bucket" in n.meta]


def test_buckets_cover_every_trainable_param_once_in_first_use_order(fake_mesh):
    program = _program(fake_mesh(dp=2), bucket_mb=8 / 1024)  # 8 KiB buckets: several per block
    syncs = _syncs(program)
    assert len(syncs) > 5
    fqns = [f for s in syncs for f in s.meta["meshc.bucket"]]
    assert sorted(fqns) == sorted(program.params)
    assert fqns[0] == "tok_embeddings.weight" and fqns[-1] == "norm.bias"
    sizes = program.mesh.sizes
    for s in syncs:
        (record,) = s.meta["meshc.comm"]
        assert (record.kind, record.axis, record.phase) == ("all_reduce", "dp", "backward")
        assert record.bytes == sum(program.params[f].local_bytes(sizes) for f in s.meta["meshc.bucket"])
        assert len(s.meta["meshc.bucket"]) == 1 or record.bytes <= 8 * 1024
    # each parameter is now reached only through its bucket
    for fqn, node in program.param_nodes().items():
        assert [u.meta.get("meshc.bucket") is not None for u in node.users] == [True]


def test_frozen_parameters_are_not_reduced(fake_mesh):
    model = zoo.reference_transformer()
    model.pos_embeddings.weight.requires_grad_(False)
    program = _program(fake_mesh(dp=2), model=model)
    assert "pos_embeddings.weight" not in [f for s in _syncs(program) for f in s.meta["meshc.bucket"]]


def test_dp_of_one_inserts_nothing(fake_mesh):
    program = _program(fake_mesh(dp=1, rank=0))
    assert _syncs(program) == []


def _runtime_census(bucket_mb: float) -> dict:
    mesh = meshc.mesh(timeout_s=60)
    job = meshc.compile(zoo.reference_transformer(), mesh, example_inputs=(zoo.batches(1, 2)[0][0],),
                        plan=meshc.Plan(bucket_mb=bucket_mb))
    x, y = zoo.batches(1, 2)[0]
    with CommCensus(mesh) as census:
        job.step(x, y, zoo.lm_loss)
    report = job.explain()
    return {"runtime": census.by_kind(), "graph": [(c.kind, c.axis, c.bytes, c.phase) for c in report.collectives]}


def test_runtime_collectives_match_the_graph():
    out = run_ranks(_runtime_census, 2, 8 / 1024, timeout=90)[0]
    graph = out["graph"]
    assert graph and all(kind == "all_reduce" and axis == "dp" for kind, axis, _, _ in graph)
    calls, nbytes = out["runtime"][("all_reduce", "dp")]
    # the graph's buckets, plus the 4-byte loss average that job.step reports
    assert calls == len(graph) + 1
    assert nbytes == sum(b for _, _, b, _ in graph) + torch.tensor(0.0).element_size()
