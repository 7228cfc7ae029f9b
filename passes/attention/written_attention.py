"""Written-out attention found in a graph and replaced by the one op it computes, scaled_dot_product_attention.

Hugging Face's eager attention (and most hand-written attention) exports as

    s = matmul(q, transpose(k, -2, -1))      (B, H, T, S)
    s = s * c  /  s / c  (any number)        scale
    s = s + mask                             an additive mask (optional)
    p = softmax(s, -1[, dtype]) [.to(dtype)] [dropout(p, rate, train)]
    o = matmul(p, v)                         (B, H, T, D)

which is SDPA(q, k, v, attn_mask=mask, dropout_p=rate, scale=Πc) exactly (softmax over the keys of q·kᵀ·scale +
mask, then the values). Context parallelism needs the op, not its pieces: scores over the whole sequence are
what it must never hold. Each intermediate must have no other use (dtype asserts aside), else the pattern is
left alone and the context pass' rules gather what it needs (correct, costlier).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

aten = torch.ops.aten
SCALES = {aten.mul.Tensor: lambda c: c, aten.div.Tensor: lambda c: 1.0 / c}
CASTS = (aten.to.dtype, aten._to_copy.default, aten.clone.default)
ASSERT = aten._assert_tensor_metadata.default


def as_sdpa(gm: fx.GraphModule) -> int:
    """Rewrite every written-out attention of `gm` into one aten.scaled_dot_product_attention; how many."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.target is aten.matmul.default and node.graph is gm.graph:
            found = _match(node)
            if found is not None:
                _replace(gm.graph, node, *found)
                count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _users(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if u.target is not ASSERT]


def _only_user(node: fx.Node) -> fx.Node | None:
    users = _users(node)
    return users[0] if len(users) == 1 else None


def _match(scores: fx.Node):
    """(q, k, v, mask, dropout, scale, output, chain) of the attention starting at matmul `scores`, or None."""
    q, kt = scores.args[0], scores.args[1]
    if not (isinstance(kt, fx.Node) and kt.target is aten.transpose.int and _rank(q) == 4 and _rank(kt) == 4):
        return None
    if {d % 4 for d in kt.args[1:3]} != {2, 3} or len(_users(kt)) != 1:
        return None
    chain, cur, scale, mask = [scores], scores, 1.0, None
    while (nxt := _only_user(cur)) is not None and nxt.target in SCALES and nxt.args[0] is cur \
            and isinstance(nxt.args[1], (int, float)):
        scale *= SCALES[nxt.target](float(nxt.args[1]))
        chain.append(cur := nxt)
    nxt = _only_user(cur)
    if nxt is not None and nxt.target is aten.add.Tensor and nxt.args[0] is cur and isinstance(nxt.args[1], fx.Node):
        mask = nxt.args[1]
        chain.append(cur := nxt)
    nxt = _only_user(cur)
    if nxt is None or nxt.target is not aten.softmax.int or nxt.args[1] % 4 != 3:
        return None
    chain.append(cur := nxt)
    dropout = 0.0
    while (nxt := _only_user(cur)) is not None and (nxt.target in CASTS or nxt.target is aten.dropout.default):
        if nxt.target is aten.dropout.default:
            dropout = float(nxt.args[1]) if nxt.args[2] else 0.0
        chain.append(cur := nxt)
    out = _only_user(cur)
    if out is None or out.target is not aten.matmul.default or out.args[0] is not cur or _rank(out.args[1]) != 4:
        return None
    if not math.isfinite(scale) or _dtype(out) != _dtype(q):
        return None
    return q, kt.args[0], out.args[1], mask, dropout, scale, out, [kt] + chain  # kt first: erased last


def _replace(graph: fx.Graph, scores, q, k, v, mask, dropout, scale, out, chain) -> None:
    with graph.inserting_before(out):
        sdpa = graph.call_function(aten.scaled_dot_product_attention.default, (q, k, v, mask, dropout, False),
                                   {"scale": scale})
    sdpa.meta.update({key: out.meta[key] for key in ("val", "meshc.shape", "nn_module_stack", "stack_trace")
                      if key in out.meta})
    sdpa.meta["meshc.why"] = f"written-out attention (%{scores.name} .. %{out.name}) is scaled_dot_product_attention"
    out.replace_all_uses_with(sdpa)
    graph.erase_node(out)
    for node in reversed(chain):
        for user in [u for u in node.users if u.target is ASSERT]:
            graph.erase_node(user)
        if not node.users:
            graph.erase_node(node)


def _rank(x) -> int:
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else -1


def _dtype(x):
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None
