"""Branches over their own parameters: `cat([head(x) for head in self.heads], dim=-1)`, a ModuleList of per-head
modules (each head's q, k and v its own linear layers), as the trace unrolls it. Its heads cannot be column-split like
one projection's (q·kᵀ would contract a split dim); instead, over tp, each rank holds the parameters of whole heads and
runs those heads: rank c the branches c·k .. c·k + k − 1 (k = H / n), whose results concatenated are its shard of the
whole cat. The placement is Owned (compiler/ir/placement.py): the program differs between ranks by which branches it
keeps, not by any size.

A group is found from the graph alone: a cat of H >= 2 results of equal shapes, each computed from placeholders (its
own parameters, and buffers) that no other result reads, the same ops on the same other inputs in every branch
(branch g's own placeholders of branch 0's shapes, in the same order), the branches meeting nowhere but at the cat.

    branch_groups(graph) -> [Branches]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from meshc.compiler.ir.placement import Owned, Replicate, Shard
from meshc.compiler.ir.program import ROLE
from meshc.passes.sharding.loops import absorb, reached, same_args

aten = torch.ops.aten


@dataclass
class Branches:
    join: fx.Node  # the cat of the branches' results, in branch order
    bodies: list[list[fx.Node]]  # branch g's nodes in graph order, its own placeholders first
    own: list[list[fx.Node]]  # branch g's own placeholders (parameters and buffers), in graph order

    @property
    def count(self) -> int:
        return len(self.bodies)

    @property
    def dim(self) -> int:
        ndim = len(self.join.meta["meshc.shape"])
        return (self.join.args[1] if len(self.join.args) > 1 else 0) % ndim

    def kept(self, coord: int, n: int) -> range:
        """The branches the rank at `coord` of an axis of n ranks runs."""
        k = self.count // n
        return range(coord * k, (coord + 1) * k)


def branch_groups(graph: fx.Graph) -> list[Branches]:
    """Every group of branches over their own parameters, in graph order."""
    nodes = list(graph.nodes)
    order = {x: i for i, x in enumerate(nodes)}
    out = []
    for join in nodes:
        if join.op == "call_function" and join.target == aten.cat.default:
            group = _group(nodes, order, join)
            if group is not None:
                out.append(group)
    return out


def _group(nodes, order, join: fx.Node) -> Branches | None:
    results = join.args[0]
    if len(results) < 2 or not all(isinstance(r, fx.Node) for r in results) or len(set(results)) != len(results):
        return None
    shapes = {tuple(str(d) for d in r.meta.get("meshc.shape") or ()) for r in results}
    if len(shapes) != 1 or not next(iter(shapes)):
        return None
    own = _own_placeholders(results, order)
    if own is None:
        return None
    seeds = {p: g for g, ps in enumerate(own) for p in ps}
    labels, meet = reached(nodes, order, seeds, stop=join)
    if meet is not None or [labels.get(r) for r in results] != [frozenset({g}) for g in range(len(results))]:
        return None
    member = {x: next(iter(lab)) for x, lab in labels.items()}
    first = min(order[x] for x in member if x.op != "placeholder")
    absorb(nodes[first:order[join]], member)
    bodies: list[list[fx.Node]] = [[] for _ in results]
    for x, g in member.items():
        bodies[g].append(x)
    for body in bodies:
        body.sort(key=order.get)
        if any(u is not join and u not in member for x in body for u in x.users):
            return None  # a branch's value read after the cat other than by it
    if not all(_alike(bodies[0], body) for body in bodies[1:]):
        return None
    return Branches(join, bodies, own)


def _own_placeholders(results: list[fx.Node], order: dict[fx.Node, int]) -> list[list[fx.Node]] | None:
    """Per result, the parameter and buffer placeholders it is computed from that no other result is; None unless
    every result has the same number of them, a trainable parameter among them."""
    first = _ancestors(results[0], stop=set())
    shared: set[fx.Node] = set()
    walked = [first]
    for r in results[1:]:
        met: set[fx.Node] = set()
        walked.append(_ancestors(r, stop=first, met=met))
        for x in met:
            shared |= _ancestors(x, stop=shared) | {x}
    walked[0] = first - shared
    own = [sorted((x for x in w if x.op == "placeholder" and x.meta.get(ROLE) in ("param", "buffer")), key=order.get)
           for w in walked]
    if len({len(ps) for ps in own}) != 1 or len({p for ps in own for p in ps}) != sum(map(len, own)) or \
            not any(p.meta.get(ROLE) == "param" for p in own[0]):
        return None
    return own


def _ancestors(node: fx.Node, stop: set[fx.Node], met: set[fx.Node] | None = None) -> set[fx.Node]:
    """`node` and what it is computed from, not walking into `stop` (those reached are added to `met`)."""
    seen, stack = set(), [node]
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        if x in stop:
            if met is not None:
                met.add(x)
            continue
        seen.add(x)
        stack += x.all_input_nodes
    return seen


def _alike(first: list[fx.Node], body: list[fx.Node]) -> bool:
    """Is `body` branch 0's `first` op for op, on the same inputs from outside, its own placeholders of the same
    shapes and kinds in their place?"""
    if len(first) != len(body):
        return False
    twin = dict(zip(first, body))
    for a, b in twin.items():
        if a.op == "placeholder" or b.op == "placeholder":
            va, vb = a.meta.get("val"), b.meta.get("val")
            if a.op != b.op or a.meta.get(ROLE) != b.meta.get(ROLE) or va is None or vb is None or \
                    tuple(va.shape) != tuple(vb.shape) or va.dtype != vb.dtype:
                return False
            continue
        if a.op != b.op or a.target != b.target or a.kwargs.keys() != b.kwargs.keys():
            return False
        if not same_args(list(a.args), list(b.args), twin) or \
                not same_args(list(a.kwargs.values()), list(b.kwargs.values()), twin):
            return False
    return True


def fold_owned(group: Branches, coord: int, n: int, placements: dict) -> tuple[set[fx.Node], set[fx.Node]]:
    """The tensor_parallel pass's part, for a group whose parameters are Owned: keep the branches of the rank at
    `coord` and the cat of their results (this rank's shard of the whole cat, on its dim); (the nodes kept, the
    nodes to erase: the other branches' ops, not their placeholders, which stay the program's inputs).

    A parameter this rank does not hold (0 rows here) is read into a zero added to the cat, so that backward gives
    it an empty gradient rather than none: every rank then keeps optimizer states, gradient norms and checkpoint
    entries for every parameter alike, whichever heads it holds."""
    kept_branches = group.kept(coord, n)
    kept = {x for g in kept_branches for x in group.bodies[g]}
    dropped = {x for g, body in enumerate(group.bodies) if g not in kept_branches for x in body if x.op != "placeholder"}
    foreign = [p for g, ps in enumerate(group.own) if g not in kept_branches for p in ps if p.meta.get(ROLE) == "param"]
    join, graph = group.join, group.join.graph
    join.update_arg(0, [join.args[0][g] for g in kept_branches])  # placed by the pass: its inputs made whole first
    if not foreign:
        return kept | {join}, dropped
    users = list(join.users)
    made: list[fx.Node] = []
    with graph.inserting_before(join.next):  # in order, after the cat
        zero = None
        for p in foreign:
            total = graph.call_function(aten.sum.default, (p,))
            made.append(total)
            if zero is not None:
                total = graph.call_function(aten.add.Tensor, (zero, total))
                made.append(total)
            zero = total
        nothing = graph.call_function(aten.mul.Tensor, (zero, 0.0))
        out = graph.call_function(aten.add.Tensor, (join, nothing))
    for x in [*made, nothing]:
        x.meta["meshc.shape"], placements[x] = (), Replicate()
    out.meta["meshc.shape"], placements[out] = join.meta["meshc.shape"], Shard(group.dim)
    for x in [*made, nothing, out]:
        x.meta.update({k: join.meta[k] for k in ("nn_module_stack", "stack_trace") if k in join.meta})
    for u in users:
        u.replace_input_with(join, out)
    return kept | set(foreign) | {join, out, nothing, *made}, dropped


def owned_groups(program) -> list[Branches]:
    """The groups whose parameters the tp_placement pass gave Owned placements."""
    out = []
    for group in branch_groups(program.gm.graph):
        specs = [program.params.get(p.meta.get("meshc.fqn")) for ps in group.own for p in ps
                 if p.meta.get(ROLE) == "param"]
        if specs and all(s is not None and isinstance(s.placements.get("tp"), Owned) for s in specs):
            out.append(group)
    return out
