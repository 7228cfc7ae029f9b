"""The tensor-parallel plan chosen over the whole graph (passes/sharding/whole_graph.py): the choice itself on
tables of options, and on a model where Megatron's rule taken in graph order loses (tests/plain_models.WideningLM):
the predicted traffic of the chosen plan equals the census of the collectives the compiled graph holds.

Training parity of that model under the chosen plan is in tests/models/test_tp_parity.py.
"""
from __future__ import annotations

import re

import pytest
import torch

import meshc
from meshc.compiler.compile import compile_program
from meshc.compiler.ir.mesh_spec import MeshSpec
from meshc.compiler.ir.placement import Replicate, Shard
from meshc.passes.sharding.whole_graph import Option, choose, score
from tests import plain_models

PLAN = meshc.Plan(trace="non-strict", verify=True, check_trace=False)


def _o(keys: str, sharded: int, comm: float, shape=None) -> Option:
    return Option(frozenset(keys.split()), sharded, comm, int(comm), shape)


# (options, the indices chosen, why)
TABLE = [
    ([_o("a b", 36, 272), _o("b c", 40, 80)], [1], "the later pairing shards more bytes: the earlier loses"),
    ([_o("a b", 40, 272), _o("b c", 40, 80)], [1], "equal bytes: the one with less traffic"),
    ([_o("a b", 40, 80), _o("c d", 10, 50)], [0, 1], "no shared weight: both"),
    ([_o("a b", 20, 10), _o("b c", 25, 10), _o("c d", 20, 10)], [0, 2], "two outer options beat the middle one"),
    ([], [], "nothing to choose"),
]


@pytest.mark.parametrize("options, chosen, why", TABLE, ids=[row[2] for row in TABLE])
def test_choice_table(options, chosen, why):
    assert choose(options) == chosen, why


def test_identical_components_are_solved_once_and_alike():
    """Blocks of the same shape (names without the block index, sizes) get the same choice by position."""
    block = lambda i: [_o(f"{i}.a {i}.b", 36, 272, ("ab", 36)), _o(f"{i}.b {i}.c", 40, 80, ("bc", 40))]
    options = block(0) + block(1) + block(2)
    assert choose(options) == [1, 3, 5]
    assert score([options[i] for i in (1, 3, 5)]) == (120, -240.0)


def _compile(sizes: dict, model=None):
    model = model or plain_models.widening()
    x = torch.randint(0, plain_models.VOCAB, (2, plain_models.SEQ))
    return compile_program(model, (x,), {}, mesh=MeshSpec(sizes), plan=PLAN, rank=0)[1]


def test_whole_graph_choice_beats_greedy_and_predicts_the_census():
    program = _compile({"tp": 2})
    for i in range(2):  # a replicated, b column-parallel, c row-parallel: not Megatron's (a col, b row) in order
        p = {k: program.params[f"blocks.{i}.{k}.weight"].placements["tp"] for k in "abc"}
        assert p == {"a": Replicate(), "b": Shard(0), "c": Shard(1)}, p
    note = next(line for line in program.notes if line.startswith("tp: whole-graph choice"))
    (chosen, greedy), = re.findall(r"predicted (\d+) vs (\d+) bytes", note)
    census = sum(r.bytes for _, r in program.comm_records() if r.axis == "tp")
    assert int(chosen) == census, (note, census)  # the forward all-reduces of c's outputs, backward of b's inputs
    tokens = 2 * plain_models.SEQ
    assert census == 2 * tokens * 4 * (16 + 4 * 16)  # 2 blocks, fp32: c's h-wide output, b's 4h-wide input
    assert int(greedy) == 2 * tokens * 4 * (16 * 16 + 16)  # greedy's: b's 16h-wide output, a's h-wide input
    assert "whole-graph" in program.decisions["tp_plan"].line("tp_plan")
