"""gqa: grouped-query attention whose keys and values were copied to every query head runs as SDPA's enable_gqa.

Purpose: transformers' `repeat_kv` (and code written like it) copies each key/value head to the n query heads that
share it before calling scaled_dot_product_attention: an unsqueeze, an expand and a reshape that materializes K and
V n times larger, which autograd then saves for backward (TinyLlama's shape: 8x its 4 kv heads, ~0.34 GiB per
sample). SDPA computes the same thing from the kv heads themselves with `enable_gqa=True` (query head j reads kv head
j // n, the order repeat_kv's copies have). Run after tensor_parallel and context: it reads the local shapes, so a
rank whose kv heads are sharded with its query heads folds its own part; a copy followed by a tp slice (kv heads
fewer than tp) or attention rewritten for cp is not this pattern and stays as it is.

Requires: local shapes ("val") on the nodes (tensor_parallel has run).
Ensures: every SDPA whose k and v are each `reshape(expand(unsqueeze(x, 2), (B, H, n, T, D)), (B, H*n, T, D))` of a
    (B, H, T, D) x used by nothing else, with n > 1 and the same H and n for both and the query's heads H*n, reads
    the two x directly with enable_gqa=True; the copies' nodes are erased. The attention's output is the same
    (same values up to the order of the gradient's sums over a group's heads).

Before:  %unsqueeze = aten.unsqueeze(%k, 2)                          (B, 2, 1, T, D)
         %expand = aten.expand(%unsqueeze, [B, 2, 2, T, D])
         %reshape = aten.reshape(%expand, [B, 4, T, D])              (and the same for v)
         %sdpa = aten.scaled_dot_product_attention(%q, %reshape, %reshape_1, None, 0.0, True, scale=0.35)
After:   %sdpa = aten.scaled_dot_product_attention(%q, %k, %v, None, 0.0, True, scale=0.35, enable_gqa=True)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from meshc.compiler.ir.program import Program

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
RESHAPES = (aten.reshape.default, aten.view.default)


def gqa_pass(program: Program) -> Program:
    program = program.copy()
    graph = program.gm.graph
    folded = 0
    for node in list(graph.nodes):
        if node.target is not SDPA or node.kwargs.get("enable_gqa") or len(node.args) < 3:
            continue
        q = node.args[0]
        k, v = _copied_heads(node.args[1]), _copied_heads(node.args[2])
        if k is None or v is None or k[1] != v[1] or _shape(k[0])[1] != _shape(v[0])[1]:
            continue
        heads = _shape(k[0])[1]
        if not isinstance(q, fx.Node) or _shape(q) is None or _shape(q)[1] != heads * k[1]:
            continue
        copies = (node.args[1], node.args[2])
        node.args = (q, k[0], v[0], *node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        node.meta["meshc.why"] = (f"grouped-query attention: {heads} kv head(s) for {heads * k[1]} query heads read "
                                  "in place (enable_gqa) instead of copied per query head")
        for copy in copies:
            _erase_chain(graph, copy)
        folded += 1
    if folded:
        graph.lint()
        program.gm.recompile()
    program.notes.append(f"{folded} attention(s) read grouped kv heads in place (enable_gqa)" if folded else
                         "no key/value heads copied per query head")
    return program


def _shape(node) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _copied_heads(node) -> tuple[fx.Node, int] | None:
    """(x, n) where `node` is reshape(expand(unsqueeze(x, 2), (B, H, n, T, D)), (B, H*n, T, D)), each used once."""
    if not isinstance(node, fx.Node) or node.target not in RESHAPES or len(node.users) != 1:
        return None
    expand = node.args[0]
    if not isinstance(expand, fx.Node) or expand.target is not aten.expand.default or len(expand.users) != 1:
        return None
    unsqueeze = expand.args[0]
    if not isinstance(unsqueeze, fx.Node) or unsqueeze.target is not aten.unsqueeze.default \
            or len(unsqueeze.users) != 1 or unsqueeze.args[1] not in (2, -3):
        return None
    x = unsqueeze.args[0]
    shapes = [_shape(n) for n in (x, unsqueeze, expand, node)]
    if any(s is None for s in shapes):
        return None
    base, one, wide, out = shapes
    if len(base) != 4 or one != (base[0], base[1], 1, base[2], base[3]) or len(wide) != 5:
        return None
    n = wide[2]
    if wide != (base[0], base[1], n, base[2], base[3]) or out != (base[0], base[1] * n, base[2], base[3]) or n < 2:
        return None
    return x, n


def _erase_chain(graph: fx.Graph, node: fx.Node) -> None:
    while isinstance(node, fx.Node) and node.op == "call_function" and not node.users:
        parent = node.args[0]
        graph.erase_node(node)
        node = parent if node.target in (*RESHAPES, aten.expand.default, aten.unsqueeze.default) else None
