"""Regions run under `torch.no_grad()` (or `enable_grad()`), which torch.export keeps as one higher-order op
(`wrap_with_set_grad_enabled(enabled, submodule, *inputs)`), inlined into the graph, so that the passes see their ops.

Left as one op, a region is opaque to every pass: the sharding rules have none for it, so a layer it reads stays
whole on tp, and so does every layer whose flow meets it (HRM's recurrent modules run their early cycles under
no_grad: 0.50 of the blocks sharded; HY-V4's sparse-attention indexer). Inlined, each of the region's ops is an
ordinary node, and a region that turned gradients off hands its results on through `detach`: no gradient reaches
anything through them, as under no_grad, so losses and gradients are the model's own (check_trace compares them
with eager). What differs is only that autograd records the region's ops while they run, freed with the values
they read once the region's results are detached.

    inline_grad_regions(gm) -> regions inlined
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from meshc.compiler.ir.program import GRAD_REGION

aten = torch.ops.aten


def _is_region(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "wrap_with_set_grad_enabled"


def inline_grad_regions(gm: fx.GraphModule) -> int:
    """Inline every grad-mode region of `gm` (nested ones too) in place; returns how many were. A region that cannot
    be (its tuple of results read whole) stays one op; the ones after it are inlined all the same."""
    count, kept = 0, set()
    while True:
        region = next((n for n in gm.graph.nodes if _is_region(n) and n not in kept), None)
        if region is None:
            break
        if _inline(gm, region):
            count += 1
        else:
            kept.add(region)
    if count:
        gm.delete_all_unused_submodules()
        gm.recompile()
    return count


def _inline(gm: fx.GraphModule, region: fx.Node) -> bool:
    enabled, holder, inputs = region.args[0], region.args[1], region.args[2:]
    if not all(u.op == "call_function" and u.target is operator.getitem for u in region.users):
        return False  # its tuple read whole: left as it is
    sub: fx.GraphModule = getattr(gm, holder.target)
    graph = gm.graph
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, inputs))
    results: tuple = ()
    with graph.inserting_before(region):
        for node in sub.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                results = tuple(node.args[0]) if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
                break
            if node.op == "get_attr":  # a nested region's submodule, or a constant: moved onto gm
                name = _free_name(gm, f"{holder.target}_{node.target}")
                setattr(gm, name, getattr(sub, node.target))
                env[node] = graph.get_attr(name)
                env[node].meta.update(node.meta)
                continue
            env[node] = graph.node_copy(node, lambda a: env[a])
        outs = [_detached(graph, env[r], region) if not enabled and isinstance(r, fx.Node) else
                (env[r] if isinstance(r, fx.Node) else r) for r in results]
    for user in list(region.users):
        user.replace_all_uses_with(outs[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(region)
    if not holder.users:  # the submodule's get_attr (nothing else of the graph is removed)
        graph.erase_node(holder)
    return True


def _detached(graph: fx.Graph, value: fx.Node, region: fx.Node) -> fx.Node:
    """`value` with no gradient through it (a tensor); anything else as it is. The detach keeps the region's
    place in the model (`meshc.grad_region`: a strict trace holds a torch.autograd.Function's forward as such a
    region, its backward dropped, which check_trace names when the gradients then differ from eager's)."""
    val = value.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return value
    out = graph.call_function(aten.detach.default, (value,))
    out.meta.update({k: v for k, v in value.meta.items() if k in ("val", "tensor_meta", "nn_module_stack")})
    out.meta["val"] = val.detach()
    out.meta["stack_trace"] = region.meta.get("stack_trace") or value.meta.get("stack_trace")
    out.meta[GRAD_REGION] = True
    return out


def _free_name(gm: fx.GraphModule, base: str) -> str:
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name
