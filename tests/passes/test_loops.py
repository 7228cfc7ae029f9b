"""Loops over the parts of a dim (passes/sharding/loops.py): found from the graph alone, and folded on tp so that each
rank runs the iterations of the parts it holds. Checked on one rank's compiled program (a MeshSpec, no processes); numerics
against one process: tests/models/test_tp_parity.py (Zamba, the plain head loop)."""
from __future__ import annotations

import torch
import torch.nn as nn

import meshc
from meshc.compiler.compile import compile_program
from meshc.compiler.ir.mesh_spec import MeshSpec
from meshc.compiler.ir.placement import Replicate, Shard
from meshc.passes.sharding.loops import loop_of
from tests import plain_models

aten = torch.ops.aten


def _graph(module: nn.Module, *inputs):
    _, program, _ = compile_program(module, inputs, {}, mesh=MeshSpec({"dp": 1}), plan=meshc.Plan(trace="non-strict"),
                                    rank=0)
    return program.gm.graph


class _Heads(nn.Module):
    """Each of 4 heads scaled by its own parameter and through one shared matrix, the results joined by a cat."""

    def __init__(self):
        super().__init__()
        self.scale, self.mix = nn.Parameter(torch.randn(4, 8)), nn.Parameter(torch.randn(8, 8))

    def forward(self, x):  # x: (4, 2, 8)
        return torch.cat([torch.tanh(x[h] * self.scale[h]) @ self.mix for h in range(4)], dim=-1)


class _Recurrence(nn.Module):
    """A scan over time: step t reads step t-1's state, so its iterations are not independent."""

    def forward(self, x):  # x: (2, 5, 8)
        h, outs = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = 0.5 * h + x[:, t]
            outs.append(h)
        return torch.stack(outs, dim=1)


class _Unlike(nn.Module):
    """Parts taken apart and joined in order, but put through different ops: not a loop."""

    def forward(self, x):  # x: (3, 2, 8)
        return torch.cat([x[0] * 2, torch.tanh(x[1]), x[2] + 1], dim=-1)


def test_a_loop_over_heads_is_found_with_its_sources_and_join():
    graph = _graph(_Heads(), torch.randn(4, 2, 8))
    loops = {id(lp): lp for lp in loop_of(graph).values()}
    assert len(loops) == 1, loops
    (loop,) = loops.values()
    assert loop.count == 4 and loop.join.target == aten.cat.default and loop.dim == 1
    assert sorted(s.name for s in loop.sources) == ["p_scale", "x"] and set(loop.sources.values()) == {0}
    assert len({len(b) for b in loop.bodies}) == 1 and len(loop.bodies[0]) >= 4  # two selects, mul, tanh, matmul


def test_a_scan_over_time_and_unlike_parts_are_not_loops():
    assert loop_of(_graph(_Recurrence(), torch.randn(2, 5, 8))) == {}
    assert loop_of(_graph(_Unlike(), torch.randn(3, 2, 8))) == {}


def test_each_rank_runs_the_iterations_of_its_heads():
    """The plain head loop (two blocks of 4 heads of 8) at tp=2 and tp=4: its input projection column-parallel by heads,
    each head's own scale sharded with them, the matrix every head shares whole, the output projection row-parallel;
    the rank's program keeps 4/tp iterations of each loop, and their cat is its shard."""
    for tp in (2, 4):
        model = plain_models.head_loop(layers=2)
        _, program, _ = compile_program(model, (torch.zeros(2, plain_models.SEQ, dtype=torch.long),), {},
                                        mesh=MeshSpec({"tp": tp}), plan=meshc.Plan(trace="non-strict"), rank=0)
        local = {f: tuple(s.local_shape(program.mesh.sizes)) for f, s in program.params.items()}
        cats = [n for n in program.gm.graph.nodes if n.target == aten.cat.default]
        assert len(cats) == 2
        # every block as Megatron pairs it; the last block's out is not the head's row layer (an LM head is left to
        # the vocabulary decision: a row-parallel head all-reduces the logits)
        assert local["head.weight"] == (64, 32)
        for b, cat in enumerate(cats):
            assert local[f"blocks.{b}.inp.weight"] == (32 // tp, 32)
            assert local[f"blocks.{b}.scale"] == (4 // tp, 8) and local[f"blocks.{b}.out.weight"] == (32, 32 // tp)
            assert local[f"blocks.{b}.mix"] == (8, 8)
            assert len(cat.args[0]) == 4 // tp and cat.meta["meshc.placement"]["tp"] == Shard(2)
            heads = [a.args[0].args[0].args[0] for a in cat.args[0]]  # div <- cumsum <- matmul <- tanh
            assert all(h.target == aten.tanh.default and h.meta["meshc.placement"]["tp"] == Replicate() for h in heads)
