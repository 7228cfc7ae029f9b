"""Stage graphs ready for a backward split in two (zero-bubble schedules: runtime/pipeline/backward_split.py).

    private_weight_uses(stage) -> Stage

The split runs, after the input gradients (I), each op that combined an activation with a parameter-derived
value again, asked only for the gradient of that value (W). Autograd decides what a call computes by node:
when two such ops draw their parameter-derived values from one node (a gradient bucket, a ZeRO-3 gather, a
parameter used twice), asking one of them for its weight gradient also makes the other's activation gradient
"needed", and W recomputes the chain between them. This gives every such use its own node: an alias (a view,
no copy, no FLOPs) between the shared producer and the op.

Requires: a stage graph (compiler/pipeline/stages.py) whose parameters are its first `len(stage.params)` placeholders
and whose received activations are its last `len(stage.recv)`.
Ensures: every call_function node that depends on a received activation with a gradient takes each
parameter-derived argument through an `aten.alias` of its own; the stage computes the same values.

    before:  addmm = aten.addmm(getitem_3, view, t_1)        # getitem_3: a bias out of a gradient bucket
    after:   alias = aten.alias(getitem_3); alias_1 = aten.alias(t_1)
             addmm = aten.addmm(alias, view, alias_1)
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from meshc.compiler.pipeline.stages import Stage

ALIAS = torch.ops.aten.alias.default


def private_weight_uses(stage: Stage) -> Stage:
    """A copy of `stage` whose ops mixing activations and parameter-derived values take the latter through an
    alias of their own (the stage's graph module is copied; `stage` is unchanged)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in stage.gm.graph.nodes if n.op == "placeholder"]
    params = set(placeholders[:len(stage.params)])
    grads = [b.grad for b in stage.recv]
    activations = {n for n, g in zip(placeholders[len(placeholders) - len(stage.recv):], grads) if g}
    weighty: set[fx.Node] = set()  # depends on a parameter, not on an activation
    for n in stage.gm.graph.nodes:
        inputs = n.all_input_nodes
        if n in params or (inputs and any(a in weighty for a in inputs) and not any(a in activations for a in inputs)):
            weighty.add(n)
        if n not in params and any(a in activations for a in inputs):
            activations.add(n)
        if n.op == "call_function" and n in activations and any(a in weighty for a in inputs):
            env[n] = graph.node_copy(n, lambda a: _alias(graph, env[a]) if a in weighty and _tensor(a) else env[a])
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.lint()
    return dataclasses.replace(stage, gm=fx.GraphModule(stage.gm, graph))


def _tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _alias(graph: fx.Graph, value: fx.Node) -> fx.Node:
    node = graph.call_function(ALIAS, (value,))
    node.meta.update({k: v for k, v in value.meta.items() if k == "val" or k.startswith("meshc.")})
    node.meta["meshc.why"] = "backward_graphs: a node of its own for this parameter use (weight gradient apart)"
    return node
