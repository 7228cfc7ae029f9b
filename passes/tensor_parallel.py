"""tensor_parallel: propagate placements on the tp axis op by op and insert the collectives they need.

Purpose: Megatron-style tensor parallelism on any traceable model. Parameters arrive with tp placements
(from the tp_placement pass); activations get theirs from the op rules (the table in tp_table, of the rules in
tp_rules and tp_views); where a value's placement differs from what its consumer needs, a redistribution
node is inserted (all-reduce, all-gather, local slice, reduce-scatter); each rule's rewrite then runs
(size arguments of views made local; the vocab-parallel embedding and loss-parallel cross-entropy); graph
outputs are made whole. Backward needs no pass: every inserted node is an autograd function whose
backward is the conjugate collective, and a replicated value feeding sharded compute is routed through
Megatron's f (identity forward, all-reduce of its partial gradient backward).

Requires: "meshc.shape" on every value (shapes pass); ParamSpec.placements["tp"] decided (tp_placement pass).
Ensures: node.meta["meshc.placement"]["tp"] on every value; every value's "val" has its local shape;
    inserted nodes carry "meshc.why" and CommRecords; outputs are replicated. With tp = 1, no change.
Terms: R replicated, S(d) sharded on dim d (xc: c blocks), P partial sum (each rank holds a summand).

Before (rowwise MLP output, tp=2):
    %linear_5 = aten.linear(%gelu, %p_w2, %p_b2)
After:
    %linear_5 = aten.linear(%gelu, %p_w2)                        S(2) x S(1) -> P
    %all_reduce = meshc.runtime.ops.collectives.all_reduce(%linear_5, group='5')       P -> R
    %add_9 = aten.add.Tensor(%all_reduce, %p_b2)
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from meshc.compiler.ir.errors import MeshcInternalError, MeshcValueError, MeshcWarning, warn
from meshc.compiler.ir.fx_ops import get_arg, is_alias, is_op_call, model_source, op_name, set_arg, written_in_place
from meshc.compiler.ir.placement import Owned, Partial, R, Replicate, Shard, has_whole, in_parts, local_length
from meshc.compiler.ir.program import CommRecord, Program
from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.ir.sizes import bounded_sizes
from meshc.runtime.ops import collectives as C
from meshc.runtime.ops.tp_ops import join_blocks

from meshc.passes.layout import refresh_vals
from meshc.passes.shapes import check_divisible
from meshc.passes.sharding.branches import fold_owned, owned_groups
from meshc.passes.sharding.loops import fold, loop_of
from meshc.passes.tp_rules import RuleCtx
from meshc.passes.tp_table import infer

AXIS = "tp"
aten = torch.ops.aten
COMM_FNS = (C.all_reduce, C.grad_all_reduce, C.all_gather, C.all_gather_rs, C.local_slice, C.reduce_scatter)


def tensor_parallel_pass(program: Program) -> Program:
    n = program.mesh.size(AXIS)
    if n == 1:
        return program.unchanged("tp = 1: nothing to shard")
    program = program.copy()
    graph = program.gm.graph
    _split_rowwise_biases(program)
    placements: dict[fx.Node, object] = {}
    local: set[fx.Node] = set()  # the ops of this rank's own heads (an owned group's): whole values, no collective
    apart: set[fx.Node] = set()  # ops each rank runs on other parts (local, a folded loop's): none sequence-parallel
    sp = _sp_target(program)
    ctx = RuleCtx(n, placements, sp_dim=lambda node: None if node in apart else sp(node), axis=AXIS,
                  index=program.mesh.coord(AXIS, program.rank), group=program.mesh.group_name(AXIS, program.rank))
    red = _Redistributor(program, ctx)
    origin: dict[fx.Node, str] = {}
    loops, joins, pieces, dropped = loop_of(graph), {}, set(), set()
    owned = {}  # an owned group's cat -> its dim
    for group in owned_groups(program):  # whole heads per rank: this rank's branches kept, the others' erased
        kept, erased = fold_owned(group, ctx.index, n, placements)
        pieces |= kept
        dropped |= erased
        owned[group.join] = group.dim
        local |= {x for g in group.kept(ctx.index, n) for x in group.bodies[g]}
    apart |= local
    _check_owned_reads(program, pieces | dropped)
    for node in list(graph.nodes):
        if node in dropped:
            continue
        loop = loops.get(node)
        if loop is not None and loop.join not in joins:  # a loop over parts: folded where its sources are sharded
            folded = fold(loop, ctx, red)
            joins[loop.join] = folded is not None
            if folded:
                pieces |= folded[0]
                apart |= folded[0]
                dropped |= folded[1]
        if node in pieces and loop is not None and node in loop.seeds:  # local part g: another part of the whole on each rank
            placements[node] = R
        elif joins.get(node):
            placements[node] = Shard(loops[node.args[0][0]].dim)
        elif node in owned:  # the cat of this rank's whole heads: its shard of the whole cat
            why = "whole heads on each tp rank: the cat of this rank's heads is its shard of all of them"
            for a in list(node.args[0]):
                if not isinstance(ctx.pl(a), Replicate):  # a head's result sharded by the rules (its rows, under SP)
                    node.replace_input_with(a, red.convert(a, ctx.pl(a), R, node, why))
            placements[node] = Shard(owned[node])
        elif node in placements and node in pieces:  # the zero an owned group's cat adds
            continue
        elif node.op == "placeholder":
            spec = program.params.get(node.meta.get("meshc.fqn")) or program.buffers.get(node.meta.get("meshc.fqn"))
            placements[node] = spec.placements[AXIS] if spec else R
            if isinstance(placements[node], Owned):  # held whole here, or not at all (never read then)
                placements[node] = R
            if spec and not isinstance(placements[node], Replicate):
                origin[node] = spec.fqn
        elif node.op == "call_function":
            if node in local:  # each rank runs other heads: what a head reads from outside is made whole first
                for a in list(node.all_input_nodes):
                    if a not in local and ctx.pl(a) is not None and not isinstance(ctx.pl(a), Replicate):
                        node.replace_input_with(a, red.convert(a, ctx.pl(a), R, node, "each tp rank runs its own "
                                                               "heads whole, on the whole input"))
            _place(program, node, ctx, red, origin)
        elif node.op == "output":
            outs = [(i, a) for i, a in enumerate(node.args[0]) if isinstance(a, fx.Node)]
            for i, a in outs:
                if not isinstance(ctx.pl(a), Replicate) and ctx.pl(a) is not None:
                    new = red.convert(a, ctx.pl(a), R, node, "graph outputs are whole on every rank")
                    node.update_arg(0, tuple(new if j == i else b for j, b in enumerate(node.args[0])))
    for node in reversed(list(graph.nodes)):
        if node in dropped:
            graph.erase_node(node)
        elif node.target in COMM_FNS and node.args[0] in apart:  # ranks run different parts there: none pairs up
            raise MeshcInternalError(f"tp: {node.format_node()} inside a head each rank runs whole ({where(node)})")
    _insert_f(program, ctx, red, pieces)
    if program.plan.sequence_parallel:
        _fuse_gather_f(program)
    for node in graph.nodes:
        if node in placements and placements[node] is not None:
            node.meta["meshc.placement"] = {**node.meta.get("meshc.placement", {}), AXIS: placements[node]}
        spec = program.params.get(node.meta.get("meshc.fqn")) if node.op == "placeholder" else None
        if spec is not None and isinstance(spec.placements.get(AXIS), Owned):  # R to the rules; here or not at all
            node.meta["meshc.placement"][AXIS] = spec.placements[AXIS]
    graph.lint()
    program.gm.recompile()
    program.local_axes = program.local_axes | {AXIS}
    refresh_vals(program)
    census = red.census()
    program.notes.append(f"tp={n}: inserted {census or 'no collectives'}")
    return program


def _check_owned_reads(program: Program, grouped: set[fx.Node]) -> None:
    """A parameter dealt to one tp rank (Owned) may be read only by its group's branches, here kept or erased: read
    anywhere else (a graph of the torch.compile door cut inside the heads), a rank without it would compute on
    nothing."""
    for node in program.placeholders("param"):
        spec = program.params[node.meta["meshc.fqn"]]
        if isinstance(spec.placements.get(AXIS), Owned) and any(u not in grouped for u in node.users):
            user = next(u for u in node.users if u not in grouped)
            raise MeshcValueError(f"tp sharding: {spec.fqn} is held whole by tp rank {spec.placements[AXIS].coord} "
                                  f"(its heads' branches), but {user.format_node()} ({where(user)}) reads it outside "
                                  "them (a graph break inside the heads?); keep those heads replicated with "
                                  "Plan(tp={'<module glob>': 'replicate'})")


def _place(program, node, ctx, red, origin) -> None:
    dec = infer(node, ctx)
    if dec.indivisible:
        srcs = [origin[a] for a in node.all_input_nodes if a in origin]
        because = f"; it is sharded because {srcs[0]} is" if srcs else ""
        raise MeshcValueError(f"tp sharding: {node.format_node()} ({where(node)}): "
                              f"{dec.indivisible[0]}={ctx.n}{because}. "
                              f"Choose tp dividing that size, or keep the parameter replicated on tp "
                              f"(Plan(tp={{'<module glob>': 'replicate'}})).")
    redistribute_inputs(node, dec, ctx, red)
    if dec.note:
        text = f"tp: {dec.note} at {where(node)}: replicated there (correct, costs communication)"
        program.warnings.append(text)
        warn(text, MeshcWarning)
    ctx.placements[node] = dec.out
    srcs = [origin[a] for a in node.all_input_nodes if a in origin]
    if srcs:
        origin[node] = srcs[0]
    for placement, shape in placement_shapes(dec.out, node.meta.get("meshc.shape")):
        why = f"; it is sharded because {origin[node]} is" if node in origin else ""
        check_divisible(shape, placement, ctx.n, AXIS, f"{node.format_node()} ({where(node)})", why)
    if dec.rewrite:  # local size arguments; the vocab-parallel embedding and loss
        dec.rewrite(node)


def redistribute_inputs(node: fx.Node, dec, ctx: RuleCtx, red) -> None:
    """Each input of `node` whose placement differs from what its rule's decision requires is replaced by the
    redistribution `red.convert` inserts (tensor_parallel's and context's redistributors alike)."""
    for path, req in dec.inputs.items():
        src = get_arg(node, path)
        cur = ctx.pl(src)
        if cur != req:
            why = dec.note or f"{op_name(node.target)} needs {req} of %{src.name} ({cur})"
            writes = path == (0,) and is_op_call(node) and compat.op_is_mutable(node.target)
            writer = node if writes and is_alias(src) else \
                written_in_place(node) if path == (0,) and is_alias(node) else None
            if writer is not None:  # the write would land in the redistribution's copy, not in the tensor viewed
                raise MeshcValueError(
                    f"tensor_parallel: expected an in-place write into a view to keep the placement of the tensor it "
                    f"views, got {writer.format_node()} ({where(writer)}) writing through a view whose input would "
                    f"move from {cur} to {req} for {node.format_node()} ({why}); the write would land in a copy; model "
                    f"source: {model_source(writer)}. Keep that module replicated (Plan(tp={{'<module glob>': "
                    "'replicate'}})), or write the op out of place")
            value = red.convert(src, cur, req, node, why)
            if writes:
                value = _own_copy(value, node, ctx)  # `node` writes it: not the shared, autograd-owned redistribution
            set_arg(node, path, value)


def _own_copy(value: fx.Node, consumer: fx.Node, ctx: RuleCtx) -> fx.Node:
    """A clone of a redistribution's output for an op that writes its input in place (`results[idx] += ...` on a
    value gathered for it): the redistribution is shared by every consumer of that placement, and autograd forbids
    writing into the output of the collective's Function."""
    with consumer.graph.inserting_before(consumer):
        copy = consumer.graph.call_function(torch.ops.aten.clone.default, (value,))
    copy.meta.update({k: value.meta[k] for k in ("meshc.shape", "val", "nn_module_stack", "stack_trace")
                      if k in value.meta})
    ctx.placements[copy] = ctx.placements.get(value)
    return copy


def placement_shapes(out, shape) -> list:
    """(placement, shape) per tensor output of a node, from its decision's `out` and its "meshc.shape"."""
    if isinstance(out, tuple):
        return [(o, s) for o, s in zip(out, shape or ()) if s is not None]
    return [(out, shape)] if shape is not None and out is not None else []


# ---------------------------------------------------------------------------------------- redistribution
class _Redistributor:
    """Inserts and caches the node that turns a value's placement into the one a consumer needs."""

    def __init__(self, program: Program, ctx: RuleCtx):
        self.program, self.ctx = program, ctx
        self.group = program.mesh.group_name(AXIS, program.rank)
        self.index = program.mesh.coord(AXIS, program.rank)
        self.cache: dict[tuple[fx.Node, object], fx.Node] = {}
        self.inserted: list[fx.Node] = []

    def convert(self, src: fx.Node, cur, req, consumer: fx.Node, why: str) -> fx.Node:
        key = (src, req)
        if key in self.cache:
            return self.cache[key]
        if isinstance(cur, Shard) and isinstance(req, Shard):
            whole = self.convert(src, cur, R, consumer, why)
            return self.convert(whole, R, req, consumer, why)
        n, group = self.ctx.n, self.group
        if isinstance(cur, Partial) and isinstance(req, Shard) and has_whole(req.chunks):  # no reduce-scatter
            whole = self.convert(src, cur, R, consumer, why)  # of a block every rank holds whole
            return self.convert(whole, R, req, consumer, why)
        if isinstance(cur, Partial) and isinstance(req, Replicate):
            fn, kw, comm = C.all_reduce, {"group": group}, [("all_reduce", "forward", cur)]
        elif isinstance(cur, Partial) and isinstance(req, Shard):
            fn, kw = C.reduce_scatter, {"dim": req.dim, "chunks": req.chunks, "size": n, "group": group}
            comm = [("reduce_scatter", "forward", cur), ("all_gather", "backward", req)]
        elif isinstance(cur, Shard) and isinstance(req, Replicate):
            fn = C.all_gather
            kw = {"dim": cur.dim, "chunks": cur.chunks, "size": n, "index": self.index, "group": group}
            comm = [("all_gather", "forward", cur)]
        elif isinstance(cur, Replicate) and isinstance(req, Shard):
            fn = C.local_slice
            kw = {"dim": req.dim, "chunks": req.chunks, "size": n, "index": self.index, "group": group}
            comm = [("all_gather", "backward", req)]
        else:
            raise MeshcInternalError(f"tensor_parallel: no redistribution from {cur} to {req} for {src.format_node()}")
        with self.program.gm.graph.inserting_before(consumer):
            node = self.program.gm.graph.call_function(fn, (src,), kw)
        self._annotate(node, src, req, comm, f"tensor parallel: {why}")
        _same_module(node, src, consumer)
        self.ctx.placements[node] = req
        self.cache[key] = node
        self.inserted.append(node)
        return node

    def _annotate(self, node, src, req, comm, why) -> None:
        node.meta["meshc.shape"] = src.meta["meshc.shape"]
        node.meta["val"] = src.meta.get("val")
        node.meta["meshc.why"] = why
        node.meta["meshc.comm"] = [CommRecord(kind, AXIS, self.local_bytes(src, p), phase, why)
                                   for kind, phase, p in comm]

    def local_bytes(self, node: fx.Node, placement) -> int:
        shape = bounded_sizes(node)
        if isinstance(placement, Shard):
            shape[placement.dim] = local_length(placement, shape[placement.dim], self.ctx.n)
        return math.prod(shape) * node.meta["val"].dtype.itemsize

    def census(self) -> str:
        kinds: dict[str, int] = {}
        for node in self.program.gm.graph.nodes:
            if node.target in COMM_FNS:
                kinds[node.target.__name__] = kinds.get(node.target.__name__, 0) + 1
        return ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))


def _insert_f(program: Program, ctx: RuleCtx, red: _Redistributor, pieces: set[fx.Node]) -> None:
    """A replicated value that feeds sharded compute gets partial gradients from it: route those uses
    through grad_all_reduce (Megatron's f) so that its gradient is whole again. A parameter all of whose
    uses are sharded instead gets its partial gradient summed by the grad_sync pass, in buckets. The iterations
    of a folded loop (`pieces`) are such compute: each rank runs those of its own parts."""
    graph = program.gm.graph
    grad = needs_grad(program)
    targets: dict[fx.Node, list[fx.Node]] = {}
    for node in list(graph.nodes):
        if not isinstance(ctx.placements.get(node), Replicate) or not grad.get(node) or node in pieces:
            continue
        users = [u for u in node.users if u.op == "call_function" and u.target not in COMM_FNS
                 and u.target is not join_blocks and (in_parts(ctx.placements.get(u)) or u in pieces)]  # joined
        # whole: no f
        if users:
            targets[node] = users
    _hoist_over_splits(targets, ctx, grad)
    for node, users in targets.items():
        spec = program.params.get(node.meta.get("meshc.fqn")) if node.op == "placeholder" else None
        if spec is not None and len(users) == len(node.users):
            spec.grad_partial = spec.grad_partial + (AXIS,)
            continue
        first = min(users, key=list(graph.nodes).index)
        why = (f"tensor parallel (f): %{node.name} is replicated and feeds sharded {op_name(users[0].target)}; "
               "its gradient is a partial sum there")
        with graph.inserting_before(first):
            f = graph.call_function(C.grad_all_reduce, (node,), {"group": red.group})
        red._annotate(f, node, R, [("all_reduce", "backward", R)], why)
        _same_module(f, node, first)
        ctx.placements[f] = R
        for u in users:
            u.replace_input_with(node, f)


_SPLITS = (torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default, torch.ops.aten.chunk.default,
           torch.ops.aten.unbind.int)


def _hoist_over_splits(targets: dict[fx.Node, list[fx.Node]], ctx: RuleCtx, grad: dict) -> None:
    """Pieces of a split that all need f, each read only by sharded compute (one expert's rows per linear layer: a
    loop over experts), get one f on the split's input instead of one each: the same bytes, one all-reduce."""
    splits = list(dict.fromkeys(p.args[0] for p in targets if p.target is operator.getitem and
                                p.args[0].target in _SPLITS))  # in graph order: every rank inserts alike
    for split in splits:
        parts = list(split.users)
        src = split.args[0]
        if len(parts) < 2 or any(p.target is not operator.getitem or len(targets.get(p, ())) != len(p.users)
                                 for p in parts) or not isinstance(ctx.placements.get(src), Replicate) or \
                not grad.get(src) or src in targets:
            continue
        for p in parts:
            del targets[p]
        targets[src] = [split]


def _fuse_gather_f(program: Program) -> None:
    """Sequence parallel: an all-gather whose result only feeds f becomes all_gather_rs (all-gather
    forward, reduce-scatter backward) and the f disappears, as Megatron-SP does."""
    graph = program.gm.graph
    for node in list(graph.nodes):
        if node.target is not C.all_gather or not node.users or has_whole(node.kwargs["chunks"]):
            continue
        if all(u.target is C.grad_all_reduce for u in node.users):
            for f in list(node.users):
                f.replace_all_uses_with(node)
                graph.erase_node(f)
            node.target = C.all_gather_rs
            record = node.meta["meshc.comm"][0]
            full = record.bytes * int(node.kwargs["size"])
            node.meta["meshc.comm"] = [record, CommRecord("reduce_scatter", AXIS, full, "backward", record.why)]


def _same_module(inserted: fx.Node, src: fx.Node, consumer: fx.Node) -> None:
    """Which module an inserted node belongs to: a gather or an f opens its consumer's sharded region;
    a reduction or a slice closes (or is free in) its producer's."""
    opens = inserted.target in (C.all_gather, C.all_gather_rs, C.grad_all_reduce)
    first, second = (consumer, src) if opens else (src, consumer)
    stack = first.meta.get("nn_module_stack") or second.meta.get("nn_module_stack")
    if stack:
        inserted.meta["nn_module_stack"] = stack


def needs_grad(program: Program, floating_only: bool = True) -> dict[fx.Node, bool]:
    """Which values depend on a trainable parameter; with `floating_only`, only floating values (those that can
    carry a gradient) count."""
    out: dict[fx.Node, bool] = {}
    for node in program.gm.graph.nodes:
        if node.op == "placeholder":
            spec = program.params.get(node.meta.get("meshc.fqn"))
            out[node] = bool(spec and spec.requires_grad)
        else:
            val = node.meta.get("val")
            floating = isinstance(val, torch.Tensor) and val.is_floating_point() or isinstance(val, (tuple, list))
            out[node] = bool(floating or not floating_only) and any(out.get(a) for a in node.all_input_nodes)
    return out


# ---------------------------------------------------------------------------------------- rewrites
def _split_rowwise_biases(program: Program) -> None:
    """linear(x, W, b) / addmm(b, x, W) with W split on its input dim: the bias joins after the reduction."""
    graph = program.gm.graph
    for node in list(graph.nodes):
        if node.target == aten.linear.default and len(node.args) > 2 and node.args[2] is not None:
            w, b, dim_in = node.args[1], node.args[2], 1
            weight_args = (node.args[0], w)
            target = aten.linear.default
        elif node.target == aten.addmm.default:
            b, w, dim_in = node.args[0], node.args[2], 0
            weight_args = (node.args[1], w)
            target = aten.mm.default
        else:
            continue
        spec = program.params.get(w.meta.get("meshc.fqn")) if w.op == "placeholder" else None
        p = spec.placements.get(AXIS) if spec else None
        if not (isinstance(p, Shard) and p.dim == dim_in):
            continue
        with graph.inserting_after(node):
            add = graph.call_function(aten.add.Tensor, (node, b))
        node.replace_all_uses_with(add, delete_user_cb=lambda u: u is not add)
        node.target, node.args, node.kwargs = target, weight_args, {}
        add.meta.update({k: node.meta[k] for k in ("val", "meshc.shape", "nn_module_stack") if k in node.meta})


def _sp_target(program: Program):
    """Sequence parallel: the shard a partial activation is reduce-scattered to (None: all-reduce)."""
    if not program.plan.sequence_parallel:
        return lambda node: None
    first = next((n for n in program.placeholders("input") if isinstance(n.meta.get("val"), torch.Tensor)), None)
    if first is None or first.meta["val"].dim() < 2:
        return lambda node: None
    batch, seq = (int(s) for s in first.meta["val"].shape[:2])

    def target(node: fx.Node):
        shape = node.meta.get("meshc.shape")
        if not shape or isinstance(shape[0], tuple):
            return None
        try:
            shape = [int(s) for s in shape]
        except TypeError:  # rows known only at run time (routed to an expert): not the token layout
            return None
        if len(shape) >= 3 and shape[0] == batch and shape[1] == seq:
            return Shard(1)
        if len(shape) == 2 and shape[0] == batch * seq:
            return Shard(0, batch)
        return None
    return target


# ---------------------------------------------------------------------------------------- helpers
def where(node: fx.Node) -> str:
    """"%name in module.path": a node as errors and warnings name it."""
    stack = node.meta.get("nn_module_stack")
    module = list(stack.values())[-1][0] if stack else ""
    return f"%{node.name}" + (f" in {module}" if module else "")
