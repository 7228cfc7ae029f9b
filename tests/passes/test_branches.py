"""Branches over their own parameters (passes/sharding/branches.py): a ModuleList of per-head modules, found from the
graph alone, and dealt out over tp whole (Owned): each rank holds and runs its own heads, the output projection
row-parallel. Checked on each rank's compiled program (a MeshSpec, no processes); numerics against one process:
tests/models/test_plain_parity.py (head_list_plain), checkpoints: tests/runtime/test_checkpoint.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import meshc
from meshc.compiler.compile import compile_program
from meshc.compiler.ir.mesh_spec import MeshSpec
from meshc.compiler.ir.placement import Owned, Replicate, Shard
from meshc.passes.sharding.branches import branch_groups
from tests import plain_models

aten = torch.ops.aten
HEADS, LAYERS = 4, 2


def _compile(module: nn.Module, sizes: dict, rank: int = 0, **plan):
    x = torch.randint(0, plain_models.VOCAB, (2, plain_models.SEQ))
    return compile_program(module, (x,), {}, mesh=MeshSpec(sizes), plan=meshc.Plan(trace="non-strict", **plan),
                           rank=rank)[1]


class _SharedMix(nn.Module):
    """Heads with their own scales, each then through one matrix all of them read (an input from outside the
    branches, as the heads' input is), joined into the model's output."""

    def __init__(self, alike: bool = True):
        super().__init__()
        self.emb = nn.Embedding(plain_models.VOCAB, 8)
        self.scales = nn.ParameterList(nn.Parameter(torch.randn(8)) for _ in range(HEADS))
        self.mix = nn.Linear(8, 8, bias=False)
        self.alike = alike

    def forward(self, tokens):
        x = self.emb(tokens)
        if self.alike:
            return torch.cat([self.mix(x * s) for s in self.scales], dim=-1)
        return torch.cat([self.mix(x * s) if h % 2 else torch.tanh(x * s) for h, s in enumerate(self.scales)], dim=-1)


def test_per_head_modules_are_found_with_their_own_parameters():
    program = _compile(plain_models.head_list(), {"dp": 1})
    groups = branch_groups(program.gm.graph)
    assert len(groups) == LAYERS
    for layer, group in enumerate(groups):
        assert group.count == HEADS and group.dim == 2 and group.join.target == aten.cat.default
        for h, own in enumerate(group.own):
            assert [p.meta["meshc.fqn"] for p in own] == [f"blocks.{layer}.heads.{h}.{name}" for name in
                                                          ("key.weight", "query.weight", "value.weight", "tril")]
        assert len({len(body) for body in group.bodies}) == 1


def test_a_matrix_every_branch_reads_is_an_input_not_a_branch_s_own():
    program = _compile(_SharedMix(), {"dp": 1})
    (group,) = branch_groups(program.gm.graph)
    assert [[p.meta["meshc.fqn"] for p in own] for own in group.own] == [[f"scales.{h}"] for h in range(HEADS)]
    assert all(not any(p.meta.get("meshc.fqn") == "mix.weight" for p in body) for body in group.bodies)
    # their cat is the model's output, which no row-parallel layer reads: nothing is dealt out
    program = _compile(_SharedMix(), {"tp": 2})
    assert all(not isinstance(s.placements["tp"], Owned) for s in program.params.values())
    assert any("scales" not in t and "branches joined at %cat replicated: reaches the graph output" in t
               for t in program.notes), program.notes


def test_branches_through_different_ops_are_no_group():
    assert branch_groups(_compile(_SharedMix(alike=False), {"dp": 1}).gm.graph) == []


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_holds_and_runs_whole_heads_of_its_own(tp):
    k = HEADS // tp
    for rank in range(tp):
        program = _compile(plain_models.head_list(), {"tp": tp}, rank)
        placeholders = {n.meta["meshc.fqn"]: n for n in program.placeholders("param")}
        for layer in range(LAYERS):
            for h in range(HEADS):
                for name in ("key", "query", "value"):
                    spec = program.params[f"blocks.{layer}.heads.{h}.{name}.weight"]
                    assert spec.placements["tp"] == Owned(h // k)
                    assert spec.held == (h // k == rank)
                    local = tuple(placeholders[spec.fqn].meta["val"].shape)
                    assert local == ((8, 32) if spec.held else (0, 32)), (spec.fqn, local)
            proj = program.params[f"blocks.{layer}.proj.weight"]
            assert proj.placements["tp"] == Shard(1)  # row-parallel: it reads this rank's heads' features
            assert program.buffers[f"blocks.{layer}.heads.0.tril"].placements["tp"] == Replicate()
        # the rank's program runs its own heads only: a linear per held q, k and v weight, none for the others'
        read = {a.meta["meshc.fqn"] for n in program.gm.graph.nodes if n.target == aten.linear.default
                for a in n.args[1:2] if a.op == "placeholder"}
        heads = {f for f in read if ".heads." in f}
        assert heads == {f for f, s in program.params.items() if ".heads." in f and s.held and "tril" not in f}
        assert len(heads) == LAYERS * k * 3
        assert "tp coverage: 1.00 of the blocks' weight bytes sharded" in program.notes


def test_heads_not_dividing_tp_stay_replicated_with_a_reason():
    program = _compile(plain_models.head_list(), {"tp": 8})  # 4 heads over 8 ranks
    assert all(not isinstance(s.placements["tp"], Owned) for s in program.params.values())
    assert any("4 branches do not divide over tp=8" in t for t in program.notes), program.notes


def test_a_style_in_the_plan_keeps_the_heads_as_it_says():
    program = _compile(plain_models.head_list(), {"tp": 2}, tp={"*.heads.*": "replicate"})
    heads = [s for f, s in program.params.items() if ".heads." in f]
    assert heads and all(s.placements["tp"] == Replicate() and s.held for s in heads)


class _RunningHead(nn.Module):
    """A head that keeps running statistics of its output (a buffer its forward writes)."""

    def __init__(self, width: int, size: int):
        super().__init__()
        self.q = nn.Linear(width, size, bias=False)
        self.register_buffer("running", torch.zeros(size))

    def forward(self, x):
        y = self.q(x)
        with torch.no_grad():
            self.running.mul_(0.9).add_(0.1 * y.mean((0, 1)))
        return y - self.running


class _RunningHeadsLM(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.emb = nn.Embedding(plain_models.VOCAB, width)
        self.heads = nn.ModuleList(_RunningHead(width, width // HEADS) for _ in range(HEADS))
        self.proj, self.out = nn.Linear(width, width), nn.Linear(width, plain_models.VOCAB)

    def forward(self, tokens):
        x = self.emb(tokens)
        return self.out(x + self.proj(torch.cat([h(x) for h in self.heads], dim=-1)))


def test_heads_that_write_buffers_of_their_own_stay_replicated():
    """Each rank runs only its heads: a buffer a head writes would be stale on the other ranks, which hold it too."""
    assert len(branch_groups(_compile(_RunningHeadsLM(), {"dp": 1}).gm.graph)) == 1  # found as branches
    program = _compile(_RunningHeadsLM(), {"tp": 2})
    assert all(not isinstance(s.placements["tp"], Owned) for s in program.params.values())
    assert any("update buffers of their own (heads.0.running" in t for t in program.notes), program.notes
