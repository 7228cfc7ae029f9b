"""Vocabulary-parallel placement rules on one mesh axis (Plan.vocab_parallel): the token embedding's rows and the
LM head's logits split over the vocabulary, the lookup masked to this rank's rows (a partial sum) and the loss
computed from three all-reduces of (tokens,) values (Megatron's loss-parallel cross-entropy). VOCAB_RULES lists
this file's rules for tp_table.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from meshc.compiler.ir.logits import plain_cross_entropy
from meshc.compiler.ir.placement import P, Placement, R, Replicate, Shard
from meshc.compiler.ir.program import CommRecord
from meshc.runtime.ops.tp_ops import vocab_parallel_cross_entropy, vocab_parallel_embedding

from meshc.passes.tp_rules import Decision, RuleCtx, _ndim, handles

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------- embedding
@handles(aten.embedding.default)
def embedding_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """weight R: follows the indices; S(1): hidden-sharded output; S(0): vocab-parallel (partial sum)."""
    w, idx = node.args[0], node.args[1]
    pw, pi = ctx.pl(w), ctx.pl(idx)
    req: dict[tuple, Placement] = {}
    if isinstance(pw, Shard) and pw.dim == 0:
        if not isinstance(pi, Replicate):
            req[(1,)] = R
        return Decision(req, P, rewrite=lambda nd: _vocab_parallel_lookup(nd, ctx))
    if isinstance(pw, Shard) and pw.dim == 1:
        if not isinstance(pi, Replicate):
            req[(1,)] = R
        return Decision(req, Shard(_ndim(node) - 1, pw.chunks))
    if isinstance(pi, Shard):
        return Decision(req, pi)
    return Decision(req, R)


def _vocab_parallel_lookup(node: fx.Node, ctx: RuleCtx) -> None:
    """embedding(W, idx) with W's rows split: a masked lookup of this rank's rows (zeros elsewhere)."""
    weight = node.args[0]
    rows = int(weight.meta["meshc.shape"][0]) // ctx.n  # (V/tp, D) held here
    start, end = ctx.index * rows, (ctx.index + 1) * rows
    padding = node.args[2] if len(node.args) > 2 else -1
    node.target = vocab_parallel_embedding
    node.args = (weight, node.args[1])
    node.kwargs = {"start": start, "end": end, "padding_idx": padding}
    fqn = weight.meta.get("meshc.fqn", weight.name)
    node.meta["meshc.why"] = f"vocab-parallel embedding: this rank holds rows [{start}, {end}) of {fqn}"


# ---------------------------------------------------------------------------------------- losses
@handles(aten.cross_entropy_loss.default)
def cross_entropy_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """Logits sharded on the vocabulary (last dim, one block): loss-parallel, the loss rewritten to reduce
    its max, sum of exponentials and target logit over the axis."""
    logits, target = node.args[0], node.args[1]
    p = ctx.pl(logits)
    plain = plain_cross_entropy(node)
    req = {} if isinstance(ctx.pl(target), Replicate) else {(1,): R}
    if isinstance(p, Shard) and p.dim == 1 and p.chunks == 1 and plain:
        return Decision(req, R, rewrite=lambda nd: _loss_parallel(nd, ctx))
    if isinstance(p, Replicate):
        return Decision(req, R)
    req[(0,)] = R
    return Decision(req, R, note="cross-entropy on logits not split on the vocabulary alone")


def _loss_parallel(node: fx.Node, ctx: RuleCtx) -> None:
    """cross_entropy(logits (N, V/tp), target) -> vocab_parallel_cross_entropy over this rank's vocabulary."""
    logits, target = node.args[0], node.args[1]
    rows = int(logits.meta["meshc.shape"][-1]) // ctx.n
    start, end = ctx.index * rows, (ctx.index + 1) * rows
    reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
    ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
    node.target = vocab_parallel_cross_entropy
    node.args = (logits, target)
    node.kwargs = {"start": start, "end": end, "ignore_index": ignore, "reduction": reduction, "group": ctx.group}
    why = f"loss-parallel cross-entropy: this rank holds vocabulary [{start}, {end})"
    node.meta["meshc.why"] = why
    tokens = math.prod(int(s) for s in logits.meta["meshc.shape"][:-1])
    itemsize = 4  # the three reductions run in fp32
    node.meta["meshc.comm"] = [CommRecord("all_reduce", ctx.axis, tokens * itemsize, "forward", why, count=3)]


VOCAB_RULES = (embedding_rule, cross_entropy_rule)
