"""A per-rank program with ops no traced graph can hold, cut into regions that Inductor compiles and the ops that
run between them as FX code (what a TorchDynamo graph break is to torch.compile).

Such ops (`runs_eagerly`): expert parallelism's dispatch and combine, whose all-to-all sizes come from the routing
(`.tolist()` of counts exchanged at run time), and everything between them, whose row count is the routing's; context
parallelism's ring attention and collective matmul, which pass blocks around a ring of point-to-point transfers
(`dist.isend`/`irecv`, no functional collective); a user autograd.Function that draws random numbers (its
meshc_fn op's backward recomputes its forward under the generator state the forward saw: a value no traced graph
restores; compiler/trace/autograd_functions.py). Each is an autograd Function: its backward runs eagerly too,
between the compiled regions' backward graphs.

    top = cut(gm)     # None where the whole program compiles
    top.regions       # names of the submodules Inductor compiles (even levels), the rest run as FX code

Each node gets a level: compiled nodes even, eager ones odd, each as early as its inputs allow; a compiled node
then sinks to the region just before its first user (a ZeRO-3 gather into the region that reads it, not the first
one, which would hold every gathered bucket to the end of the forward). torch.fx's split_module makes one submodule
per level, called in order by the top module.

A ZeRO-3 gather whose parameters only eager ops read (expert parallelism's expert weights, read by the routed
matmuls) runs as FX code too, with the views taken of its parameters alone (`eager_gathers`), sunk like a compiled
node to the eager stretch that reads it: compiled, its parameters would leave the region as outputs and the eager
matmuls' autograd would save them whole until backward. As FX code, the step's ZeRO context (runtime/zero/context.py)
swaps them for handles in the saved tensors and gathers them again in backward, as a program run as FX code does.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.trace.autograd_functions import function_call, random_draw
from meshc.runtime.ops import collective_matmul, context, experts
from meshc.runtime.ops.zero import zero_gather

_ALWAYS = (experts.dispatch, experts.combine, experts.local_ids, collective_matmul.all_gather_matmul,
           collective_matmul.matmul_reduce_scatter)


def runs_eagerly(node: fx.Node) -> bool:
    """Is `node` one of the ops no traced graph can hold (module docstring)?"""
    if node.op != "call_function":
        return False
    if node.target in _ALWAYS:
        return True
    if function_call(node.target) is not None:  # a user Function drawing random numbers (its backward's recompute
        return random_draw(node) is not None    # restores the forward's generator state, which no graph can)
    return node.target is context.context_attention and node.kwargs.get("method") == "ring"


def eager_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes that run as FX code: those ops, the pieces taken of their tuple results, and every node computed
    from a dispatch's rows up to their combine (sized by the routing)."""
    out: set[fx.Node] = set()
    routed: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in (experts.dispatch, experts.local_ids) or \
                (n.target is not experts.combine and any(a in routed for a in n.all_input_nodes)):
            routed.add(n)
        if n in routed or runs_eagerly(n) or (n.target is operator.getitem and n.args[0] in out):
            out.add(n)
    return out | eager_gathers(gm, out)


def eager_gathers(gm: fx.GraphModule, eager: set[fx.Node]) -> set[fx.Node]:
    """ZeRO-3 gathers whose parameters only `eager` nodes read: each with its start, the pieces of its tuple and
    the nodes computed from those alone (views, transposes), where every reader outside them is eager."""
    out: set[fx.Node] = set()
    for g in gm.graph.nodes:
        if g.op != "call_function" or g.target is not zero_gather:
            continue
        chain = {g}
        for n in gm.graph.nodes:  # in graph order: a node computed from the chain alone joins it
            if n not in chain and n.op == "call_function" and n.all_input_nodes and set(n.all_input_nodes) <= chain:
                chain.add(n)
        readers = {u for n in chain for u in n.users if u not in chain}
        if readers and readers <= eager:
            out |= chain | {g.args[0]}
    return out


def gathers_run_eagerly(gm: fx.GraphModule) -> bool:
    """Does some ZeRO-3 gather of `gm` run as FX code when it is cut into regions (`eager_gathers`)? Then the step
    needs its ZeRO context, compiled or not."""
    return any(n.target is zero_gather for n in eager_nodes(gm))


def levels(gm: fx.GraphModule, eager: set[fx.Node]) -> dict[fx.Node, int]:
    """Each computing node's region: even levels compiled, odd ones eager (module docstring)."""
    movable = eager_gathers(gm, eager) & eager
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    level: dict[fx.Node, int] = {n: 0 for n in gm.graph.nodes if n.op in ("placeholder", "get_attr")}
    for n in nodes:
        ins = [level[a] for a in n.all_input_nodes]
        if n in eager:
            level[n] = max([v + 1 if v % 2 == 0 else v for v in ins], default=1)
        else:
            level[n] = max([v if v % 2 == 0 else v + 1 for v in ins], default=0)
    for n in reversed(nodes):  # sink: to the last region of its kind before its first reader
        if n.target is operator.getitem or (n in eager and n not in movable):
            continue  # a piece of a tuple follows its tuple (below: a region returns tensors, not tuples)
        readers = [r for u in n.users for r in (u.users if u.target is operator.getitem else [u])]
        if not readers or any(r.op == "output" for r in readers) or _writes(n) or \
                any(_writes(r) for r in [*n.users, *readers]):
            continue  # an in-place write stays beside what it writes (moved to a later region, it would bump a
            # tensor an earlier one saved)
        kind = level[n] % 2
        level[n] = max(level[n], min(level[r] if level[r] % 2 == kind else level[r] - 1 for r in readers))
    for n in nodes:
        if n.target is operator.getitem:
            level[n] = level[n.args[0]]
    return level


def _writes(node: fx.Node) -> bool:
    return node.op == "call_function" and compat.is_op_overload(node.target) and compat.op_is_mutable(node.target)


def _storages(value) -> list:
    values = value if isinstance(value, (tuple, list)) else [value]
    return [compat.storage_key(v) for v in values if isinstance(v, torch.Tensor)]


def _is_identity(node: fx.Node) -> bool:
    """A Python autograd op that returns views of its inputs (grad_sync: an all-reduce in backward only; tp's f):
    its outputs (their fake values, or those of the pieces taken of them) share an input's storage."""
    if node.op != "call_function" or compat.is_op_overload(node.target) or node.target is operator.getitem:
        return False
    outs = _storages(node.meta.get("val")) + [k for u in node.users if u.target is operator.getitem
                                              for k in _storages(u.meta.get("val"))]
    ins = {k for a in node.all_input_nodes for k in _storages(a.meta.get("val"))}
    return any(k in ins for k in outs)


def _views_of(node: fx.Node) -> set[fx.Node]:
    """`node` and every value taken of it as a view (pieces of a tuple, ATen views), transitively."""
    out, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in out:
            out.add(n)
            stack += [u for u in n.users if u.op == "call_function" and (
                u.target is operator.getitem or (compat.is_op_overload(u.target) and compat.op_returns_view(u.target)))]
    return out


def assign(gm: fx.GraphModule) -> tuple[set[fx.Node], dict[fx.Node, int]] | None:
    """The nodes that run as FX code and each node's level (even: a compiled region); None where no node runs
    eagerly. A region hands no view of a custom-backward identity to another: AOTAutograd regenerates an output that
    aliases an input or an intermediate outside its compiled function, so autograd would go around the op's backward
    (found: ep's expert weights, whose grad_sync then skipped its all-reduce). Such an op, with the views taken of it,
    runs as FX code wherever its views would leave the region computing it."""
    eager = eager_nodes(gm)
    if not eager:
        return None
    chains = [_views_of(n) for n in gm.graph.nodes if _is_identity(n)]
    while True:
        level = levels(gm, eager)
        leaving = [c for c in chains if not c <= eager and len(
            {level[n] for n in c} | {level.get(u, -1) for n in c for u in n.users if u not in c}) > 1]
        if not leaving:
            return eager, level
        for c in leaving:
            eager |= c


def cut(gm: fx.GraphModule) -> fx.GraphModule | None:
    """The top module calling each region in order (module docstring), its compiled regions' names in
    `top.regions` and the eager ops' names in `top.eager`; None where no node runs eagerly."""
    assigned = assign(gm)
    if assigned is None:
        return None
    eager, level = assigned
    top = split_module(gm, None, lambda n: level[n], tuple_return=True)
    top.regions = sorted((name for name, _ in top.named_children() if int(name.rsplit("_", 1)[1]) % 2 == 0),
                         key=lambda s: int(s.rsplit("_", 1)[1]))
    top.eager = [n.name for n in gm.graph.nodes if n in eager and runs_eagerly(n)]
    return top
