"""Ops without a meshc rule take DTensor's registered strategy (compiler/ir/op_strategies.py, through
passes/tp_table.strategy_rule): a table of ops and input placements against the decision, on one-op graphs.

Training parity of a model whose only path to a sharded plan is those strategies (tests/plain_models.ScanLM:
logcumsumexp and cumprod over the sequence of column-parallel features) is in tests/models/test_tp_parity.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from meshc.compiler.ir.placement import P, R, Shard
from meshc.passes.tp_rules import RuleCtx
from meshc.passes.tp_table import rule_for, strategy_rule

aten = torch.ops.aten
S0, S1, S2 = Shard(0), Shard(1), Shard(2)

# (op, input shape, input placement, other args, required input placement (None: as it is), output, note)
TABLE = [
    # the router's top-k over experts sharded by column: gathered first, both outputs whole
    (aten.topk.default, (8, 4), S1, (2, -1), R, (R, R), "DTensor's strategy for aten::topk needs inputs whole"),
    (aten.topk.default, (8, 4), S0, (2, -1), None, (S0, S0), None),  # top-k within each row: rows stay sharded
    (aten.logcumsumexp.default, (2, 8, 4), S2, (1,), None, S2, None),  # a scan along another dim keeps the shard
    (aten.cumprod.default, (2, 8, 4), S1, (1,), R, R, "needs inputs whole"),  # along the sharded dim: gathered
    (aten.cummax.default, (2, 8, 4), S2, (1,), None, (S2, S2), None),
    (aten.sort.default, (2, 8, 4), S2, (1,), None, (S2, S2), None),
    (aten.linalg_vector_norm.default, (2, 8, 4), S2, (2, [1]), None, S1, None),  # over dim 1: the shard moves down
    (aten.histc.default, (16,), S0, (4, 0, 3), None, P, None),  # histograms of row shards: partial counts
    (aten.logsumexp.default, (8, 4), S0, ([1],), None, S0, None),
    # no strategy in DTensor's registry: replicated, the note names the op
    (aten.roll.default, (8, 4), S1, ([1], [1]), R, R, "no tensor-parallel rule or DTensor strategy for aten::roll"),
    (aten.flip.default, (8, 4), S0, ([1],), R, R, "no tensor-parallel rule or DTensor strategy for aten::flip"),
]


def _one_op(op, shape, extra) -> tuple[fx.Node, fx.Node]:
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"], x.meta["meshc.shape"] = torch.empty(shape), shape
    node = graph.call_function(op, (x, *extra))
    out = op(torch.rand(shape), *extra)
    node.meta["val"] = out
    node.meta["meshc.shape"] = tuple(tuple(o.shape) for o in out) if isinstance(out, tuple) else tuple(out.shape)
    return x, node


@pytest.mark.parametrize("op, shape, placement, extra, required, out, note", TABLE,
                         ids=[f"{row[0]._opname}-{row[2]}" for row in TABLE])
def test_strategy_table(op, shape, placement, extra, required, out, note):
    assert rule_for(op) is strategy_rule  # no meshc rule of its own: the registry decides
    x, node = _one_op(op, shape, extra)
    decision = strategy_rule(node, RuleCtx(2, {x: placement}))
    assert decision.inputs == ({} if required is None else {(0,): required})
    assert decision.out == out
    assert (decision.note is None) if note is None else (note in decision.note), decision.note


def test_a_decision_must_make_the_local_shapes():
    """DTensor's decision is taken only where the op, run on meta tensors of the inputs' local shapes with its other
    arguments as they are, makes the output's local shapes: an argument holding a whole-tensor size fails."""
    from meshc.compiler.ir.op_strategies import _runs_locally

    for sizes, runs in (([-1, 4], True), ([8, 4], False)):  # (8, 4) rows sharded: 4 local rows, not 8
        x, node = _one_op(aten.reshape.default, (8, 4), (sizes,))
        assert _runs_locally(node, {(0,): S0}, S0, 2) is runs, sizes
