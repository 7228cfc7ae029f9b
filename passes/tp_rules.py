"""Placement rules for tensor parallelism: for each ATen op family, given the placements of its inputs on
one mesh axis, which placement each input must have and which placement the output gets.

    rule(node, ctx) -> Decision(inputs={arg path: required placement}, out=placement, rewrite=...)

An input whose placement differs from the requirement is redistributed by the tensor_parallel pass
(gather, slice, reduce or reduce-scatter). Rules prefer keeping shards: a replicated operand next to a
sharded one is sliced locally (free), a partial sum is reduced only where an op is not linear in it.
A rule whose op must run differently on shards says so in its rewrite, applied after redistribution:
the vocab-parallel embedding (a masked lookup of this rank's rows) and the loss-parallel cross-entropy.

Rules are data: `@handles(ops...)` only marks a rule with the ops it decides (Decision, RuleCtx and handles live in
passes/rules/decision.py); COMPUTE_RULES lists this file's rules and those of passes/rules/scan.py (a state-space
mixer's conv1d, einsum, pad, ...), tp_views' VIEW_RULES the view-like ops', and tp_table builds the one op -> rule table
(with the pointwise and no-rule fallbacks) that the plan and tensor_parallel passes read.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from meshc.compiler.ir.fx_ops import grouped_mm_args, op_name, tensor_args
from meshc.compiler.ir.placement import P, Partial, Placement, R, Replicate, Shard, has_whole, local_shape
from meshc.compiler.ir.program import OPAQUE, TP_FACTORY
from meshc.compiler.ir.sizes import static_sizes
from meshc.runtime.ops.context import context_attention
from meshc.runtime.ops.experts import combine, dispatch

from meshc.passes.rules.decision import Decision, RuleCtx, handles
from meshc.passes.rules.scan import SCAN_RULES
from meshc.passes.tp_whole import split_whole_matmul

aten = torch.ops.aten


def no_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """An op without a rule: every tensor input replicated (a note says so where one was not)."""
    tensors = tensor_args(node)
    if all(isinstance(ctx.pl(t), Replicate) for _, t in tensors):
        return Decision({}, _like(node, R))
    opaque = node.meta.get(OPAQUE)  # a user Function that is not elementwise, and why
    why = f" (a user autograd.Function: {opaque})" if opaque else ""
    return Decision({path: R for path, _ in tensors}, _like(node, R),
                    note=f"no tensor-parallel rule for {op_name(node.target)}{why}: inputs replicated")


def _like(node: fx.Node, p: Placement):
    shape = node.meta.get("meshc.shape")
    if shape is not None and shape and (isinstance(shape[0], tuple) or shape[0] is None):
        return tuple(p for _ in shape)
    return p if shape is not None else None


def _ndim(node: fx.Node) -> int:
    return len(node.meta["meshc.shape"])


def _shape(node: fx.Node) -> tuple[int, ...]:
    return static_sizes(node)


# ---------------------------------------------------------------------------------------- pointwise
LINEAR_IN_PARTIAL = {aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor, aten.neg.default,
                     aten.mul.Tensor, aten.div.Tensor,
                     aten.clone.default, aten.alias.default, aten.contiguous.default, aten.detach.default}


def pointwise_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """Broadcasting elementwise ops: shards align on the output dim; replicated operands are sliced."""
    tensors = tensor_args(node)
    out_ndim = _ndim(node)
    pls = {path: ctx.pl(t) for path, t in tensors}
    required: dict[tuple, Placement] = {}
    if any(isinstance(p, Partial) for p in pls.values()):
        if _partial_ok(node, tensors, pls):
            return Decision({}, P)
        target = _reduced(node, ctx)
        for path, p in list(pls.items()):
            if isinstance(p, Partial):
                required[path] = pls[path] = target
    sharded = [(path, t, pls[path]) for path, t in tensors if isinstance(pls[path], Shard)]
    seq = ctx.sp_dim(node) if _floating(node) else None
    if not sharded and seq is None:
        return Decision(required, R)
    if sharded:
        path0, t0, s0 = sharded[0]
        out_dim = s0.dim + out_ndim - _ndim(t0)
    else:  # sequence parallel: activations of the residual stream live on sequence shards
        s0, out_dim = seq, seq.dim
    if has_whole(s0.chunks) and any(not isinstance(pls[path], Shard) and _ndim(t) and (
            out_dim - out_ndim + _ndim(t) < 0 or _shape(t)[out_dim - out_ndim + _ndim(t)] == 1) for path, t in tensors):
        return _gather_all(node, ctx, "an operand broadcast over blocks held whole (its gradient would count them "
                                      "once per rank)")
    for path, t, p in tensors_with(tensors, pls):
        offset = out_ndim - _ndim(t)
        d = out_dim - offset
        broadcast = d < 0 or _shape(t)[d] == 1
        if isinstance(p, Shard):
            if p.dim + offset == out_dim and p.chunks == s0.chunks:
                continue
            required[path] = R if broadcast else Shard(d, s0.chunks)
        elif not broadcast:
            required[path] = Shard(d, s0.chunks)
    return Decision(required, Shard(out_dim, s0.chunks))


def elementwise_function_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """A user Function the trace found elementwise (compiler/trace/elementwise_functions.py: its arguments and
    outputs share one shape, its forward and backward are pointwise): its tensors all take the first shard
    among its arguments (partial ones reduced to it); the generator state it also returns stays whole."""
    tensors = tensor_args(node)
    pls = {path: ctx.pl(t) for path, t in tensors}
    outputs = len(node.meta["meshc.shape"]) - 1
    shard = next((p for p in pls.values() if isinstance(p, Shard)), None)
    want = shard if shard is not None else R
    required = {path: want for path, p in pls.items() if p != want}
    return Decision(required, tuple([want] * outputs) + (R,))


def _floating(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def tensors_with(tensors, pls):
    return [(path, t, pls[path]) for path, t in tensors]


def _partial_ok(node, tensors, pls) -> bool:
    """Is the op linear in its partial operand(s), so that P stays P?"""
    if node.target not in LINEAR_IN_PARTIAL:
        return False
    partial = [path for path, _ in tensors if isinstance(pls[path], Partial)]
    others = [path for path, _ in tensors if not isinstance(pls[path], Partial)]
    if node.target in (aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor):
        scalar_other = any(not isinstance(a, fx.Node) for a in node.args[:2])
        return not others and not scalar_other  # P + P; never P + R or P + scalar
    if node.target in (aten.mul.Tensor, aten.div.Tensor):
        if len(partial) != 1 or (node.target == aten.div.Tensor and partial[0] != (0,)):
            return False
        return all(isinstance(pls[o], Replicate) for o in others)
    return True


def _reduced(node: fx.Node, ctx: RuleCtx) -> Placement:
    """Where a partial sum goes when an op needs it whole: R, or the sequence shard under SP."""
    return ctx.sp_dim(node) or R


@handles(aten.dropout.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default,
         aten.type_as.default, aten.alias.default, aten.contiguous.default, aten.detach.default,
         aten.__and__.Tensor, aten.__or__.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
         aten.bitwise_not.default, aten.logical_not.default, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
         aten.masked_fill_.Scalar, aten.masked_fill_.Tensor,
         aten.log_sigmoid.default,  # pointwise, though torch's tags do not say so (a composite op: xLSTM's gates)
         aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar)  # where() with a scalar branch: the same
def same_as_input_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    if node.target == aten.dropout.default:
        p, seq = ctx.pl(node.args[0]), ctx.sp_dim(node)
        if (isinstance(p, Partial) and node.args[1] > 0) or (isinstance(p, Replicate) and seq):
            return Decision({(0,): _reduced(node, ctx)}, _reduced(node, ctx))  # SP: dropout on sequence shards
    return pointwise_rule(node, ctx)


@handles(aten._assert_tensor_metadata.default)
def assert_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    return Decision({}, None)


@handles(aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default, aten.ones.default,
         aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default)
def factory_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """Whole, but for a buffer that tp_placement found sharded writes fill (passes/sharding/buffers.py): sharded as
    it decided, made at its local sizes."""
    p = node.meta.get(TP_FACTORY)
    if isinstance(p, Shard):
        sizes = list(static_sizes(node))
        return Decision({}, p, rewrite=lambda nd: nd.update_arg(0, list(local_shape(sizes, p, ctx.n))))
    return Decision({}, R)


@handles(aten.new_ones.default, aten.new_zeros.default, aten.new_empty.default, aten.new_full.default)
def new_factory_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """x.new_*(sizes): a buffer made like x. Where x is sharded on a dim that the buffer has at the same size
    (HY-V4's `kv.new_empty(*kv.shape[:-1], d)`, then filled by writes of the heads' shards into slices of it), the
    buffer is sharded alike, made at its local sizes, as zeros_like(x) is: its values (a constant, or none before the
    writes) are the same whichever part a rank holds, and the placement of x keeps the writes into it local. Elsewhere
    its sizes (global) make it whole."""
    x = node.args[0]
    p = ctx.pl(x)
    src, dst = static_sizes(x), static_sizes(node)
    if isinstance(p, Shard) and not has_whole(p.chunks) and len(src) == len(dst) and src[p.dim] == dst[p.dim]:
        return Decision({}, p, rewrite=lambda nd: nd.update_arg(1, list(local_shape(dst, p, ctx.n))))
    return Decision({}, R)


# ---------------------------------------------------------------------------------------- matmuls
def _mm_operands(node: fx.Node):
    """(a, a_path, b, b_path, b_transposed, bias_path) for the matmul family."""
    t = node.target
    if t == aten.linear.default:
        return node.args[0], (0,), node.args[1], (1,), True, (2,) if len(node.args) > 2 and node.args[2] is not None else None
    if t in (aten.addmm.default, aten.baddbmm.default):
        return node.args[1], (1,), node.args[2], (2,), False, (0,)
    return node.args[0], (0,), node.args[1], (1,), False, None


@handles(aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default,
         aten.baddbmm.default)
def matmul_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """a (..., m, k) @ b (..., k, n) (b given as (n, k) for linear). Shards follow the contraction:
    k sharded on both -> partial sum; m (a's rows) or n (b's columns) sharded on one -> output sharded;
    a batch dim sharded on both -> output sharded there."""
    a, ap, b, bp, b_t, biasp = _mm_operands(node)
    pa, pb = ctx.pl(a), ctx.pl(b)
    na, nb, nout = _ndim(a), _ndim(b), _ndim(node)
    b_k = nb - 1 if b_t else nb - 2
    b_n = nb - 2 if b_t else nb - 1
    req: dict[tuple, Placement] = {}
    if any(isinstance(p, Shard) and has_whole(p.chunks) for p in (pa, pb)) and not (
            isinstance(pb, Shard) and pb.dim == b_n and (biasp is None or _ndim_of(node, biasp) == 1)):
        return _gather_all(node, ctx, "blocks held whole on a dim other than the output's columns")
    if isinstance(pa, Partial) and isinstance(pb, Partial):
        req[bp], pb = R, R
    if isinstance(pa, Partial) or isinstance(pb, Partial):
        if biasp is None and not (isinstance(pa, Shard) or isinstance(pb, Shard)):
            return Decision(req, P)
        req.update({path: R for path, p in ((ap, pa), (bp, pb)) if isinstance(p, Partial)})
        pa = R if isinstance(pa, Partial) else pa
        pb = R if isinstance(pb, Partial) else pb
    a_batch = isinstance(pa, Shard) and pa.dim < na - 2
    b_batch = isinstance(pb, Shard) and pb.dim < nb - 2
    if isinstance(pb, Shard) and pb.dim == b_k:  # contraction sharded: a must shard its k too
        req[ap] = Shard(na - 1, pb.chunks)
        if biasp is not None:
            return _gather_all(node, ctx, "a bias added to a partial product")
        return Decision(req, P)
    if isinstance(pa, Shard) and pa.dim == na - 1:  # a's k sharded, b replicated: slice b's k
        if biasp is not None:
            return _gather_all(node, ctx, "a bias added to a partial product")
        req[bp] = Shard(b_k, pa.chunks)
        return Decision(req, P)
    if isinstance(pb, Shard) and pb.dim == b_n:  # column parallel: a whole, output's last dim sharded
        if isinstance(pa, Shard):
            req[ap] = R
        if biasp is not None:  # a bias broadcast over the columns (size 1 there) stays whole, else its columns
            bias = node.args[biasp[0]]  # are sliced like the output's (baddbmm's ALiBi bias over key positions)
            req[biasp] = R if _shape(bias)[-1] == 1 else Shard(_ndim(bias) - 1, pb.chunks)
        rewrite = None
        if has_whole(pb.chunks):  # multi-query k and v held whole beside q's shard: one matmul per run of blocks
            rewrite = lambda nd: split_whole_matmul(nd, ctx.placements, ctx.n, bp, b_n, biasp)  # noqa: E731
        return Decision(req, Shard(nout - 1, pb.chunks), rewrite=rewrite)
    if a_batch and (b_batch or nb == 2 or isinstance(pb, Replicate)):  # batch dims: b's sliced alike (unless broadcast)
        b_dim = pa.dim - na + nb
        if b_batch and pb.dim - nb != pa.dim - na:
            req[bp] = R
        elif nb > 2 and not b_batch and b_dim >= 0 and _shape(b)[b_dim] != 1:
            req[bp] = Shard(b_dim, pa.chunks)
        return _with_bias(node, ctx, req, Shard(pa.dim + nout - na, pa.chunks), biasp)
    if isinstance(pa, Shard) and pa.dim == na - 2:  # a's rows sharded: output rows sharded
        if isinstance(pb, Shard):
            req[bp] = R
        return _with_bias(node, ctx, req, Shard(nout - 2, pa.chunks), biasp)
    if b_batch and na > 2:
        req[ap] = Shard(pb.dim - nb + na, pb.chunks)
        return _with_bias(node, ctx, req, Shard(pb.dim - nb + nout, pb.chunks), biasp)
    if isinstance(pa, Shard) or isinstance(pb, Shard):
        return _gather_all(node, ctx, "operands sharded on dims that do not combine")
    return Decision(req, R)


def _ndim_of(node: fx.Node, path: tuple) -> int:
    return _ndim(node.args[path[0]]) if isinstance(path[0], int) else _ndim(node.kwargs[path[0]])


def _with_bias(node, ctx, req, out: Shard, biasp) -> Decision:
    if biasp is not None:
        bias = node.args[biasp[0]]
        offset = _ndim(node) - _ndim(bias)
        d = out.dim - offset
        if d >= 0 and _shape(bias)[d] != 1:
            req[biasp] = Shard(d, out.chunks)
    return Decision(req, out)


def _gather_all(node: fx.Node, ctx: RuleCtx, why: str) -> Decision:
    return Decision({path: R for path, _ in tensor_args(node)}, _like(node, R), note=f"{op_name(node.target)}: {why}")


def grouped_mm_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """rows (S, K) through each row's expert of weight (E, K, N) (ir/fx_ops.GROUPED_MM; found by name, so not in
    COMPUTE_RULES): experts split like linear layers (Megatron inside every expert). N sharded -> output's last
    dim sharded (column-parallel); K sharded on both -> partial sum (row-parallel); rows and offsets stay whole."""
    rows, weight, offsets, bias = grouped_mm_args(node)
    if offsets is None or bias is not None or len(node.args) < 3:  # batched form, or a bias: no rule of its own
        return no_rule(node, ctx)
    pr, pw = ctx.pl(rows), ctx.pl(weight)
    req: dict[tuple, Placement] = {(2,): R} if not isinstance(ctx.pl(offsets), Replicate) else {}
    if isinstance(pr, Partial) or isinstance(pw, Partial) or (isinstance(pr, Shard) and pr.dim == 0):
        return _gather_all(node, ctx, "a partial or row-sharded operand of a grouped matmul")
    if isinstance(pw, Shard) and pw.dim == 2:  # column-parallel experts
        if isinstance(pr, Shard):
            req[(0,)] = R
        return Decision(req, Shard(1, pw.chunks))
    if isinstance(pw, Shard) and pw.dim == 1:  # row-parallel experts: the rows' features sharded alike
        req[(0,)] = Shard(1, pw.chunks)
        return Decision(req, P)
    if isinstance(pr, Shard) and pr.dim == 1 and not isinstance(pw, Shard):  # slice each expert's K locally
        req[(1,)] = Shard(1, pr.chunks)
        return Decision(req, P)
    if isinstance(pw, Shard):  # the expert dim: experts belong to ep, not tp
        return _gather_all(node, ctx, "a grouped matmul's weight sharded on its expert dim")
    return Decision(req, R)


@handles(dispatch, combine)
def exchange_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """Expert parallelism's dispatch/combine move whole rows between ranks: linear in the rows, so a feature-
    sharded or partial rows tensor crosses as it is (each tp rank exchanges its part); counts stay whole."""
    rows = node.args[0]
    p = ctx.pl(rows)
    req: dict[tuple, Placement] = {path: R for path, t in tensor_args(node)
                                   if t is not rows and not isinstance(ctx.pl(t), Replicate)}
    if isinstance(p, Shard) and p.dim == 0:
        req[(0,)], p = R, R
    return Decision(req, (p, R, R) if node.target is dispatch else p)


# ---------------------------------------------------------------------------------------- reductions
def _dims(node: fx.Node, ndim: int) -> list[int]:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None:
        return list(range(ndim))
    dims = [dims] if isinstance(dims, int) else dims
    return [d % ndim for d in dims] or list(range(ndim))


def _keepdim(node: fx.Node) -> bool:
    i = 3 if node.target in (aten.var.dim, aten.std.dim) else 2  # (self, dim, unbiased, keepdim)
    return bool(node.args[i] if len(node.args) > i else node.kwargs.get("keepdim", False))


@handles(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.amax.default,
         aten.amin.default, aten.var.correction, aten.std.correction, aten.var.dim, aten.std.dim,
         aten.argmax.default, aten.any.dim,
         aten.all.dim, aten.max.dim, aten.min.dim)
def reduction_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    x = node.args[0]
    p = ctx.pl(x)
    ndim = _ndim(x)
    dims = _dims(node, ndim) if node.target not in (aten.sum.default, aten.mean.default) else list(range(ndim))
    out = _like(node, R)
    if isinstance(p, Partial):
        if node.target in (aten.sum.dim_IntList, aten.sum.default):
            return Decision({}, P)
        return Decision({(0,): R}, out)
    if not isinstance(p, Shard):
        return Decision({}, out)
    if p.dim in dims:
        if node.target in (aten.sum.dim_IntList, aten.sum.default) and p.chunks == 1:
            return Decision({}, P)
        if node.target == aten.mean.dim and p.chunks == 1:  # a statistic over the shards (a norm of a whole
            return Decision({}, P, rewrite=lambda nd: _partial_mean(nd, ctx))  # projection): summands of the mean
        return Decision({(0,): R}, out, note=f"{op_name(node.target)} over the sharded dim {p.dim}")
    shifted = p.dim if _keepdim(node) else p.dim - sum(1 for d in dims if d < p.dim)
    s = Shard(shifted, p.chunks)
    return Decision({}, tuple(s for _ in out) if isinstance(out, tuple) else s)


def _partial_mean(node: fx.Node, ctx: RuleCtx) -> None:
    """The local mean over an evenly sharded dim, divided by the axis size: summed over the ranks (the all-reduce
    its first consumer that is not linear in it asks for), the mean of the whole dim."""
    graph = node.graph
    with graph.inserting_after(node):
        scaled = graph.call_function(aten.div.Tensor, (node, ctx.n))
    node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
    scaled.meta.update({k: v for k, v in node.meta.items() if k in ("val", "meshc.shape", "nn_module_stack")})
    scaled.meta["meshc.why"] = f"tp: the mean over a dim sharded over {ctx.axis}: each rank's share of it"
    ctx.placements[scaled] = P


@handles(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
         aten.cumsum.default)
def softmax_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    x = node.args[0]
    p = ctx.pl(x)
    dim = node.args[1] % _ndim(x)
    if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim == dim):
        note = f"{op_name(node.target)} along the sharded dim" if isinstance(p, Shard) else None
        return Decision({(0,): R}, R, note=note)
    return Decision({}, p)


@handles(aten.tril.default, aten.triu.default)
def triangle_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """tril/triu act on each matrix of the last two dims: a shard of a leading (batch, head) dim stays, a partial sum
    stays partial (they are linear); a shard of the matrix dims is gathered."""
    x = node.args[0]
    p = ctx.pl(x)
    if isinstance(p, Shard) and p.dim >= _ndim(x) - 2:
        return Decision({(0,): R}, R, note=f"{op_name(node.target)} of the sharded dim {p.dim}: a matrix dim")
    return Decision({}, p)


@handles(aten.copy_.default)
def copy_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """dst.copy_(src) (`out[:, :, i] = chunk`: a write into a view of a preallocated tensor): dst keeps its
    placement, src is brought to it (a shard sliced, a gather), so the write lands in dst's own storage and the
    tensor it views sees it. A partial dst is left to no_rule (each rank would write the whole value)."""
    dst, src = node.args[0], node.args[1]
    p = ctx.pl(dst)
    if isinstance(p, Partial) or (isinstance(p, Shard) and has_whole(p.chunks)):
        return no_rule(node, ctx)
    if not isinstance(src, fx.Node):
        return Decision({}, p)
    q = ctx.pl(src)
    if isinstance(p, Shard):  # src broadcast over dst: its dims align from the right
        d = p.dim - (_ndim(dst) - _ndim(src))
        want = Shard(d, p.chunks) if d >= 0 and _shape(src)[d] != 1 else R
    else:
        want = R
    return Decision({} if q == want else {(1,): want}, p)


@handles(aten.layer_norm.default, aten.rms_norm.default)
def norm_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    x = node.args[0]
    p = ctx.pl(x)
    ndim = _ndim(x)
    normalized = len(node.args[1])
    req = {path: R for path, t in tensor_args(node)[1:] if not isinstance(ctx.pl(t), Replicate)}
    seq = ctx.sp_dim(node)
    if isinstance(p, Partial) or (isinstance(p, Replicate) and seq):  # SP: norms on sequence shards
        target = _reduced(node, ctx)
        req[(0,)] = target
        return Decision(req, target)
    if isinstance(p, Shard) and p.dim >= ndim - normalized:
        req[(0,)] = R
        return Decision(req, R, note=f"{op_name(node.target)} over the sharded dim {p.dim}")
    return Decision(req, p)


# ---------------------------------------------------------------------------------------- attention
@handles(aten.scaled_dot_product_attention.default, context_attention)
def sdpa_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """q, k, v (B, H, T, D) sharded by heads (or batch) together; a mask broadcasting there stays whole, and
    so does a k or v of one head that SDPA broadcasts to every head of q (multi-query attention).
    Context parallelism's attention (q, k, v, mask: the same arguments) shards its heads the same way."""
    qkv = [((i,), node.args[i]) for i in range(3)]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    mask_path = (3,) if len(node.args) > 3 else ("attn_mask",)
    shards = [ctx.pl(t) for _, t in qkv if isinstance(ctx.pl(t), Shard)]
    head = next((s for s in shards if s.dim in (0, 1)), None)
    req: dict[tuple, Placement] = {}
    if head is None or any(isinstance(ctx.pl(t), Partial) for _, t in qkv):
        req = {path: R for path, t in qkv if not isinstance(ctx.pl(t), Replicate)}
        if isinstance(mask, fx.Node) and not isinstance(ctx.pl(mask), Replicate):
            req[mask_path] = R
        return Decision(req, R, note="attention sharded on a dim other than batch or heads" if shards else None)
    for path, t in qkv:
        if head.dim == 1 and _shape(t)[1] == 1 < _shape(node)[1]:  # one kv head broadcast to all (multi-query)
            want = R
        else:
            want = head
        if ctx.pl(t) != want:
            req[path] = want
    if isinstance(mask, fx.Node):
        offset = 4 - _ndim(mask)
        d = head.dim - offset
        want = R if d < 0 or _shape(mask)[d] == 1 else Shard(d, head.chunks)
        if ctx.pl(mask) != want:
            req[mask_path] = want
    if node.target is context_attention:  # its records (context pass) counted every head: this rank sends 1/n
        return Decision(req, head, rewrite=lambda nd: _records_over(nd, ctx.n))
    return Decision(req, head)


def _records_over(node: fx.Node, n: int) -> None:
    node.meta["meshc.comm"] = [dataclasses.replace(r, bytes=r.bytes // n) for r in node.meta.get("meshc.comm", ())]


COMPUTE_RULES = (same_as_input_rule, assert_rule, factory_rule, new_factory_rule, matmul_rule, reduction_rule,
                 softmax_rule, triangle_rule, copy_rule, norm_rule, sdpa_rule, exchange_rule) + SCAN_RULES
