"""head_norms (passes/attention/head_norms.py): StableLM's LayerNorm per head becomes one normalization with the
heads' weights stacked, on one rank's program; the parameters keep their names; the numerics are
tests/models/test_tp_parity.py's (stablelm at tp=2, tp=2 + sp, tp=4)."""
from __future__ import annotations

import operator

import torch

import meshc
from meshc.compiler.compile import compile_program
from meshc.compiler.ir.mesh_spec import MeshSpec
from meshc.compiler.ir.placement import Shard
from tests import zoo

aten = torch.ops.aten


def _program(model, tp: int):
    x = zoo.batches(1, 2)[0][0]
    return compile_program(model, (x,), {}, mesh=MeshSpec({"tp": tp}), plan=meshc.Plan(trace="non-strict"), rank=0)


def test_a_norm_per_head_becomes_one_and_its_projections_shard():
    model = zoo.build("stablelm")
    traced, program, _ = _program(model, 2)
    graph = program.gm.graph
    assert not [n for n in graph.nodes if n.target is aten.split.Tensor and
                any(u.target is operator.getitem for u in n.users)
                and all(next(iter(u.users)).target is aten.layer_norm.default for u in n.users)]
    assert sum(n.target is aten.stack.default for n in graph.nodes) == 2 * 2  # q and k, two layers
    assert any("norm(s) per head made one normalization" in note for r in program.pass_log for note in r.notes)
    names = {n for n, _ in model.named_parameters()}
    assert names == set(program.params)  # the per-head norms keep their own parameters
    for i in range(2):
        for proj in ("q_proj", "k_proj"):
            assert program.params[f"model.layers.{i}.self_attn.{proj}.weight"].placements["tp"] == Shard(0)


def test_other_splits_are_left_alone():
    traced, program, _ = _program(zoo.build("gpt2"), 1)
    assert any("no norm per head" in note for r in program.pass_log for note in r.notes)

