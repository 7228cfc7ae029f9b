"""verify() catches graphs broken by hand: each invariant has a test that breaks it."""
from __future__ import annotations

import operator

import pytest
import torch

import meshc
from meshc.compiler.driver import run_passes
from meshc.compiler.ir.placement import R, S
from meshc.compiler.trace.export import trace
from meshc.compiler.verify import verify
from tests import zoo


@pytest.fixture
def program(fake_mesh):
    mesh = fake_mesh(dp=2)
    traced, _ = trace(zoo.reference_transformer(), (zoo.batches(1, 2)[0][0],), mesh=mesh, plan=meshc.Plan())
    return run_passes(traced)


def test_transformed_program_verifies(program):
    verify(program)


def test_inserted_node_without_why(program):
    sync = next(n for n in program.gm.graph.nodes if "meshc.comm" in n.meta)
    del sync.meta["meshc.why"]
    with pytest.raises(meshc.MeshcInternalError, match="without meshc.why"):
        verify(program)


def test_use_before_definition(program):
    graph = program.gm.graph
    first = next(n for n in graph.nodes if n.op == "call_function")
    with graph.inserting_before(first):
        bad = graph.call_function(operator.neg, (first,))  # uses `first` before it is computed
    bad.meta["meshc.why"] = "test"
    with pytest.raises(meshc.MeshcInternalError, match="graph lint"):
        verify(program)


def test_placement_that_does_not_cover_the_mesh(program):
    spec = next(iter(program.params.values()))
    del spec.placements["dp"]
    with pytest.raises(meshc.MeshcInternalError, match="do not cover the mesh axes"):
        verify(program)


@pytest.fixture
def tp_program(fake_mesh):
    mesh = fake_mesh(tp=2)
    # fusion off: the tests below edit the plain gelu that the fusion pass would fold into meshc::bias_act
    traced, _ = trace(zoo.reference_transformer(), (zoo.batches(1, 2)[0][0],), mesh=mesh,
                      plan=meshc.Plan(fusion=False))
    return run_passes(traced)


def test_tp_program_verifies(tp_program):
    verify(tp_program)


def test_local_shape_disagrees_with_placement(tp_program):
    spec = tp_program.params["layers.0.attention.wq.weight"]
    spec.placements["tp"] = R  # claims the whole weight, but the graph holds a shard
    with pytest.raises(meshc.MeshcInternalError, match=r"placeholder shape \(16, 32\) != local shape \(32, 32\)"):
        verify(tp_program)


def test_value_shape_disagrees_with_its_placement(tp_program):
    node = next(n for n in tp_program.gm.graph.nodes if n.target == torch.ops.aten.gelu.default)
    node.meta["meshc.placement"] = {"tp": S(1)}  # the real value is sharded on dim 2
    with pytest.raises(meshc.MeshcInternalError, match=r"local shape \(2, 16, 64\) != \(2, 8, 128\)"):
        verify(tp_program)


def test_missing_parameter_placeholder(program):
    graph = program.gm.graph
    node = program.param_nodes()["norm.bias"]
    with graph.inserting_before(node):
        zeros = graph.call_function(torch.zeros, ((32,),))
    node.replace_all_uses_with(zeros)
    graph.erase_node(node)
    zeros.meta["meshc.why"] = "test"
    with pytest.raises(meshc.MeshcInternalError, match="param placeholders differ from the specs"):
        verify(program)


def test_unknown_meta_key(program):
    next(iter(program.gm.graph.nodes)).meta["meshc.colour"] = "blue"
    with pytest.raises(meshc.MeshcInternalError, match="unknown meta key 'meshc.colour'"):
        verify(program)
