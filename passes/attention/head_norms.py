"""head_norms: a norm per head, written as a list of norms over the pieces of a split, becomes one normalization.

Purpose: StableLM's q/k LayerNorm (qk_layernorm) splits the (B, H, T, D) queries into H pieces of one head, runs
each through its own nn.LayerNorm and concatenates the results. Under tp the heads are sharded, and a split into
pieces that each lie inside one rank's heads has no placement the rules can give (a piece held by one rank only),
so the projections stayed whole. The same arithmetic, written as one layer_norm over the last dims followed by the
stacked per-head weights (and biases) broadcast over the heads, is an elementwise op on the head-sharded value: each
rank normalizes its own heads with its heads' rows of the stack (a slice of a replicated stack, whose gradient the
tensor_parallel pass gathers), and the parameters keep their own names and shapes. Runs first, on the traced
program (every mesh sees the same graph).

Requires: "val" on the nodes (torch.export's).
Ensures: every split of x along a dim d into pieces of size 1, each read by exactly one aten.layer_norm over the
    trailing dims after d (the same normalized shape and eps for all; weights and biases parameters or None alike),
    whose outputs are concatenated on d in the split's order and used by nothing else, is replaced by
    layer_norm(x, shape, None, None, eps) * stack(weights) + stack(biases) (the stacks viewed to broadcast on d);
    the pieces' nodes are erased; the new nodes' "val" computed from their inputs' (fake tensors).

Before:  %split = aten.split(%q, 1, 1)                                  (B, 4, T, 16) -> 4 x (B, 1, T, 16)
         %ln_i = aten.layer_norm(%split[i], [16], %norms_i_weight, None, 1e-05)       (i = 0..3)
         %cat = aten.cat([%ln_0, %ln_1, %ln_2, %ln_3], 1)
After:   %ln = aten.layer_norm(%q, [16], None, None, 1e-05)
         %w = aten.view(aten.stack([%norms_0_weight, ..., %norms_3_weight]), [1, 4, 1, 16])
         %cat = aten.mul(%ln, %w)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from meshc.compiler.ir.program import Program

aten = torch.ops.aten
NORM = aten.layer_norm.default


def head_norms_pass(program: Program) -> Program:
    graph = program.gm.graph
    found = [m for m in (_match(node) for node in graph.nodes) if m is not None]
    if not found:
        return program.unchanged("no norm per head (a split whose pieces each go through a norm of their own)")
    program = program.copy()
    graph = program.gm.graph
    by_name = {n.name: n for n in graph.nodes}
    for split, norms, cat in (_match(by_name[s.name]) for s, _, _ in found):
        _rewrite(graph, split, norms, cat)
    graph.eliminate_dead_code()
    program.gm.recompile()
    program.notes.append(f"{len(found)} norm(s) per head made one normalization with stacked weights")
    return program


def _match(node: fx.Node) -> tuple[fx.Node, list[fx.Node], fx.Node] | None:
    """(split, its norms in order, the cat) when `node` is the split of a norm per head, else None."""
    if node.op != "call_function" or node.target is not aten.split.Tensor or node.args[1] != 1:
        return None
    x = node.args[0]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    d = (node.args[2] if len(node.args) > 2 else 0) % val.dim()
    items = sorted((u for u in node.users if u.target is operator.getitem), key=lambda u: u.args[1])
    if len(items) != val.shape[d] or len(items) != len(node.users) or len(items) < 2:
        return None
    norms = []
    for item in items:
        users = list(item.users)
        if len(users) != 1 or users[0].target is not NORM or users[0].args[0] is not item:
            return None
        norms.append(users[0])
    first = norms[0].args
    shape, eps = list(first[1]), first[4] if len(first) > 4 else 1e-5
    if d >= val.dim() - len(shape):  # the split dim must lie outside the normalized dims
        return None
    for norm in norms:
        a = norm.args
        if list(a[1]) != shape or (a[4] if len(a) > 4 else 1e-5) != eps or len(norm.users) != 1:
            return None
        for k in (2, 3):  # weight, bias: all parameters, or all absent
            arg, ref = (a[k] if len(a) > k else None), (first[k] if len(first) > k else None)
            if (arg is None) != (ref is None) or arg is not None and (not isinstance(arg, fx.Node) or
                                                                     arg.op != "placeholder"):
                return None
    (cat,) = norms[0].users
    if cat.target is not aten.cat.default or list(cat.args[0]) != norms or \
            (cat.args[1] if len(cat.args) > 1 else 0) % val.dim() != d:
        return None
    return node, norms, cat


def _rewrite(graph: fx.Graph, split: fx.Node, norms: list[fx.Node], cat: fx.Node) -> None:
    x, (_, shape, *_rest) = split.args[0], norms[0].args
    a = norms[0].args
    eps = a[4] if len(a) > 4 else 1e-5
    ndim, d, heads = x.meta["val"].dim(), split.args[2] % x.meta["val"].dim(), len(norms)
    view = [1] * d + [heads] + [1] * (ndim - d - 1 - len(shape)) + list(shape)
    with graph.inserting_before(cat):
        out = _call(graph, NORM, x, list(shape), None, None, eps)
        for k, op in ((2, aten.mul.Tensor), (3, aten.add.Tensor)):
            params = [n.args[k] if len(n.args) > k else None for n in norms]
            if params[0] is None:
                continue
            stacked = _call(graph, aten.view.default, _call(graph, aten.stack.default, params), view)
            out = _call(graph, op, out, stacked)
    for n in (out, *out.all_input_nodes):
        n.meta["nn_module_stack"] = dict(norms[0].meta.get("nn_module_stack", {}))
        n.meta["stack_trace"] = norms[0].meta.get("stack_trace")
    out.meta["meshc.why"] = f"{heads} norms, one per head, as one normalization with their weights stacked"
    cat.replace_all_uses_with(out)


def _call(graph: fx.Graph, target, *args) -> fx.Node:
    """A new node with its "val": the op run on its inputs' fake tensors (their own fake mode)."""
    node = graph.call_function(target, args)
    val = lambda a: [val(b) for b in a] if isinstance(a, (list, tuple)) else a.meta["val"] if isinstance(a, fx.Node) else a
    node.meta["val"] = target(*(val(a) for a in args))
    return node
