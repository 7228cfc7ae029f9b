"""The pass driver: ordered passes from the Plan, logging, switching off by name, debug dumps."""
from __future__ import annotations

import logging

import pytest

import meshc
from meshc.compiler.driver import run_passes
from meshc.compiler.trace.export import trace
from tests import zoo


def _traced(mesh, **plan):
    model = zoo.reference_transformer()
    program, _ = trace(model, (zoo.batches(1, 2)[0][0],), mesh=mesh, plan=meshc.Plan(verify=True, **plan))
    return program


def test_driver_logs_each_pass_with_time_and_changes(fake_mesh, caplog):
    program = _traced(fake_mesh(dp=2))
    with caplog.at_level(logging.INFO, logger="meshc.driver"):
        out = run_passes(program)
    assert [r.name for r in out.pass_log] == ["head_norms", "shapes", "masks", "tp_placement", "experts", "context", "tensor_parallel", "gqa",
                                              "pipeline_split", "zero", "grad_sync", "fuse_comm", "remat"]
    record = next(r for r in out.pass_log if r.name == "grad_sync")
    assert record.seconds > 0
    assert record.added == {"grad_sync": 1, "getitem": 28}
    assert record.nodes_after == record.nodes_before + 29
    assert any("pass grad_sync" in r.getMessage() and "ms" in r.getMessage() for r in caplog.records)
    # the input program is untouched: passes are pure
    assert not any(n.target.__name__ == "grad_sync" for n in program.gm.graph.nodes if n.op == "call_function"
                   and hasattr(n.target, "__name__"))


def test_disable_pass_by_name(fake_mesh):
    out = run_passes(_traced(fake_mesh(dp=2), disable=("grad_sync",)))
    assert "grad_sync" not in [r.name for r in out.pass_log]
    assert not [n for n in out.gm.graph.nodes if "meshc.comm" in n.meta]


def test_unknown_pass_name_is_an_error(fake_mesh):
    with pytest.raises(ValueError, match="unknown pass 'zero_bubble'.*grad_sync"):
        run_passes(_traced(fake_mesh(dp=2), disable=("zero_bubble",)))


def test_debug_dir_dumps_before_and_after(fake_mesh, tmp_path):
    run_passes(_traced(fake_mesh(dp=2), debug_dir=str(tmp_path)))
    before = (tmp_path / "10_grad_sync_before.txt").read_text()
    after = (tmp_path / "10_grad_sync_after.txt").read_text()
    assert "grad_sync" not in before and "grad_sync" in after
    assert "all_reduce dp" in after


def test_plan_validation():
    with pytest.raises(ValueError, match="bucket_mb"):
        meshc.Plan(bucket_mb=0)
    with pytest.raises(TypeError, match="tuple of pass names"):
        meshc.Plan(disable="grad_sync")


def _broken_pass(program):
    """A pass with a bug: indexes past the end of an op's arguments at the first linear layer."""
    for node in program.gm.graph.nodes:
        if node.op == "call_function" and "linear" in str(node.target):
            return node.args[7]
    return program


def test_a_bare_exception_from_a_pass_names_the_pass_the_node_and_the_source(fake_mesh):
    from meshc.passes.shapes import shapes_pass

    program = _traced(fake_mesh(dp=2))
    with pytest.raises(meshc.MeshcInternalError) as info:
        run_passes(program, [("shapes", shapes_pass), ("broken", _broken_pass)])
    text = str(info.value)
    assert text.startswith("pass 'broken': expected to compile this graph, got IndexError: tuple index out of range")
    assert "at node %linear : [num_users=1] = call_function[target=torch.ops.aten.linear.default]" in text
    # the model's own line that made the node (torch's reference Transformer: not torch.nn.Linear's line)
    assert "(op aten.linear.default in module layers.0.attention.wq; model source: File " in text
    assert "common_dtensor.py" in text
    assert "queries, keys, values = self.wq(x), self.wk(x), self.wv(x))" in text
    assert "bug in meshc" in text
    assert isinstance(info.value.original, IndexError) and info.value.__cause__ is info.value.original
    assert info.value.node.name == "linear"


def test_a_meshc_error_from_a_pass_passes_through_unchanged(fake_mesh):
    def refusing(program):
        raise meshc.MeshcError("rule: expected A, got B")

    with pytest.raises(meshc.MeshcError) as info:
        run_passes(_traced(fake_mesh(dp=2)), [("refusing", refusing)])
    assert str(info.value) == "rule: expected A, got B"
