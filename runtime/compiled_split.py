"""Zero-bubble's two backward halves for a stage that Inductor compiled: AOTAutograd's backward graph cut in two
graphs, each compiled.

    I  (input half)    the nodes on a path to the gradients of the stage's received activations, returning those
                       and the values the weight half reads from them (the "carried" values: the gradient at each
                       matmul's output, for instance)
    W  (weight half)   every other node: the parameters' gradients and what follows them in the graph (ZeRO's
                       reduce-scatters, gradient all-reduces), from the carried values and the backward's own inputs

Nothing is computed twice: each node of the backward graph is in exactly one half (tests/runtime/
test_compiled_split.py counts the matmuls). An interpreted stage splits its backward at the autograd graph instead
(pipeline/backward_split.py); a compiled stage is one autograd node whose backward would otherwise compute every gradient in
I and again in W.

How the halves run: the compiled call's autograd node carries its DeferredWeights (node.metadata[DEFERRED]).
backward_input puts a pre-hook on it that calls `defer_to(node)`: the backward then runs I only, returns no
gradient for the parameters (None: autograd.grad asked for the inputs' alone) and leaves the W call in
node.metadata[WEIGHT_HALF]; backward_weight runs it and hands its gradients on along the node's edges, into the
parameters' accumulators. A backward nobody deferred (a schedule's whole B) runs I, then W at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx as fx

from meshc.compiler.ir.errors import MeshcInternalError

DEFERRED = "meshc.deferred_weights"  # autograd node metadata: the DeferredWeights of the compiled call
WEIGHT_HALF = "meshc.weight_half"  # autograd node metadata: the W call its deferred backward left


@dataclass
class DeferredWeights:
    """One compiled stage's split: which of the compiled function's inputs are activations (their gradients are
    I's), and the node whose backward is to leave W for later (set by a pre-hook, taken by the backward)."""

    activations: frozenset
    pending: Any = None

    def defer_to(self, node) -> None:
        self.pending = node

    def take(self):
        node, self.pending = self.pending, None
        return node


@dataclass
class Halves:
    """The backward graph cut in two: I's graph and W's, and how their values map back onto the backward's."""

    input_half: fx.GraphModule | None
    weight_half: fx.GraphModule | None
    width: int  # gradients the backward returns (one per forward input)
    input_outputs: list[int]  # positions of the gradients I returns, in its output order
    weight_outputs: list[int]  # positions of the gradients W returns
    carried: list[fx.Node] = field(default_factory=list)  # I's values W reads (I's outputs after the gradients)
    weight_reads: list[int] = field(default_factory=list)  # positions among the backward's inputs W reads


def split_graph(gm: fx.GraphModule, activations: frozenset) -> Halves:
    """Cut a backward graph (placeholders: saved values and tangents; output: one gradient or None per forward
    input) so that I computes the gradients at `activations` and W the rest."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    outputs = list(graph.output_node().args[0])
    input_outputs = [i for i, o in enumerate(outputs) if i in activations and isinstance(o, fx.Node)]
    weight_outputs = [i for i, o in enumerate(outputs) if i not in activations and isinstance(o, fx.Node)]
    mine = _ancestors([outputs[i] for i in input_outputs])
    # every other node is W's, also one no gradient reads (an op with an effect runs in the half that holds it)
    theirs = [n for n in graph.nodes if n.op not in ("placeholder", "output") and n not in mine]
    computed, returned = set(theirs), {outputs[i] for i in weight_outputs}

    def read_by_weights(n: fx.Node) -> bool:
        return n in returned or any(u in computed for u in n.users)
    carried = [n for n in graph.nodes if n in mine and n.op != "placeholder" and read_by_weights(n)]
    weight_reads = [k for k, p in enumerate(placeholders) if read_by_weights(p)]
    halves = Halves(None, None, len(outputs), input_outputs, weight_outputs, carried, weight_reads)
    if input_outputs:
        g, env = fx.Graph(), {}
        for n in graph.nodes:
            if n.op == "placeholder" or n in mine:
                env[n] = g.node_copy(n, env.__getitem__)
        g.output(tuple(env[outputs[i]] for i in input_outputs) + tuple(env[c] for c in carried))
        halves.input_half = fx.GraphModule(gm, g)
    if weight_outputs or theirs:
        g, env = fx.Graph(), {}
        for n in carried:
            env[n] = g.placeholder(n.name)
            env[n].meta = dict(n.meta)
        for k in weight_reads:
            env[placeholders[k]] = g.node_copy(placeholders[k])
        for n in theirs:
            env[n] = g.node_copy(n, env.__getitem__)
        g.output(tuple(env[outputs[i]] for i in weight_outputs))
        halves.weight_half = fx.GraphModule(gm, g)
    return halves


def split_backward(deferred: DeferredWeights) -> Callable:
    """compat.inductor_compile's split_backward for a stage: each half compiled by `compile_part`, run as above."""
    def build(gm: fx.GraphModule, inputs: list, compile_part: Callable) -> Callable:
        halves = split_graph(gm, deferred.activations)
        if max(deferred.activations, default=-1) >= halves.width:
            raise MeshcInternalError(f"compiled split: activation positions {sorted(deferred.activations)} beyond the "
                                     f"{halves.width} gradients of the backward graph")
        missing = [c.name for c in halves.carried if "val" not in c.meta]
        if missing:
            raise MeshcInternalError(f"compiled split: carried values without an example value: {missing}")
        first = compile_part(halves.input_half, list(inputs)) if halves.input_half is not None else None
        second = compile_part(halves.weight_half, [c.meta["val"] for c in halves.carried] +
                              [inputs[k] for k in halves.weight_reads]) if halves.weight_half is not None else None
        return _runner(halves, first, second, deferred)
    return build


def _runner(halves: Halves, first: Callable | None, second: Callable | None, deferred: DeferredWeights) -> Callable:
    def run(args: list) -> list:
        reads = [args[k] for k in halves.weight_reads]  # before I runs: a compiled call may empty its argument list
        node = deferred.take()
        grads: list = [None] * halves.width
        got = list(first(args)) if first is not None else []
        for k, i in enumerate(halves.input_outputs):
            grads[i] = got[k]
        carried = got[len(halves.input_outputs):]
        del got, args[:]

        def weight_half() -> list:
            out: list = [None] * halves.width
            if second is not None:
                for i, g in zip(halves.weight_outputs, second(carried + reads)):
                    out[i] = g
            return out
        if node is not None:
            node.metadata[WEIGHT_HALF] = weight_half
            return grads
        return [g if w is None else w for g, w in zip(grads, weight_half())]
    return run


def _ancestors(roots: list[fx.Node]) -> set[fx.Node]:
    seen: set = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen
