"""Tensor-parallel rules as tables: one op on hand-built inputs of given shapes and placements, and the
Decision its rule gives (output placement, inputs to redistribute, a note where a shard is given up).

Each row: op, inputs (T(shape) for a tensor), the placement of each tensor input in order, the axis size,
and the expected output placement and required input placements (by arg path: (i,) args[i], (i, j) inside
a list). Shapes are global; the rules read them from "meshc.shape" as the shapes pass writes it.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import pytest
import torch
import torch.fx as fx

from meshc.compiler.ir.errors import MeshcInternalError
from meshc.compiler.ir.placement import P, R, S
from meshc.compiler.ir.placement import Whole as W
from meshc.passes.shapes import shape_of
from meshc.passes.tp_rules import COMPUTE_RULES, RuleCtx, no_rule, pointwise_rule
from meshc.passes.tp_table import RULES, build_table, infer, rule_for, strategy_rule
from meshc.passes.tp_views import VIEW_RULES, view_rule
from meshc.passes.tp_vocab import VOCAB_RULES
from meshc.runtime.ops.tp_ops import vocab_parallel_cross_entropy, vocab_parallel_embedding

aten = torch.ops.aten


@dataclass(frozen=True)
class T:
    """A tensor input of the op: its global shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32


def build(target, args: tuple, kwargs: dict | None = None) -> tuple[fx.Node, list[fx.Node]]:
    """One call of `target` on placeholders for the T inputs, its "val" and "meshc.shape" from meta tensors."""
    graph, inputs = fx.Graph(), []

    def convert(a):
        if isinstance(a, T):
            node = graph.placeholder(f"x{len(inputs)}")
            node.meta["val"] = torch.empty(a.shape, dtype=a.dtype, device="meta")
            node.meta["meshc.shape"] = shape_of(node.meta["val"])
            inputs.append(node)
            return node
        if isinstance(a, (list, tuple)):
            return type(a)(convert(x) for x in a)
        return a

    args, kwargs = convert(args), {k: convert(v) for k, v in (kwargs or {}).items()}
    node = graph.call_function(target, args, kwargs)
    vals = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    node.meta["val"] = target(*vals[0], **vals[1])
    node.meta["meshc.shape"] = shape_of(node.meta["val"])
    return node, inputs


def decide(target, args, placements, n=2, kwargs=None, **ctx):
    node, inputs = build(target, args, kwargs)
    assert len(inputs) == len(placements), "one placement per tensor input"
    rule_ctx = RuleCtx(n, dict(zip(inputs, placements)), **ctx)
    return node, infer(node, rule_ctx)


X = T((2, 3, 8))  # (B, T, H) activations
LONG = torch.int64

# id, op, args, input placements, axis size, expected out, expected required inputs, a note expected
COMPUTE = [
    # pointwise: shards align on the output dim; a replicated operand is sliced; P stays P only where linear
    ("add S+S", aten.add.Tensor, (T((2, 4)), T((2, 4))), [S(1), S(1)], 2, S(1), {}, False),
    ("sdpa: one kv head stays whole", aten.scaled_dot_product_attention.default,
     (T((2, 4, 3, 8)), T((2, 1, 3, 8)), T((2, 1, 3, 8))), [S(1), R, R], 2, S(1), {}, False),
    ("matmul by whole blocks elsewhere gathers", aten.mm.default, (T((4, 64)), T((64, 8))),
     [S(1, (32, W(16), W(16))), R], 2, R, {(0,): R, (1,): R}, True),
    ("add S+R slices R", aten.add.Tensor, (T((2, 4)), T((2, 4))), [S(1), R], 2, S(1), {(1,): S(1)}, False),
    ("add S+R broadcast bias", aten.add.Tensor, (T((2, 4)), T((4,))), [S(1), R], 2, S(1), {(1,): S(0)}, False),
    ("add S(0)+R broadcast over it", aten.add.Tensor, (T((4, 6)), T((6,))), [S(0), R], 2, S(0), {}, False),
    ("add misaligned shards", aten.add.Tensor, (T((4, 6)), T((4, 6))), [S(0), S(1)], 2, S(0), {(1,): S(0)}, False),
    ("add P+P", aten.add.Tensor, (T((2, 4)), T((2, 4))), [P, P], 2, P, {}, False),
    ("add P+R reduces", aten.add.Tensor, (T((2, 4)), T((2, 4))), [P, R], 2, R, {(0,): R}, False),
    ("add P+scalar reduces", aten.add.Tensor, (T((2, 4)), 1.0), [P], 2, R, {(0,): R}, False),
    ("mul P*R stays P", aten.mul.Tensor, (T((2, 4)), T((2, 4))), [P, R], 2, P, {}, False),
    ("div R/P reduces", aten.div.Tensor, (T((2, 4)), T((2, 4))), [R, P], 2, R, {(1,): R}, False),
    ("gelu (tagged pointwise) S", aten.gelu.default, (X,), [S(2)], 2, S(2), {}, False),
    ("relu of P reduces", aten.relu.default, (T((2, 4)),), [P], 2, R, {(0,): R}, False),
    ("dropout of S", aten.dropout.default, (X, 0.1, True), [S(2)], 2, S(2), {}, False),
    ("dropout of P reduces", aten.dropout.default, (X, 0.1, True), [P], 2, R, {(0,): R}, False),
    ("to.dtype keeps S", aten.to.dtype, (X, torch.float16), [S(1)], 2, S(1), {}, False),
    # matmuls: column parallel, row parallel (partial sum), batch and row shards; biases follow
    ("linear column", aten.linear.default, (X, T((6, 8))), [R, S(0)], 2, S(2), {}, False),
    ("linear column, chunked", aten.linear.default, (X, T((6, 8))), [R, S(0, 3)], 2, S(2, 3), {}, False),
    ("linear row", aten.linear.default, (T((2, 3, 6)), T((8, 6))), [S(2), S(1)], 2, P, {(0,): S(2)}, False),
    ("linear row slices a whole x", aten.linear.default, (T((2, 3, 6)), T((8, 6))), [R, S(1)], 2, P,
     {(0,): S(2)}, False),
    ("linear column, bias sliced", aten.linear.default, (X, T((6, 8)), T((6,))), [R, S(0), R], 2, S(2),
     {(2,): S(0)}, False),
    ("linear row with a bias gathers", aten.linear.default, (T((2, 3, 6)), T((8, 6)), T((8,))), [S(2), S(1), R], 2,
     R, {(0,): R, (1,): R, (2,): R}, True),
    ("linear x's k sharded, W whole", aten.linear.default, (T((2, 3, 6)), T((8, 6))), [S(2), R], 2, P,
     {(1,): S(1)}, False),
    ("linear batch-sharded x", aten.linear.default, (X, T((6, 8))), [S(0), R], 2, S(0), {}, False),
    ("matmul x @ W.T column", aten.matmul.default, (X, T((8, 6))), [R, S(1)], 2, S(2), {}, False),
    ("matmul x @ W.T row", aten.matmul.default, (T((2, 3, 6)), T((6, 8))), [S(2), S(0)], 2, P, {(0,): S(2)},
     False),
    ("mm rows", aten.mm.default, (T((4, 8)), T((8, 6))), [S(0), R], 2, S(0), {}, False),
    ("mm P@R stays P", aten.mm.default, (T((4, 8)), T((8, 6))), [P, R], 2, P, {}, False),
    ("mm P@P reduces one side", aten.mm.default, (T((4, 8)), T((8, 6))), [P, P], 2, P, {(1,): R}, False),
    ("bmm batch on both", aten.bmm.default, (T((4, 3, 8)), T((4, 8, 5))), [S(0), S(0)], 2, S(0), {}, False),
    ("bmm misaligned batch", aten.bmm.default, (T((4, 3, 8)), T((4, 8, 5))), [S(0), S(1)], 2, P,
     {(0,): S(2)}, False),
    ("addmm column, bias sliced", aten.addmm.default, (T((6,)), T((4, 8)), T((8, 6))), [R, R, S(1)], 2, S(1),
     {(0,): S(0)}, False),
    # a bias of more dims (BLOOM's ALiBi, (heads, 1, keys), added to scores with their keys sharded over cp):
    # sliced on its columns like the output; one broadcast over them (size 1) stays whole
    ("baddbmm column, bias columns sliced", aten.baddbmm.default, (T((4, 1, 6)), T((4, 3, 8)), T((4, 8, 6))),
     [R, R, S(2)], 2, S(2), {(0,): S(2)}, False),
    ("baddbmm column, broadcast bias whole", aten.baddbmm.default, (T((4, 3, 1)), T((4, 3, 8)), T((4, 8, 6))),
     [R, R, S(2)], 2, S(2), {(0,): R}, False),
    # reductions: over the sharded dim a sum becomes a partial sum; other reductions gather
    ("sum over the shard", aten.sum.dim_IntList, (T((4, 6)), [1]), [S(1)], 2, P, {}, False),
    ("sum elsewhere, shard shifts", aten.sum.dim_IntList, (T((4, 6, 2)), [0]), [S(1)], 2, S(0), {}, False),
    ("sum keepdim, shard stays", aten.sum.dim_IntList, (T((4, 6, 2)), [0], True), [S(1)], 2, S(1), {}, False),
    # var.dim / std.dim (self, dims, unbiased, keepdim): a reduction elsewhere keeps the shard (xLSTM's norm per
    # head), over the sharded dim needs it whole
    ("var.dim elsewhere keeps the shard", aten.var.dim, (T((2, 4, 6)), [1], True, True), [S(2)], 2, S(2), {}, False),
    ("var.dim elsewhere, dim dropped", aten.var.dim, (T((2, 4, 6)), [1], True, False), [S(2)], 2, S(1), {}, False),
    ("std.dim over the shard", aten.std.dim, (T((2, 4, 6)), [2], True, True), [S(2)], 2, R, {(0,): R}, True),
    # log_sigmoid: pointwise, though torch does not tag it so (a composite op): the shard kept, a partial sum whole
    ("log_sigmoid keeps the shard", aten.log_sigmoid.default, (T((2, 4, 6)),), [S(2)], 2, S(2), {}, False),
    ("log_sigmoid of P", aten.log_sigmoid.default, (T((2, 4, 6)),), [P], 2, R, {(0,): R}, False),
    ("sum of P", aten.sum.default, (T((4, 6)),), [P], 2, P, {}, False),
    ("mean over the shard: its share, partial", aten.mean.dim, (T((4, 6)), [1]), [S(1)], 2, P, {}, False),
    ("mean over a chunked shard gathers", aten.mean.dim, (T((4, 6)), [1]), [S(1, 2)], 2, R, {(0,): R}, True),
    ("amax of P reduces", aten.amax.default, (T((4, 6)), [1]), [P], 2, R, {(0,): R}, False),
    ("softmax along the shard", aten._softmax.default, (T((2, 4)), -1, False), [S(1)], 2, R, {(0,): R}, True),
    ("softmax elsewhere", aten._softmax.default, (T((2, 4)), 1, False), [S(0)], 2, S(0), {}, False),
    ("layer_norm over the shard", aten.layer_norm.default, (X, [8], T((8,)), T((8,))), [S(2), R, R], 2, R,
     {(0,): R}, True),
    ("layer_norm, batch shard", aten.layer_norm.default, (X, [8], T((8,)), T((8,))), [S(0), R, R], 2, S(0), {},
     False),
    ("layer_norm of P reduces", aten.layer_norm.default, (X, [8]), [P], 2, R, {(0,): R}, False),
    # attention: q, k, v on the heads (or batch) dim together
    ("sdpa heads", aten.scaled_dot_product_attention.default, (T((2, 4, 3, 8)),) * 3, [S(1)] * 3, 2, S(1), {},
     False),
    ("sdpa slices whole k, v", aten.scaled_dot_product_attention.default, (T((2, 4, 3, 8)),) * 3, [S(1), R, R], 2,
     S(1), {(1,): S(1), (2,): S(1)}, False),
    ("sdpa on the head dim gathers", aten.scaled_dot_product_attention.default, (T((2, 4, 3, 8)),) * 3,
     [S(3), S(3), S(3)], 2, R, {(0,): R, (1,): R, (2,): R}, True),
    # embedding: vocab-parallel (rows), hidden-parallel (columns), or following sharded indices
    ("embedding vocab rows", aten.embedding.default, (T((10, 4)), T((2, 3), LONG)), [S(0), R], 2, P, {}, False),
    ("embedding vocab gathers idx", aten.embedding.default, (T((10, 4)), T((2, 3), LONG)), [S(0), S(0)], 2, P,
     {(1,): R}, False),
    ("embedding hidden columns", aten.embedding.default, (T((10, 4)), T((2, 3), LONG)), [S(1), R], 2, S(2), {},
     False),
    ("embedding follows idx", aten.embedding.default, (T((10, 4)), T((2, 3), LONG)), [R, S(0)], 2, S(0), {},
     False),
    # cross-entropy: loss-parallel on vocabulary-sharded logits, gathered otherwise
    ("cross_entropy loss-parallel", aten.cross_entropy_loss.default, (T((6, 10)), T((6,), LONG)), [S(1), R], 2, R,
     {}, False),
    ("cross_entropy on token shards", aten.cross_entropy_loss.default, (T((6, 10)), T((6,), LONG)), [S(0), R], 2,
     R, {(0,): R}, True),
    ("cross_entropy, smoothing", aten.cross_entropy_loss.default, (T((6, 10)), T((6,), LONG), None, 1, -100, 0.1),
     [S(1), R], 2, R, {(0,): R}, True),
    # tril/triu per matrix of the last two dims (the delta rule's masks, per head)
    ("tril keeps a head shard", aten.tril.default, (T((2, 4, 3, 3)),), [S(1)], 2, S(1), {}, False),
    ("tril of P stays P", aten.tril.default, (T((3, 3)),), [P], 2, P, {}, False),
    ("tril of a matrix dim gathers", aten.tril.default, (T((4, 6)),), [S(1)], 2, R, {(0,): R}, True),
    # dst.copy_(src) into a view of a preallocated tensor: dst is never moved (the write must land in its storage)
    ("copy_ slices src to dst's shard", aten.copy_.default, (T((2, 4, 8)), T((2, 4, 8))), [S(1), R], 2, S(1),
     {(1,): S(1)}, False),
    ("copy_ gathers src into a whole dst", aten.copy_.default, (T((2, 4, 8)), T((2, 4, 8))), [R, S(1)], 2, R,
     {(1,): R}, False),
    ("copy_ of a broadcast src", aten.copy_.default, (T((2, 4, 8)), T((8,))), [S(1), R], 2, S(1), {}, False),
    ("copy_ into P: no rule", aten.copy_.default, (T((2, 4)), T((2, 4))), [P, R], 2, R, {(0,): R, (1,): R}, True),
    # factories and ops without a rule
    ("arange", aten.arange.default, (5,), [], 2, R, {}, False),
    ("no rule: flip gathers", aten.flip.default, (T((4, 6)), [0]), [S(0)], 2, R, {(0,): R}, True),
    ("no rule, all whole: no note", aten.flip.default, (T((4, 6)), [0]), [R], 2, R, {}, False),
]

VIEWS = [
    ("view merges into the shard", aten.view.default, (X, [6, 8]), [S(0)], 2, S(0), {}, False),
    ("view splits heads", aten.view.default, (X, [2, 3, 2, 4]), [S(2)], 2, S(2), {}, False),
    ("view flattens a column shard", aten.view.default, (T((4, 6)), [24]), [S(1)], 2, S(0, 4), {}, False),
    ("view of R", aten.view.default, (X, [6, 8]), [R], 2, R, {}, False),
    ("view regroups a column shard", aten.view.default, (T((4, 6)), [8, 3]), [S(1)], 2, S(0, 4), {}, False),
    ("view straddles: gathers", aten.view.default, (T((4, 6)), [4, 3, 2]), [S(1)], 2, R, {(0,): R}, True),
    ("expand keeps the shard", aten.expand.default, (T((3, 8)), [2, 3, 8]), [S(1)], 2, S(2), {}, False),
    # repeat: the local tensor repeated alike; copies along the sharded dim become its blocks (JetMoE's k and v
    # repeated once per routed head), leading dims repeat adds move the shard
    ("repeat elsewhere keeps the shard", aten.repeat.default, (T((2, 4, 3)), [1, 1, 2]), [S(1)], 2, S(1), {}, False),
    ("repeat along the shard: copies as blocks", aten.repeat.default, (T((2, 4, 3)), [1, 2, 1]), [S(1)], 2, S(1, 2),
     {}, False),
    ("repeat of blocks along the shard", aten.repeat.default, (T((2, 6, 3)), [1, 2, 1]), [S(1, (4, W(2)))], 2,
     S(1, (4, W(2), 4, W(2))), {}, False),
    ("repeat adding a dim", aten.repeat.default, (T((4, 3)), [2, 1, 1]), [S(0)], 2, S(1), {}, False),
    ("repeat of P", aten.repeat.default, (T((4, 3)), [2, 1]), [P], 2, P, {}, False),
    # index_add: rows summed into positions along dim 0 (routed tokens back into place): a shard of the features
    # follows (a replicated x sliced), the index whole; on the indexed dim, or of a partial sum, gathered
    ("index_add keeps a feature shard", aten.index_add.default,
     (T((4, 6)), 0, T((5,), torch.int64), T((5, 6))), [R, R, S(1)], 2, S(1), {(0,): S(1), (3,): S(1)}, False),
    ("index_add along the shard gathers", aten.index_add.default,
     (T((4, 6)), 0, T((5,), torch.int64), T((5, 6))), [S(0), R, S(0)], 2, R, {(0,): R, (2,): R, (3,): R}, True),
    ("index_add of P gathers", aten.index_add.default,
     (T((4, 6)), 0, T((5,), torch.int64), T((5, 6))), [R, R, P], 2, R, {(0,): R, (2,): R, (3,): R}, True),
    ("transpose moves it", aten.transpose.int, (X, 1, 2), [S(1)], 2, S(2), {}, False),
    ("t moves it", aten.t.default, (T((4, 6)),), [S(0)], 2, S(1), {}, False),
    ("permute moves it", aten.permute.default, (X, [2, 0, 1]), [S(0)], 2, S(1), {}, False),
    # x @ weight.T (Falcon's linears): the transpose of a column- or row-parallel weight
    ("numpy_T of a column weight", aten.numpy_T.default, (T((6, 8)),), [S(0)], 2, S(1), {}, False),
    ("numpy_T of a chunked weight", aten.numpy_T.default, (T((6, 8)),), [S(0, 3)], 2, S(1, 3), {}, False),
    ("numpy_T reverses every dim", aten.numpy_T.default, (X,), [S(0)], 2, S(2), {}, False),
    ("mT swaps the last two", aten.mT.default, (X,), [S(1)], 2, S(2), {}, False),
    ("mT leaves a batch shard", aten.mT.default, (X,), [S(0)], 2, S(0), {}, False),
    ("flatten heads into the shard", aten.flatten.using_ints, (T((2, 3, 4, 2, 8)), 2, 3), [S(2)], 2, S(2), {},
     False),
    ("flatten keeps a shard before it", aten.flatten.using_ints, (T((2, 4, 3, 8)), 2, 3), [S(1)], 2, S(1), {},
     False),
    ("flatten an inner shard into blocks", aten.flatten.using_ints, (T((2, 3, 2, 8)), 2, 3), [S(3)], 2, S(2, 2), {},
     False),
    # x.view_as(y), reshape_as, expand_as (XLM, RoFormer): decided as the view to y's shape, made one to the local shape
    ("view_as merges into the shard", aten.view_as.default, (X, T((6, 8))), [S(0), R], 2, S(0), {}, False),
    ("reshape_as keeps a column shard", aten.reshape_as.default, (T((6, 8)), X), [S(1), R], 2, S(2), {}, False),
    ("view_as straddles: gathers", aten.view_as.default, (T((4, 6)), T((4, 3, 2))), [S(1), R], 2, R, {(0,): R},
     True),
    ("expand_as keeps the shard", aten.expand_as.default, (T((3, 8)), T((2, 3, 8))), [S(1), R], 2, S(2), {}, False),
    ("masked_fill_ in place keeps it", aten.masked_fill_.Scalar, (T((2, 4, 3, 3)), T((3, 3), torch.bool), 0.0),
     [S(1), R], 2, S(1), {}, False),
    ("broadcast_to keeps the shard", aten.broadcast_to.default, (T((2, 3, 4, 1, 8)), [2, 3, 4, 2, 8]), [S(2)], 2,
     S(2), {}, False),
    # Falcon-40B's qkv[:, :, :, [-2]]: an index beside the shard (kv groups) keeps it
    ("index after the shard", aten.index.Tensor, (T((2, 3, 4, 4, 8)), [None, None, None, T((1,), LONG)]),
     [S(2), R], 2, S(2), {}, False),
    ("index before the shard shifts it", aten.index.Tensor, (T((4, 6)), [T((2, 3), LONG)]), [S(1), R], 2, S(2), {},
     False),
    ("index on the shard gathers", aten.index.Tensor, (T((4, 6)), [None, T((2,), LONG)]), [S(1), R], 2, R,
     {(0,): R}, True),
    ("index of R", aten.index.Tensor, (T((4, 6)), [None, T((2,), LONG)]), [R, R], 2, R, {}, False),
    ("unsqueeze before it", aten.unsqueeze.default, (T((2, 3)), 0), [S(1)], 2, S(2), {}, False),
    ("squeeze before it", aten.squeeze.dim, (T((2, 1, 4)), 1), [S(2)], 2, S(1), {}, False),
    ("slice of the sharded dim gathers", aten.slice.Tensor, (T((4, 6)), 1, 0, 3), [S(1)], 2, R, {(0,): R}, True),
    ("whole slice keeps it", aten.slice.Tensor, (T((4, 6)), 1, 0, 6), [S(1)], 2, S(1), {}, False),
    ("slice elsewhere keeps it", aten.slice.Tensor, (T((4, 6)), 0, 0, 2), [S(1)], 2, S(1), {}, False),
    ("select elsewhere shifts it", aten.select.int, (T((4, 6)), 0, 1), [S(1)], 2, S(0), {}, False),
    ("select on it gathers", aten.select.int, (T((4, 6)), 1, 1), [S(1)], 2, R, {(0,): R}, True),
    ("split a fused qkv", aten.split.Tensor, (T((2, 12)), 4, 1), [S(1, 3)], 2, (S(1), S(1), S(1)), {}, False),
    ("split across blocks gathers", aten.split.Tensor, (T((2, 12)), 4, 1), [S(1)], 2, (R, R, R), {(0,): R}, True),
    ("split elsewhere", aten.split.Tensor, (T((4, 6)), 2, 0), [S(1)], 2, (S(1), S(1)), {}, False),
    # fused projections laid out block after block, unequal blocks too (Phi-3's q|k|v = 32+16+16 under GQA)
    ("slice the q block", aten.slice.Tensor, (T((2, 64)), 1, 0, 32), [S(1, (32, 16, 16))], 2, S(1), {}, False),
    ("slice the k block", aten.slice.Tensor, (T((2, 64)), 1, 32, 48), [S(1, (32, 16, 16))], 2, S(1), {}, False),
    ("slice k|v to the end", aten.slice.Tensor, (T((2, 64)), 1, 32, 2**63 - 1), [S(1, (32, 16, 16))], 2, S(1, 2),
     {}, False),
    ("slice q|k, unequal", aten.slice.Tensor, (T((2, 64)), 1, 0, -16), [S(1, (32, 16, 16))], 2, S(1, (32, 16)),
     {}, False),
    ("slice cutting a block gathers", aten.slice.Tensor, (T((2, 64)), 1, 0, 40), [S(1, (32, 16, 16))], 2, R,
     {(0,): R}, True),
    ("split unequal q|k|v", aten.split_with_sizes.default, (T((2, 64)), [32, 16, 16], 1), [S(1, (32, 16, 16))], 2,
     (S(1), S(1), S(1)), {}, False),
    ("split q | k+v", aten.split_with_sizes.default, (T((2, 64)), [32, 32], 1), [S(1, (32, 16, 16))], 2,
     (S(1), S(1, 2)), {}, False),
    ("split across unequal blocks gathers", aten.split_with_sizes.default, (T((2, 64)), [16, 48], 1),
     [S(1, (32, 16, 16))], 2, (R, R), {(0,): R}, True),
    ("chunk gate|up", aten.chunk.default, (T((2, 8)), 2, 1), [S(1, 2)], 2, (S(1), S(1)), {}, False),
    ("chunk of a plain shard gathers", aten.chunk.default, (T((2, 8)), 2, 1), [S(1)], 2, (R, R), {(0,): R}, True),
    ("chunk elsewhere keeps it", aten.chunk.default, (T((4, 8)), 2, 0), [S(1)], 2, (S(1), S(1)), {}, False),
    ("cat of unequal blocks", aten.cat.default, ([T((2, 32)), T((2, 16))], 1), [S(1), S(1)], 2, S(1, (32, 16)), {},
     False),
    ("view keeps unequal blocks", aten.view.default, (T((2, 3, 64)), [6, 64]), [S(2, (32, 16, 16))], 2,
     S(1, (32, 16, 16)), {}, False),
    ("view splitting unequal blocks gathers", aten.view.default, (T((2, 64)), [2, 4, 16]), [S(1, (32, 16, 16))], 2,
     R, {(0,): R}, True),
    # multi-query k and v held whole beside q's shard inside one fused projection (Falcon-7B; Whole blocks)
    ("slice q beside whole k, v", aten.slice.Tensor, (T((2, 64)), 1, 0, 32), [S(1, (32, W(16), W(16)))], 2, S(1),
     {}, False),
    ("slice a whole block is R", aten.slice.Tensor, (T((2, 64)), 1, 32, 48), [S(1, (32, W(16), W(16)))], 2, R, {},
     False),
    ("slice q and a whole k", aten.slice.Tensor, (T((2, 64)), 1, 0, 48), [S(1, (32, W(16), W(16)))], 2,
     S(1, (32, W(16))), {}, False),
    ("split with whole blocks", aten.split_with_sizes.default, (T((2, 64)), [32, 16, 16], 1),
     [S(1, (32, W(16), W(16)))], 2, (S(1), R, R), {}, False),
    ("view splits blocks into heads", aten.view.default, (T((2, 64)), [2, 4, 16]), [S(1, (32, W(16), W(16)))], 2,
     S(1, (2, W(1), W(1))), {}, False),
    ("view to heads, a block indivisible", aten.view.default, (T((2, 64)), [2, 4, 16]), [S(1, (32, 16, 16))], 4,
     R, {(0,): R}, True),
    ("broadcast beside whole blocks gathers", aten.mul.Tensor, (T((2, 64)), T((2, 1))), [S(1, (32, W(16), W(16))), R],
     2, R, {(0,): R, (1,): R}, True),
    ("pointwise keeps whole blocks", aten.mul.Tensor, (T((2, 64)), T((2, 64))), [S(1, (32, W(16), W(16))), R], 2,
     S(1, (32, W(16), W(16))), {(1,): S(1, (32, W(16), W(16)))}, False),
    # GPT-J's interleaved rotary: stack((-x2, x1), dim=-1) of head-sharded halves
    ("stack after the shard", aten.stack.default, ([T((2, 4, 3, 8)), T((2, 4, 3, 8))], -1), [S(1), S(1)], 2,
     S(1), {}, False),
    ("stack before the shard moves it", aten.stack.default, ([T((4, 6)), T((4, 6))], 0), [S(1), S(1)], 2, S(2), {},
     False),
    ("stack slices a whole one", aten.stack.default, ([T((4, 6)), T((4, 6))], 0), [S(1), R], 2, S(2),
     {(0, 1): S(1)}, False),
    ("stack of P", aten.stack.default, ([T((4, 6)), T((4, 6))], 0), [P, P], 2, P, {}, False),
    ("stack of P and S gathers", aten.stack.default, ([T((4, 6)), T((4, 6))], 0), [P, S(1)], 2, R,
     {(0, 0): R, (0, 1): R}, True),
    ("unbind elsewhere", aten.unbind.int, (T((3, 4)), 0), [S(1)], 2, (S(0),) * 3, {}, False),
    ("unbind of it gathers", aten.unbind.int, (T((3, 4)), 1), [S(1)], 2, (R,) * 4, {(0,): R}, True),
    ("cat of shards on it", aten.cat.default, ([T((4, 6)), T((4, 6))], 1), [S(1), S(1)], 2, S(1, 2), {}, False),
    ("cat elsewhere slices R", aten.cat.default, ([T((4, 6)), T((4, 6))], 0), [S(1), R], 2, S(1),
     {(0, 0): S(1), (0, 1): S(1)}, False),
    ("cat of P", aten.cat.default, ([T((4, 6)), T((4, 6))], 0), [P, P], 2, P, {}, False),
    ("cat of P and R gathers", aten.cat.default, ([T((4, 6)), T((4, 6))], 0), [P, R], 2, R,
     {(0, 0): R, (0, 1): R}, True),
    # torch.cat skips a 1-D empty tensor (transformers' DynamicCache starts from torch.tensor([])): no constraint
    ("cat onto an empty 1-D tensor", aten.cat.default, ([T((0,)), T((2, 4, 3, 8))], -2), [R, S(1)], 2, S(1),
     {(0, 1): S(1)}, False),
    ("cat of an empty 1-D and P", aten.cat.default, ([T((0,)), T((2, 4, 3, 8))], -2), [R, P], 2, P, {}, False),
]


@pytest.mark.parametrize("name,op,args,placements,n,out,inputs,note", COMPUTE + VIEWS,
                         ids=[row[0] for row in COMPUTE + VIEWS])
def test_rule_table(name, op, args, placements, n, out, inputs, note):
    _, dec = decide(op, args, placements, n)
    assert dec.out == out
    assert dec.inputs == inputs
    assert (dec.note is not None) == note, dec.note


def test_the_as_forms_are_rewritten_to_local_sizes():
    """view_as(x, y) with x sharded on dim 0 of (2, 3, 8) viewed as y's (6, 8): a view to (3, 8) here, y no longer read
    (a y held in another placement would give the wrong size)."""
    node, inputs = build(aten.view_as.default, (X, T((6, 8))))
    dec = infer(node, RuleCtx(2, {inputs[0]: S(0), inputs[1]: R}))
    dec.rewrite(node)
    assert node.target is aten.view.default and node.args == (inputs[0], [3, 8])


def _routed(target, args, placements, rows_dim_of=(0,)):
    """`target` built on the T inputs, then each named input's dim 0 and the output's made a size known only at run
    time, as torch.export records rows picked by nonzero (an unbacked symbol)."""
    import sympy

    u0 = sympy.Symbol("u0", integer=True, nonnegative=True)
    node, inputs = build(target, args)
    for i in rows_dim_of:
        inputs[i].meta["meshc.shape"] = (u0, *inputs[i].meta["meshc.shape"][1:])
    node.meta["meshc.shape"] = (u0, *node.meta["meshc.shape"][1:])
    return node, infer(node, RuleCtx(2, dict(zip(inputs, placements))))


def test_rows_known_only_at_run_time_keep_the_shard_of_the_other_dims():
    """An expert's rows (their count known at run time only) through its column-parallel w1, the activation and the
    row-parallel w2: each rule reads the hidden dims only, so the shards follow as on a dense MLP."""
    _, column = _routed(aten.linear.default, (T((5, 8)), T((16, 8))), [R, S(0)])
    assert column.out == S(1) and column.inputs == {}
    _, act = _routed(aten.silu.default, (T((5, 16)),), [S(1)])
    assert act.out == S(1) and act.inputs == {}
    _, row = _routed(aten.linear.default, (T((5, 16)), T((8, 16))), [S(1), S(1)])
    assert row.out == P and row.inputs.get((0,), S(1)) == S(1) and row.inputs.get((1,), S(1)) == S(1)


def test_the_rows_of_experts_joined_keep_the_shard_of_their_features():
    """JetMoE's loop: one linear per expert on its rows (counts read at run time), their outputs joined by a cat on the
    rows: the feature shard follows (it once gathered, the cat's rule reading every size to skip empty inputs)."""
    _, dec = _routed(aten.cat.default, ([T((5, 8)), T((5, 8))],), [S(1), S(1)], rows_dim_of=(0, 1))
    assert dec.out == S(1) and dec.inputs == {(0, 0): S(1), (0, 1): S(1)} and dec.note is None


def test_a_rule_that_needs_a_size_known_only_at_run_time_gathers_and_says_so():
    """A view merging the rows (a size known only at run time) with the sharded dim cannot be decided from the sizes:
    the inputs are gathered, and the note says why."""
    _, dec = _routed(aten.view.default, (T((4, 6)), [24]), [S(1)])
    assert dec.out == R and dec.inputs == {(0,): R}
    assert dec.note == "sizes known only at run time in aten::view: inputs replicated", dec.note


def test_no_rule_note_names_the_op():
    _, dec = decide(aten.flip.default, (T((4, 6)), [0]), [S(0)])
    assert dec.note == "no tensor-parallel rule or DTensor strategy for aten::flip: inputs replicated"


def test_indivisible_heads_are_named():
    """Two heads of 2 over tp=4: the shard cannot follow the view, and the rule says which size is to blame."""
    _, dec = decide(aten.view.default, (T((2, 3, 4)), [2, 3, 2, 2]), [S(2)], n=4)
    assert dec.out == R and dec.inputs == {(0,): R}
    assert dec.indivisible is not None and dec.indivisible[1] == 2


def test_getitem_picks_its_output():
    graph = fx.Graph()
    parts = graph.placeholder("parts")
    item = graph.call_function(operator.getitem, (parts, 1))
    dec = infer(item, RuleCtx(2, {parts: (R, S(1, 2))}))
    assert dec.out == S(1, 2) and dec.inputs == {}


def test_sequence_parallel_norm_runs_on_sequence_shards():
    """Under SP a replicated residual stream is sliced on the sequence before a norm; a partial sum is
    reduce-scattered there instead of all-reduced."""
    sp = {"sp_dim": lambda node: S(1)}
    _, dec = decide(aten.layer_norm.default, (X, [8]), [R], **sp)
    assert dec.out == S(1) and dec.inputs == {(0,): S(1)}
    _, dec = decide(aten.add.Tensor, (X, X), [P, R], **sp)
    assert dec.out == S(1) and dec.inputs == {(0,): S(1), (1,): S(1)}


# ---------------------------------------------------------------------------------------- rewrites
def test_view_rewrite_makes_sizes_local():
    node, dec = decide(aten.view.default, (X, [2, 3, 2, 4]), [S(2)])
    dec.rewrite(node)
    assert node.args[1] == [2, 3, 1, 4]


def test_split_rewrite_makes_sizes_local():
    node, dec = decide(aten.split.Tensor, (T((2, 12)), 4, 1), [S(1, 3)])
    dec.rewrite(node)
    assert node.args[1] == 2


def test_slice_rewrite_keeps_the_local_block():
    """k = qkv[:, 32:48] of blocks 32+16+16 on tp=2: locally q|k|v are 16+8+8, so k is [16:24]."""
    node, dec = decide(aten.slice.Tensor, (T((2, 64)), 1, 32, 48), [S(1, (32, 16, 16))])
    dec.rewrite(node)
    assert node.args[2:4] == (16, 24)


def test_slice_and_split_rewrites_count_whole_blocks_whole():
    """q|k|v of 32+R16+R16 on tp=2 are 16+16+16 locally: k = qkv[:, 32:48] is [16:32]; the split's parts are 16 each."""
    node, dec = decide(aten.slice.Tensor, (T((2, 64)), 1, 32, 48), [S(1, (32, W(16), W(16)))])
    dec.rewrite(node)
    assert node.args[2:4] == (16, 32)
    node, dec = decide(aten.split_with_sizes.default, (T((2, 64)), [32, 16, 16], 1), [S(1, (32, W(16), W(16)))])
    dec.rewrite(node)
    assert node.target == aten.split_with_sizes.default and node.args[1:] == ([16, 16, 16], 1)


def test_column_parallel_matmul_by_whole_blocks_splits_in_runs():
    """linear(x, w) with w S(0)x(32+R16+R16): one linear of q's rows (sharded) and one of k|v's (replicated),
    joined; x reaches only q's through f later (the tensor_parallel pass), not the join."""
    from meshc.passes.tp_whole import split_whole_matmul
    from meshc.runtime.ops.tp_ops import join_blocks

    node, dec = decide(aten.linear.default, (T((2, 3, 8)), T((64, 8))), [R, S(0, (32, W(16), W(16)))])
    assert dec.out == S(2, (32, W(16), W(16))) and dec.rewrite is not None
    graph = node.graph
    placements = dict(zip([a for a in graph.nodes if a.op == "placeholder"], [R, S(0, (32, W(16), W(16)))]))
    placements[node] = dec.out
    split_whole_matmul(node, placements, 2, (1,), 0, None)
    (joined,) = [n for n in graph.nodes if n.target is join_blocks]
    q, kv = joined.args[0]
    assert [a.args[1:] for a in (q.args[1], kv.args[1])] == [(0, 0, 16), (0, 16, 48)]
    assert placements[q] == S(2) and placements[kv] == R and placements[joined] == S(2, (32, W(16), W(16)))


def test_mean_over_the_shard_rewrite_divides_by_the_axis():
    """A norm's statistic over tp-sharded features (OLMoE's q/k RMSNorm over the whole projection): each rank's
    mean of its slice, over tp, summed by the all-reduce its first non-linear consumer asks for, is the mean."""
    node, dec = decide(aten.mean.dim, (T((4, 6)), [1], True), [S(1)], 2)
    user = node.graph.call_function(aten.rsqrt.default, (node,))
    dec.rewrite(node)
    (scaled,) = node.users
    assert scaled.target == aten.div.Tensor and scaled.args == (node, 2) and user.args == (scaled,)
    x = torch.randn(4, 6)
    assert torch.allclose(sum(x[:, 3 * r: 3 * r + 3].mean(1) / 2 for r in range(2)), x.mean(1))


def test_vocab_parallel_embedding_rewrite():
    node, dec = decide(aten.embedding.default, (T((10, 4)), T((2, 3), LONG)), [S(0), R], index=1, group="7")
    dec.rewrite(node)
    assert node.target is vocab_parallel_embedding
    assert node.kwargs == {"start": 5, "end": 10, "padding_idx": -1}
    assert "rows [5, 10)" in node.meta["meshc.why"]


def test_loss_parallel_rewrite_records_its_reductions():
    node, dec = decide(aten.cross_entropy_loss.default, (T((6, 10)), T((6,), LONG)), [S(1), R], index=1,
                       group="7")
    dec.rewrite(node)
    assert node.target is vocab_parallel_cross_entropy
    assert node.kwargs == {"start": 5, "end": 10, "ignore_index": -100, "reduction": 1, "group": "7"}
    [record] = node.meta["meshc.comm"]
    assert (record.kind, record.axis, record.bytes, record.count) == ("all_reduce", "tp", 6 * 4, 3)


def test_rules_without_a_rewrite_leave_the_node():
    node, dec = decide(aten.embedding.default, (T((10, 4)), T((2, 3), LONG)), [S(1), R])
    assert dec.rewrite is None and node.target is aten.embedding.default


# ---------------------------------------------------------------------------------------- the table
def test_table_covers_every_rule_once():
    rules = COMPUTE_RULES + VIEW_RULES + VOCAB_RULES
    assert len(set(rules)) == len(rules)
    assert len(RULES) == sum(len(r.targets) for r in rules)
    assert RULES[aten.view.default] is view_rule


def test_fallbacks():
    assert rule_for(aten.gelu.default) is pointwise_rule  # tagged pointwise, not in the table
    assert rule_for(aten.flip.default) is strategy_rule  # no rule of its own: DTensor's registry, else no_rule
    assert rule_for(operator.getitem) is RULES[operator.getitem]


def test_an_op_claimed_twice_is_refused():
    with pytest.raises(MeshcInternalError, match="handled by both"):
        build_table((view_rule, view_rule))


def test_the_table_is_read_only():
    with pytest.raises(TypeError):
        RULES[aten.flip.default] = no_rule
