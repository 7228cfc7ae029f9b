"""Backward split in two for zero-bubble schedules: input gradients now (I), weight gradients later (W),
with nothing computed twice.

A plain backward (B) of a stage runs every autograd node between the stage's outputs and its leaves. Split:

    I   the nodes on paths to the stage's inputs (the "input closure" C), each computing only the
        gradients that lead to an input: a matmul's node computes dX and not dW (autograd asks a node only
        for the outputs the call needs). A pre-hook on every node of C that also has an edge leaving C
        (towards a parameter: the "intermediates") keeps the gradients flowing into it.
    W   phase 1: each intermediate again, from the gradients I kept, asked only for the gradients along
        its edges leaving C (the matmul's node now computes dW and not dX); phase 2: one backward from those
        edges through what lies outside C (ZeRO's reduce-scatters, gradient buckets, the parameters'
        AccumulateGrad nodes), exactly as B runs it: gradients accumulate into `.grad` through autograd,
        hooks and callbacks fire as they do in B.

Counted (tests/runtime/test_backward_split.py): the FLOPs of I and W sum to B's, and W runs no matmul whose
result has an activation's shape. Not split: a node whose backward is one opaque function (a Python or
torch.library autograd Function with an activation and a weight input: meshc's fused kernels, collective
matmul, user Functions) computes all its gradients whatever the engine asks, so it runs in full in I and again
in W phase 1: values stay right, but there I + W > B (the cost model prices the second run: GraphCost.unsplit_*,
compiler/cost/compiled.py).

A stage compiled by Inductor is one autograd node; its backward graph is cut in two compiled graphs instead
(runtime/compiled_split.py): I runs the first, W the second, and W's gradients enter phase 2 along the node's edges.

Phase 1 runs one autograd call per group of intermediates that share an edge target outside C. Autograd
decides what a call needs by node, not by edge: in a group of several intermediates, one's activation
gradient may lead to another's target, so that call also recomputes activation gradients between them (the
kept gradients are clamped into each member by pre-hooks, so the values stay exact). Stage graphs give every
parameter use its own node (compiler/pipeline/backward_graphs.py), which keeps each group to one intermediate.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

from meshc.compiler.ir import torch_compat as compat
from meshc.runtime.compiled_split import DEFERRED, WEIGHT_HALF


@dataclass
class WeightWork:
    """What I keeps for W: per intermediate node, the gradients that flowed into it and its edges leaving
    the input closure; the stage outputs that do not depend on the inputs, with their gradients."""

    kept: dict = field(default_factory=dict)  # Node -> tuple of gradients (None where none flowed), in run order
    edges: dict = field(default_factory=dict)  # Node -> [(target Node, input_nr)] leaving the closure, same order
    direct: list = field(default_factory=list)  # [(output tensor, gradient)] whose node is outside C
    compiled: list = field(default_factory=list)  # compiled stage calls whose backward left its W half, run order

    def empty(self) -> bool:
        return not self.direct and not self.compiled and \
            not any(any(g is not None for g in k) for k in self.kept.values())


def grad_node(t: torch.Tensor) -> Node | None:
    """The autograd node a gradient of `t` flows into: its grad_fn, or a leaf's AccumulateGrad."""
    if t.grad_fn is not None or not t.requires_grad:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]  # a view's only edge is to the leaf's accumulator


def backward_input(outs: list[torch.Tensor], grads: list, inputs: list[torch.Tensor]) -> tuple[list, WeightWork]:
    """The gradients of `inputs` (None for those without one) from `outs` with `grads` (None for a scalar
    loss), computing nothing that only a parameter needs; returns them with the work W needs."""
    grads = [g if g is not None else torch.ones_like(o) for o, g in zip(outs, grads)]
    leaves = [t for t in inputs if t.requires_grad]
    closure = _input_closure([grad_node(o) for o in outs], {grad_node(t) for t in leaves})
    work = WeightWork()
    for o, g in zip(outs, grads):
        if grad_node(o) not in closure:
            work.direct.append((o, g))
    split = [node for node in closure if DEFERRED in node.metadata]  # compiled stages: two graphs of their own
    for node in closure:
        leaving = [(n, i) for n, i in node.next_functions if n is not None and n not in closure]
        if leaving and node not in split:
            work.edges[node] = leaving
    handles = [node.register_prehook(_keeper(work.kept, node)) for node in work.edges]
    handles += [node.register_prehook(_deferrer(work.compiled, node)) for node in split]
    try:
        pairs = [(o, g) for o, g in zip(outs, grads) if grad_node(o) in closure]
        # W phase 1 calls the intermediates again; a compiled stage's W holds what it reads itself
        retain = bool(work.edges)
        with compat.split_backward_retained() if retain and split else contextlib.nullcontext():
            got = iter(torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], retain_graph=retain,
                                           allow_unused=True) if pairs and leaves else [None] * len(leaves))
    finally:
        for h in handles:
            h.remove()
    # in the order I ran them (the engine's, the same on every rank): W's collectives (a tensor-parallel
    # matmul's backward, a recomputed checkpoint) then run in the same order on every rank of their group;
    # one not reached in I (no gradient flowed to it) has nothing for W either
    work.edges = {node: work.edges[node] for node in work.kept}
    return [next(got) if t.requires_grad else None for t in inputs], work


def backward_weight(work: WeightWork) -> None:
    """The rest of B: the gradients along the intermediates' edges leaving the input closure (phase 1),
    then backward from those edges into the parameters (phase 2). Empties `work`."""
    seeds: dict = {}  # (Node, input_nr) -> gradient
    for group in _groups(work.edges):
        _phase_one(group, work, seeds)
    for node in work.compiled:  # a compiled stage's W graph: its gradients go along the node's own edges
        for edge, g in zip(node.next_functions, node.metadata.pop(WEIGHT_HALF)()):
            if g is not None and edge[0] is not None:
                seeds[edge] = g if edge not in seeds else seeds[edge] + g
    roots = [GradientEdge(n, i) for n, i in seeds] + [o for o, _ in work.direct]
    values = list(seeds.values()) + [g for _, g in work.direct]
    work.kept.clear()
    work.edges.clear()
    work.direct.clear()
    work.compiled.clear()
    if roots:
        torch.autograd.backward(roots, values)


def _phase_one(group: list[Node], work: WeightWork, seeds: dict) -> None:
    outputs, values, targets = [], [], []
    for node in group:
        for i, g in enumerate(work.kept[node]):
            if g is not None:
                outputs.append(GradientEdge(node, i))
                values.append(g)
        targets += [e for e in work.edges[node] if e not in targets]
    if not outputs:
        return
    # clamp: a member reached from another member's activation gradient takes what I saw, nothing more
    handles = [n.register_prehook(lambda _, kept=work.kept[n]: kept) for n in group] if len(group) > 1 else []
    try:
        got = torch.autograd.grad(outputs, [GradientEdge(n, i) for n, i in targets], values, retain_graph=True,
                                  allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for edge, g in zip(targets, got):
        if g is not None:
            seeds[edge] = g if edge not in seeds else seeds[edge] + g


def _deferrer(compiled: list, node: Node):
    def hook(grad_outputs):
        node.metadata[DEFERRED].defer_to(node)
        compiled.append(node)
    return hook


def _keeper(kept: dict, node: Node):
    def hook(grad_outputs):
        kept[node] = tuple(grad_outputs)
    return hook


def _input_closure(roots: list, inputs: set) -> set:
    """The nodes reachable from `roots` from which some node of `inputs` is reachable (inputs included)."""
    consumers: dict = defaultdict(list)
    seen = {r for r in roots if r is not None}
    stack = list(seen)
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            consumers[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    closure = {n for n in inputs if n in seen}
    stack = list(closure)
    while stack:
        for node in consumers[stack.pop()]:
            if node not in closure:
                closure.add(node)
                stack.append(node)
    return closure


def _groups(edges: dict) -> list[list[Node]]:
    """Intermediates that share an edge target, together (union-find over the targets)."""
    parent: dict = {}

    def find(x):
        while parent.setdefault(x, x) is not x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x
    for node, leaving in edges.items():
        for target, _ in leaving:
            parent[find(target)] = find(node)
    groups: dict = defaultdict(list)
    for node in edges:
        groups[find(node)].append(node)
    return list(groups.values())
