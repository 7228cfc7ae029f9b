"""Loops over the parts of a dim: `for i in range(H): out_i = f(x[i], y[i], ...)`, then `cat(outs)` (or stack), as the
trace unrolls them (Zamba's Mamba mixer scans each of its heads on its own). When x, y, ... are sharded on that dim
over tp, each rank runs the iterations of the parts it holds: iteration g of the local program reads local part g,
the iterations past the local count are dropped, and the cat of the kept ones is the rank's shard of the whole cat.

A loop is found from the graph alone: selects `select(src, dim, g)` with constant indices covering every part of a
dim of size H >= 2 (for each of one or more sources), whose iterations (the ops reached from the selects of one
index) meet only at one cat or stack of their results, in index order, and are the same ops on the same other
inputs but for the index (the local program's iteration g must compute what iteration r·H/n + g does on rank r).
A loop whose iterations feed one another (a scan over time steps) is not one.

    loop_of(graph) -> {node of an iteration: Loop}
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from meshc.compiler.ir.placement import Replicate, Shard

aten = torch.ops.aten
_JOINS = (aten.cat.default, aten.stack.default)


@dataclass
class Loop:
    sources: dict[fx.Node, int]  # each tensor whose parts the iterations read -> the dim they index
    count: int  # H: iterations, parts of each source's dim
    bodies: list[list[fx.Node]]  # iteration g's nodes in graph order (its selects included)
    join: fx.Node  # the cat or stack of the iterations' results, in index order
    seeds: set[fx.Node] = field(default_factory=set)  # the selects

    @property
    def dim(self) -> int:
        """The join's dim (of its output: a stack's new dim)."""
        ndim = len(self.join.meta["meshc.shape"])
        return (self.join.args[1] if len(self.join.args) > 1 else 0) % ndim

    def nodes(self) -> set[fx.Node]:
        return {n for body in self.bodies for n in body}


def loop_of(graph: fx.Graph) -> dict[fx.Node, Loop]:
    """Every loop of the graph, by each node of its iterations."""
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    groups = _select_groups(nodes)
    by_join: dict[fx.Node, dict[tuple[fx.Node, int], dict[int, list[fx.Node]]]] = {}
    for key, by_index in groups.items():
        join = _join(nodes, order, {s: g for g, sel in by_index.items() for s in sel}, len(by_index))
        if join is not None:
            by_join.setdefault(join, {})[key] = by_index
    out: dict[fx.Node, Loop] = {}
    for join, found in by_join.items():
        loop = _loop(nodes, order, join, found)
        if loop is not None:
            out.update({n: loop for n in loop.nodes()})
    return out


def _select_groups(nodes: list[fx.Node]) -> dict[tuple[fx.Node, int], dict[int, list[fx.Node]]]:
    """(source, dim) -> index -> its selects, for the dims whose every part is selected by a constant index."""
    groups: dict[tuple[fx.Node, int], dict[int, list[fx.Node]]] = {}
    for n in nodes:
        if n.op != "call_function" or n.target != aten.select.int or not isinstance(n.args[2], int):
            continue
        shape = n.args[0].meta.get("meshc.shape") if isinstance(n.args[0], fx.Node) else None
        try:
            dim = n.args[1] % len(shape)
            size = int(shape[dim])
        except (TypeError, ZeroDivisionError):  # no shape, or a size known only at run time
            continue
        if size >= 2:
            groups.setdefault((n.args[0], dim), {}).setdefault(n.args[2] % size, []).append(n)
    return {k: v for k, v in groups.items() if sorted(v) == list(range(int(k[0].meta["meshc.shape"][k[1]])))}


def reached(nodes, order, seeds: dict[fx.Node, int], stop: fx.Node | None = None):
    """Each node reached from the seeds -> the indices that reach it, from the first seed on (to `stop`, excluded);
    and the first node reached by two indices (None if none before `stop`)."""
    labels: dict[fx.Node, frozenset[int]] = {}
    for n in nodes[min(order[s] for s in seeds):]:
        if n is stop:
            return labels, None
        lab = frozenset().union(*(labels[a] for a in n.all_input_nodes if a in labels))
        if n in seeds:
            lab |= {seeds[n]}
        if len(lab) > 1:
            return labels, n
        if lab:
            labels[n] = lab
    return labels, None


def _join(nodes, order, seeds: dict[fx.Node, int], count: int) -> fx.Node | None:
    """The cat/stack where the iterations meet, taking one result of each in index order; None where they meet
    anywhere else first (one feeds another) or never."""
    labels, meet = reached(nodes, order, seeds)
    if meet is None or meet.target not in _JOINS or len(meet.args[0]) != count:
        return None
    if [labels.get(t) for t in meet.args[0]] != [frozenset({g}) for g in range(count)]:
        return None
    return meet


def joined_in_order(seeds: dict[fx.Node, int], count: int) -> bool:
    """Do the values these selects take (select -> its index) meet first at a cat or stack of one result of each
    index, in index order: a loop over the parts, not parts put to different uses (q, k and v)?"""
    graph = next(iter(seeds)).graph
    nodes = list(graph.nodes)
    return _join(nodes, {n: i for i, n in enumerate(nodes)}, seeds, count) is not None


def _loop(nodes, order, join: fx.Node, groups: dict) -> Loop | None:
    """The loop of these select groups meeting at `join`, if its iterations are alike and read none of each other."""
    seeds = {s: g for by_index in groups.values() for g, sel in by_index.items() for s in sel}
    count = len(next(iter(groups.values())))
    if any(len(by_index) != count for by_index in groups.values()):
        return None
    labels, meet = reached(nodes, order, seeds, stop=join)
    if meet is not None:
        return None
    member = {n: next(iter(lab)) for n, lab in labels.items()}
    first = min(order[n] for n in member)
    absorb(nodes[first:order[join]], member)
    bodies: list[list[fx.Node]] = [[] for _ in range(count)]
    for n, g in member.items():
        bodies[g].append(n)
    for body in bodies:
        body.sort(key=order.get)
        if any(u is not join and u not in member for n in body for u in n.users):
            return None  # a value of an iteration read after the loop other than by the join
    sources = {src: dim for src, dim in groups}
    if any(order[src] > first for src in sources):
        return None  # a source computed inside the loop
    if not all(_alike(bodies[0], body, g, seeds) for g, body in enumerate(bodies)):
        return None
    return Loop(sources, count, bodies, join, set(seeds))


def absorb(span: list[fx.Node], member: dict[fx.Node, int]) -> None:
    """Ops inside the loop that no select reaches but only one iteration uses (a scan's initial state, `zeros(...)`,
    made anew by each iteration), and checks that read only one iteration's values: that iteration's."""
    changed = True
    while changed:
        changed = False
        for n in reversed(span):
            if n in member or n.op != "call_function":
                continue
            near = {member.get(u) for u in n.users} if n.users else {member.get(a) for a in n.all_input_nodes}
            if len(near) == 1 and None not in near:
                member[n] = near.pop()
                changed = True


def _alike(first: list[fx.Node], body: list[fx.Node], g: int, seeds: dict[fx.Node, int]) -> bool:
    """Is `body` (iteration g) `first` (iteration 0) op for op, on the same inputs from outside, but for the index?"""
    if len(first) != len(body):
        return False
    twin = dict(zip(first, body))
    for a, b in twin.items():
        if a.target != b.target or a.kwargs.keys() != b.kwargs.keys():
            return False
        args_a, args_b = list(a.args), list(b.args)
        if a in seeds:
            if b not in seeds or seeds[a] != 0 or seeds[b] != g:
                return False
            args_a, args_b = args_a[:2], args_b[:2]
        if not same_args(args_a, args_b, twin) or not same_args(list(a.kwargs.values()), list(b.kwargs.values()), twin):
            return False
    return True


def same_args(xs, ys, twin: dict[fx.Node, fx.Node]) -> bool:
    if isinstance(xs, (list, tuple)):
        return isinstance(ys, (list, tuple)) and len(xs) == len(ys) and all(same_args(x, y, twin) for x, y in zip(xs, ys))
    if isinstance(xs, fx.Node):
        return twin.get(xs, xs) is ys
    return type(xs) is type(ys) and xs == ys


def fold(loop: Loop, ctx, red) -> tuple[set[fx.Node], set[fx.Node]] | None:
    """The tensor_parallel pass's part: where a source is sharded on its loop dim (split alone), keep the iterations
    of the local parts (the others' sources redistributed to that shard, what the iterations read from outside made
    whole) and the join of their results: (the nodes kept, the nodes to erase); None to run the loop as it is.
    `red` is the pass's redistributor: `convert(src, cur, req, consumer, why)`."""
    n = ctx.n
    wanted = {src: Shard(dim) for src, dim in loop.sources.items()}
    current = {src: ctx.pl(src) for src in loop.sources}
    if loop.count % n or not any(current[s] == w for s, w in wanted.items()) or \
            any(isinstance(current[s], Shard) and current[s] != w for s, w in wanted.items()):
        return None
    why = f"the loop over the {loop.count} parts of its dim: each rank runs the iterations of the parts it holds"
    order = {x: i for i, x in enumerate(loop.join.graph.nodes)}
    parts = set(loop.sources)  # the sources, or their redistributions to the shard
    for src, want in wanted.items():
        if current[src] != want:
            seeds = sorted((u for u in src.users if u in loop.seeds), key=order.get)
            value = red.convert(src, current[src], want, seeds[0], why)
            parts.add(value)
            for s in seeds:
                s.replace_input_with(src, value)
    k = loop.count // n
    kept = {x for body in loop.bodies[:k] for x in body}
    inside = loop.nodes()
    for x in (x for body in loop.bodies[:k] for x in body):  # in graph order: every rank inserts alike
        for a in list(x.all_input_nodes):
            if a not in inside and a not in parts and not isinstance(ctx.pl(a), Replicate) and ctx.pl(a) is not None:
                x.replace_input_with(a, red.convert(a, ctx.pl(a), Replicate(), x, why))
    loop.join.update_arg(0, list(loop.join.args[0])[:k])
    return kept, inside - kept
