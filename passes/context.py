"""context: context parallelism, every activation sharded on the sequence over the cp axis, attention kept exact.

Purpose: long sequences. The inputs' dim 1 (the sequence; mesh.shard_batch's zigzag layout, runtime/ops/sequence.py)
is split over cp; placements propagate op by op with the same rules as tensor parallelism (tp_table), so
pointwise ops, norms, linears and MLPs run on sequence shards without communication. Values that mix positions
get what their rule asks: scaled_dot_product_attention becomes meshc's context attention (Plan.cp_attention:
ring, all-gather of K/V, or Ulysses all-to-all; runtime/ops/context.py), causal by global positions; a
replicated value computed from positions (rotary tables, learned position embeddings, masks) is sliced to this
rank's positions where it meets sharded values, so positions are global without rewriting them; an op without
a rule (a cumulative sum over the sequence, written-out attention's scores) gets its inputs gathered whole:
correct, and the notes say where. Graph outputs keep their sequence shards: the loss is each rank's own
tokens' mean, averaged over dp (which holds cp) like data parallelism's, and so are the gradients (cp ranks
hold the same parameters), which is why redistributions on cp use data-parallel backward (sequence.py).

Requires: "meshc.shape" (shapes pass) on a graph traced at the global sequence length (compile_program
    traces cp-local example inputs widened cp times on dim 1).
Ensures: node.meta["meshc.placement"]["cp"] on every value; "cp" in Program.local_axes; "meshc.shape" and "val"
    are cp-local from here on (the passes after this one see one cp rank's program); inserted nodes carry
    "meshc.why" and CommRecords on axis cp. With cp = 1, no change.

Before (cp=2):
    %sdpa = aten.scaled_dot_product_attention(%q, %k, %v, None, 0.0, True)        (2, 4, 64, 8)
After:
    %sdpa = meshc.runtime.ops.context.context_attention(%q, %k, %v, None, causal=True, method='ring', ...)
                                                                                    (2, 4, 32, 8)  cp:S(2)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.ir.errors import MeshcValueError, MeshcWarning, warn
from meshc.compiler.ir.fx_ops import get_arg
from meshc.compiler.ir.placement import Partial, R, Replicate, Shard
from meshc.compiler.ir.program import CommRecord, Program
from meshc.runtime.ops import context as attention
from meshc.runtime.ops import sequence as seq

from meshc.passes.attention.constant_mask import MAX_ELEMENTS
from meshc.passes.layout import refresh_vals
from meshc.passes.tensor_parallel import needs_grad, placement_shapes, redistribute_inputs, where
from meshc.passes.tp_rules import Decision, RuleCtx
from meshc.passes.tp_table import infer
from meshc.passes.attention.written_attention import as_sdpa

AXIS = "cp"
aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


def context_pass(program: Program) -> Program:
    n = program.mesh.size(AXIS)
    if n == 1:
        return program.unchanged("cp = 1: nothing to shard")
    program = program.copy()
    mesh, rank = program.mesh, program.rank
    written = as_sdpa(program.gm)
    if written:
        program.notes.append(f"{written} written-out attention(s) (matmul, softmax, matmul) made one attention op")
    ctx = RuleCtx(n, {}, axis=AXIS, index=mesh.coord(AXIS, rank), group=mesh.group_name(AXIS, rank))
    red = _Redistributor(program, ctx)
    grad = needs_grad(program, floating_only=False)  # any mask built from a parameter is refused
    for node in list(program.gm.graph.nodes):
        if node.op == "placeholder":
            ctx.placements[node] = _input_placement(node, n) if node.meta.get("meshc.role") == "input" else R
        elif node.op == "call_function":
            _place(program, node, ctx, red, grad)
        elif node.op == "output":
            _outputs(program, node, ctx, red)
    for node, p in ctx.placements.items():
        if p is not None:
            node.meta["meshc.placement"] = {**node.meta.get("meshc.placement", {}), AXIS: p}
            node.meta["meshc.shape"] = _local_shape(node.meta.get("meshc.shape"), p, n)
    _local_inputs(program)
    program.gm.graph.lint()
    program.gm.recompile()
    program.local_axes = program.local_axes | {AXIS}
    refresh_vals(program)
    rings = sum(1 for nd in program.gm.graph.nodes if nd.target is attention.context_attention)
    program.notes.append(f"cp={n}: {rings} attention(s) made {program.plan.cp_attention}; inserted "
                         f"{red.census() or 'no redistribution'}")
    return program


def _input_placement(node: fx.Node, n: int):
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return R
    size = int(val.shape[1])
    if size % (2 * n):
        raise MeshcValueError(f"cp sharding: input {node.name} of shape {tuple(val.shape)}: its sequence (dim 1) of "
                              f"{size} is not divisible by 2·cp = {2 * n} (each cp rank holds two chunks); pad the "
                              f"sequences to a multiple of {2 * n}")
    return Shard(1)


def _place(program: Program, node: fx.Node, ctx: RuleCtx, red, grad) -> None:
    dec = _attention_rule(program, node, ctx, grad) if node.target is SDPA else infer(node, ctx)
    redistribute_inputs(node, dec, ctx, red)
    if dec.note:
        text = f"cp: {dec.note} at {where(node)}: gathered whole there (correct, costs memory and communication)"
        program.warnings.append(text)
        warn(text, MeshcWarning)
    ctx.placements[node] = dec.out
    for p, shape in placement_shapes(dec.out, node.meta.get("meshc.shape")):
        if isinstance(p, Shard) and (isinstance(p.chunks, tuple) or int(shape[p.dim]) % (2 * ctx.n * p.chunks)):
            raise MeshcValueError(f"cp sharding: {node.format_node()}: dim {p.dim} of size {shape[p.dim]} "
                                  f"({p.chunks} block(s)) does not split into 2·cp = {2 * ctx.n} chunks per block; "
                                  f"choose cp so that 2·cp divides the sequence length")
    if dec.rewrite:
        dec.rewrite(node)


def _attention_rule(program: Program, node: fx.Node, ctx: RuleCtx, grad) -> Decision:
    """SDPA on sequence shards: q, k, v sharded on the sequence (dim -2), the mask whole; context attention."""
    q, k, v = node.args[:3]
    mask = get_arg(node, (3,)) if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if all(not isinstance(ctx.pl(t), (Shard, Partial)) for t in (q, k, v)):
        return Decision({}, R)  # attention over replicated values: nothing of the sequence here
    dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    causal = bool(node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False))
    at = f"{node.format_node()} ({where(node)})"
    if dropout:
        raise MeshcValueError(f"cp attention: {at}: attention dropout {dropout} under context parallelism is not "
                              f"supported (each rank would drop different probabilities); set the attention "
                              f"dropout to 0")
    per_position = _per_position(node, ctx, mask)
    if per_position is not None:
        return per_position
    if isinstance(mask, fx.Node) and grad.get(mask):
        raise MeshcValueError(f"cp attention: {at}: the attention mask %{mask.name} depends on parameters (a "
                              f"learned bias); context parallelism needs a mask without gradient")
    if isinstance(mask, fx.Node) and _numel(mask) > MAX_ELEMENTS:  # the masks pass could not evaluate it
        text = (f"cp attention: {at}: its mask %{mask.name} ({_numel(mask)} elements) is kept whole on every rank "
                f"(too large to evaluate at compile time); it does not shrink with cp")
        program.warnings.append(text)
        warn(text, MeshcWarning)
    for i in (1, 2):  # grouped-query attention: the ring carries the kv heads, not their copies per query head
        copies = node.args[i]
        kv = _unexpanded(copies, program.mesh.size("tp"))
        if kv is not None and isinstance(ctx.pl(kv), Shard):
            node.update_arg(i, kv)
            while isinstance(copies, fx.Node) and not copies.users and copies is not kv:  # reshape, expand, unsqueeze
                ctx.placements.pop(copies, None)
                copies, dead = copies.args[0], copies
                program.gm.graph.erase_node(dead)
    k, v = node.args[1], node.args[2]
    method = program.plan.cp_attention
    dim = len(node.meta["meshc.shape"]) - 2
    need = {(i,): Shard(dim) for i in range(3)}
    if isinstance(mask, fx.Node):
        need[(3,) if len(node.args) > 3 else ("attn_mask",)] = R
    kv_bytes = _bytes(k) + _bytes(v)
    n = ctx.n

    def rewrite(nd: fx.Node) -> None:
        new_mask = get_arg(nd, (3,)) if len(nd.args) > 3 else nd.kwargs.get("attn_mask")
        nd.target = attention.context_attention
        nd.args = tuple(nd.args[:3]) + (new_mask,)
        nd.kwargs = {"causal": causal, "scale": node.kwargs.get("scale"), "method": method,
                     "group": ctx.group, "size": n, "index": ctx.index}
        why = f"context parallel ({method} attention): %{nd.name} needs every position's K and V"
        nd.meta["meshc.why"] = why
        heads, kv_heads = int(q.meta["meshc.shape"][1]), int(k.meta["meshc.shape"][1])
        kv_sent = kv_bytes // n * (heads // kv_heads if method == "all_to_all" and kv_heads % n else 1)
        item = k.meta["val"].dtype.itemsize
        nd.meta["meshc.comm"] = _attention_comms(method, kv_sent, _bytes(q) // n, n, why, item)
    return Decision(need, Shard(dim), rewrite=rewrite)


def _per_position(node: fx.Node, ctx: RuleCtx, mask) -> Decision | None:
    """Attention with the sequence among its batch or head dims, not its query or key positions (each token attends
    over its own few values: Inkling2's attention over a block's residual streams, q a learned query expanded): q, k
    and v split on that dim, the mask too where it varies along it, plain attention on each rank's positions. None
    where the shards are not all on one such dim."""
    q, k, v = node.args[:3]
    places = [ctx.pl(t) for t in (q, k, v)]
    dims = {p.dim for p in places if isinstance(p, Shard)}
    ndim = len(node.meta["meshc.shape"])
    if any(isinstance(p, Partial) for p in places) or len(dims) != 1 or next(iter(dims)) >= ndim - 2 or \
            any(isinstance(p, Shard) and p.chunks != 1 for p in places):
        return None
    (dim,) = dims
    need = {(i,): Shard(dim) for i in range(3)}
    if isinstance(mask, fx.Node):
        shape = mask.meta.get("meshc.shape") or ()
        at = dim - (ndim - len(shape))  # the mask broadcasts from the right
        need[(3,) if len(node.args) > 3 else ("attn_mask",)] = Shard(at) if at >= 0 and shape[at] != 1 else R
    return Decision(need, Shard(dim))


def _numel(node: fx.Node) -> int:
    val = node.meta.get("val")
    return int(val.numel()) if isinstance(val, torch.Tensor) else 0


def _unexpanded(x, tp: int):
    """The (B, Hkv, T, D) value behind transformers' repeat_kv, reshape(expand(unsqueeze(kv, 2), (B, Hkv, g, T, D))),
    when tp divides Hkv (each tp rank then keeps whole groups); None for anything else."""
    if not (isinstance(x, fx.Node) and x.target in (aten.reshape.default, aten.view.default, aten._unsafe_view.default)):
        return None
    ex = x.args[0]
    if not (isinstance(ex, fx.Node) and ex.target is aten.expand.default and len(ex.users) == 1):
        return None
    un = ex.args[0]
    if not (isinstance(un, fx.Node) and un.target is aten.unsqueeze.default and un.args[1] == 2 and len(un.users) == 1):
        return None
    kv = un.args[0]
    shape, out = kv.meta.get("meshc.shape"), x.meta.get("meshc.shape")
    if shape is None or out is None or len(shape) != 4 or len(out) != 4 or int(shape[1]) % tp:
        return None
    same = [int(a) for a in shape[::2]] == [int(b) for b in out[::2]] and int(shape[3]) == int(out[3])
    return kv if same and int(out[1]) % int(shape[1]) == 0 else None


def _attention_comms(method: str, kv_local: int, q_local: int, n: int, why: str, item: int) -> list[CommRecord]:
    """What one context attention sends per rank per step (bytes of K and V held locally: kv_local; item: their
    element size)."""
    if method == "ring":  # K and V around the ring n-1 times; backward K, V again and their gradients (in fp32)
        return [CommRecord("ring", AXIS, kv_local, "forward", why, count=n - 1),
                CommRecord("ring", AXIS, kv_local + kv_local * 4 // item, "backward", why, count=n - 1)]
    if method == "all_gather":
        return [CommRecord("all_gather", AXIS, kv_local, "forward", why),
                CommRecord("reduce_scatter", AXIS, kv_local * n, "backward", why)]
    return [CommRecord("all_to_all", AXIS, 2 * q_local + kv_local, "forward", why),  # q, k, v in; out back
            CommRecord("all_to_all", AXIS, 2 * q_local + kv_local, "backward", why)]


def _outputs(program: Program, node: fx.Node, ctx: RuleCtx, red) -> None:
    """Outputs keep their sequence shards (each rank's loss is over its own tokens): a partial sum is summed, and a
    value gathered whole on its way (a prompt cat before the tokens, an op without a rule) that still has the inputs'
    sequence as its dim 1 is sliced back to this rank's positions, the inputs' layout (before, CPM-Ant's logits came out
    whole, twice the rows of the rank's targets)."""
    outs = list(node.args[0])
    length = _sequence_length(program, ctx)
    for i, a in enumerate(outs):
        if not isinstance(a, fx.Node):
            continue
        if isinstance(ctx.pl(a), Partial):
            outs[i] = red.convert(a, ctx.pl(a), R, node, "graph outputs are whole sums")
        elif isinstance(ctx.pl(a), Replicate) and length and _gathered_sequence(a, length):
            outs[i] = red.convert(a, R, Shard(1), node, "graph outputs keep the inputs' sequence shards")
            program.notes.append(f"cp: output %{a.name}, gathered whole on its way, sliced back to this rank's "
                                 f"positions of the sequence")
    node.update_arg(0, tuple(outs))


def _sequence_length(program: Program, ctx: RuleCtx) -> int | None:
    """The global sequence length of the inputs split on dim 1, where they agree."""
    sizes = {int(x.meta["val"].shape[1]) for x in program.placeholders("input") if ctx.pl(x) == Shard(1)}
    return sizes.pop() if len(sizes) == 1 else None


def _gathered_sequence(node: fx.Node, length: int) -> bool:
    """Is `node`, whole, of 3 or more dims with the sequence's length as its dim 1 (logits, hidden states: a 2-D
    (batch, features) output of the same size stays whole, as a pooled one must), with a sequence gather among the
    values it is made of?"""
    shape = node.meta.get("meshc.shape")
    if not isinstance(node.meta.get("val"), torch.Tensor) or not shape or len(shape) < 3 or shape[1] != length:
        return False
    todo, seen = [node], set()
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        if x.target is seq.seq_gather:
            return True
        todo.extend(x.all_input_nodes)
    return False


class _Redistributor:
    """Inserts (once per value and placement) the cp redistribution a consumer needs."""

    def __init__(self, program: Program, ctx: RuleCtx):
        self.program, self.ctx = program, ctx
        self.cache: dict[tuple[fx.Node, object], fx.Node] = {}
        self.made: set[fx.Node] = set()

    def convert(self, src: fx.Node, cur, req, consumer: fx.Node, why: str) -> fx.Node:
        if (src, req) in self.cache:
            return self.cache[(src, req)]
        if isinstance(cur, Shard) and isinstance(req, Shard):
            whole = self.convert(src, cur, R, consumer, why)
            return self.convert(whole, R, req, consumer, why)
        n, group, index = self.ctx.n, self.ctx.group, self.ctx.index
        full = _bytes(src)
        if isinstance(cur, Partial) and isinstance(req, Replicate):
            fn, kw = seq.seq_reduce, {"group": group}
            comm = [("all_reduce", "forward", full), ("all_reduce", "backward", full)]
        elif isinstance(cur, Partial) and isinstance(req, Shard):
            fn, kw = seq.seq_reduce_scatter, {"dim": req.dim, "chunks": req.chunks, "size": n, "group": group}
            comm = [("reduce_scatter", "forward", full), ("all_gather", "backward", full // n)]
        elif isinstance(cur, Shard) and isinstance(req, Replicate):
            fn = seq.seq_gather
            kw = {"dim": cur.dim, "chunks": cur.chunks, "size": n, "index": index, "group": group}
            comm = [("all_gather", "forward", full // n), ("reduce_scatter", "backward", full)]
        elif isinstance(cur, Replicate) and isinstance(req, Shard):
            fn = seq.seq_slice
            kw = {"dim": req.dim, "chunks": req.chunks, "size": n, "index": index, "group": group}
            comm = []
        else:
            raise MeshcValueError(f"cp sharding: no redistribution from {cur} to {req} for {src.format_node()}")
        with self.program.gm.graph.inserting_before(consumer):
            node = self.program.gm.graph.call_function(fn, (src,), kw)
        node.meta.update({k: src.meta[k] for k in ("meshc.shape", "val") if k in src.meta})
        node.meta["meshc.why"] = f"context parallel: {why}"
        node.meta["meshc.comm"] = [CommRecord(kind, AXIS, b, phase, f"context parallel: {why}")
                                   for kind, phase, b in comm]
        stack = consumer.meta.get("nn_module_stack") or src.meta.get("nn_module_stack")
        if stack:
            node.meta["nn_module_stack"] = stack
        self.ctx.placements[node] = req
        self.cache[(src, req)] = node
        self.made.add(node)
        return node

    def census(self) -> str:
        kinds: dict[str, int] = {}
        for node in self.made:
            kinds[node.target.__name__] = kinds.get(node.target.__name__, 0) + 1
        return ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))


def _local_shape(shape, p, n: int):
    if shape is None:
        return None
    if isinstance(p, tuple):
        return tuple(_local_shape(s, q, n) for s, q in zip(shape, p))
    if not isinstance(p, Shard) or shape and isinstance(shape[0], tuple):
        return shape
    return tuple(s // n if d == p.dim else s for d, s in enumerate(shape))


def _local_inputs(program: Program) -> None:
    """The input placeholders' example values at their cp-local shapes (what refresh_vals propagates)."""
    mode = compat.fake_tensor_mode()
    for node in program.placeholders("input"):
        val = node.meta.get("val")
        p = node.meta.get("meshc.placement", {}).get(AXIS)
        if isinstance(val, torch.Tensor) and isinstance(p, Shard):
            with mode:
                node.meta["val"] = torch.empty(_local_shape(tuple(val.shape), p, program.mesh.size(AXIS)),
                                               dtype=val.dtype, device=val.device)


def _bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return int(val.numel() * val.dtype.itemsize) if isinstance(val, torch.Tensor) else 0
