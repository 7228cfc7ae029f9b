"""Placement rules for the ops a state-space mixer (Mamba-2's) is written with, beside a column-parallel projection
sharded by heads: the depthwise causal conv1d over its channels, the chunked scan's einsums, pads, tensor_splits
and repeat_interleave of a group's B/C to its heads. Same contract as tp_rules' rules.

    conv1d(x (B, C, L) S(1), w (C, 1, k) S(0), b S(0), groups=C)  ->  S(1), groups = C / tp
    einsum("bclhn,bcshn->bclsh", C S(3), B S(3))                 ->  S(4) (h kept); a contracted h -> P
    repeat_interleave(B (b, t, 1, n) R, H, dim=2)                ->  S(2): this rank's H / tp heads of the one group
"""
from __future__ import annotations

import torch
import torch.fx as fx

from meshc.compiler.ir.fx_ops import op_name, tensor_args
from meshc.compiler.ir.placement import P, Partial, Placement, R, Replicate, Shard, has_whole, local_length

from meshc.passes.rules.decision import Decision, RuleCtx, handles

aten = torch.ops.aten


def _shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(int(s) for s in node.meta["meshc.shape"])


def _whole(node: fx.Node, ctx: RuleCtx, why: str) -> Decision:
    """Every tensor input replicated (nothing sharded to keep), with a note when one was not."""
    req = {path: R for path, t in tensor_args(node) if not isinstance(ctx.pl(t), Replicate)}
    shape = node.meta.get("meshc.shape")
    out = tuple(R for _ in shape) if shape and isinstance(shape[0], tuple) else R
    return Decision(req, out, note=f"{op_name(node.target)}: {why}" if req else None)


@handles(aten.conv1d.default)
def conv1d_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """A depthwise conv1d (groups == channels, one filter each: Mamba's causal conv over x|B|C) keeps a shard of its
    channels: the weight (C, 1, k) and the bias (C,) are sharded alike (blocks held whole included) and `groups`
    becomes the local channel count. A shard of the batch keeps the filters whole; anything else is replicated."""
    x, w = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 and isinstance(node.args[2], fx.Node) else None
    groups = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
    cdim = len(_shape(x)) - 2  # (B, C, L), or (C, L) unbatched
    channels = _shape(x)[cdim]
    px, pw = ctx.pl(x), ctx.pl(w)
    depthwise = groups == channels == _shape(w)[0] and _shape(w)[1] == 1
    if depthwise and (isinstance(px, Shard) and px.dim == cdim or
                      isinstance(px, Replicate) and isinstance(pw, Shard) and pw.dim == 0):
        chunks = px.chunks if isinstance(px, Shard) else pw.chunks
        want = {(0,): Shard(cdim, chunks), (1,): Shard(0, chunks)}
        if bias is not None:
            want[(2,)] = Shard(0, chunks)
        req = {path: p for path, p in want.items() if ctx.pl(node.args[path[0]]) != p}
        local = local_length(Shard(cdim, chunks), channels, ctx.n)

        def rewrite(nd: fx.Node) -> None:
            if len(nd.args) > 6:
                nd.update_arg(6, local)
            else:
                nd.update_kwarg("groups", local)
        return Decision(req, Shard(cdim, chunks), rewrite=rewrite)
    if isinstance(px, Shard) and px.dim == 0 and cdim == 1:  # the batch: every rank convolves its own samples
        req = {path: R for path, t in tensor_args(node)[1:] if not isinstance(ctx.pl(t), Replicate)}
        return Decision(req, px)
    return _whole(node, ctx, "a conv1d sharded on its length or a dense conv1d on its channels")


@handles(aten.einsum.default)
def einsum_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """einsum over operands sharded on one index letter (the heads of a chunked scan): every operand holding that
    letter is sharded on it (a replicated one sliced), the others stay whole; the output keeps the shard where the
    letter survives, else holds a partial sum (a contraction over the shard)."""
    eq = node.args[0].replace(" ", "")
    ops = list(node.args[1])
    pls = [ctx.pl(t) for t in ops]
    if all(isinstance(p, Replicate) for p in pls):
        return Decision({}, R)
    if "->" not in eq or "." in eq or any(isinstance(p, Partial) for p in pls):
        return _whole(node, ctx, "an implicit output, an ellipsis or a partial operand")
    ins, out = eq.split("->")
    specs = ins.split(",")
    sharded = [(specs[i][p.dim], p.chunks) for i, p in enumerate(pls) if isinstance(p, Shard)]
    if len(set(sharded)) != 1 or has_whole(sharded[0][1]):
        return _whole(node, ctx, "operands sharded on different letters")
    letter, chunks = sharded[0]
    req: dict[tuple, Placement] = {}
    for i, (spec, t) in enumerate(zip(specs, ops)):
        if spec.count(letter) > 1 or (letter in spec and _shape(t)[spec.index(letter)] == 1):
            return _whole(node, ctx, f"the sharded letter {letter} repeated or broadcast")
        want = Shard(spec.index(letter), chunks) if letter in spec else R
        if pls[i] != want:
            req[(1, i)] = want
    return Decision(req, Shard(out.index(letter), chunks) if letter in out else P)


@handles(aten.pad.default, aten.constant_pad_nd.default)
def pad_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """A pad that leaves the sharded dim alone keeps the shard (the scan pads its sequence to whole chunks); a zero
    constant pad of a partial sum stays partial."""
    x, pads = node.args[0], list(node.args[1])
    p = ctx.pl(x)
    ndim = len(_shape(x))
    if isinstance(p, Shard):
        k = ndim - 1 - p.dim  # pads run from the last dim backwards, (before, after) each
        if any(pads[2 * k:2 * k + 2]):
            return _whole(node, ctx, f"a pad of the sharded dim {p.dim}")
        return Decision({}, p)
    if isinstance(p, Partial):
        mode = node.args[2] if node.target == aten.pad.default and len(node.args) > 2 else "constant"
        value = node.args[3] if len(node.args) > 3 else (node.args[2] if node.target != aten.pad.default
                                                         and len(node.args) > 2 else 0)
        if mode == "constant" and not value:
            return Decision({}, P)
        return Decision({(0,): R}, R)
    return Decision({}, p)


@handles(aten.tensor_split.indices, aten.tensor_split.sections)
def tensor_split_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """tensor_split along a dim other than the sharded one: every part keeps the shard (and a partial sum stays
    one); along it, replicated."""
    x = node.args[0]
    p = ctx.pl(x)
    parts = len(node.meta["meshc.shape"])
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % len(_shape(x))
    if isinstance(p, Shard) and p.dim == dim:
        return _whole(node, ctx, "a tensor_split of the sharded dim")
    return Decision({}, tuple(p for _ in range(parts)))


@handles(aten.repeat_interleave.self_int)
def repeat_interleave_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """x repeated along `dim` (a group's B or C to each of its heads: Mamba-2's n_groups -> heads). Groups sharded
    there: each rank repeats its own, for its own heads. One group, replicated (n_groups = 1 held whole by every rank):
    each rank repeats it for its own H / tp heads only, so the scan stays sharded by heads (its gradient is a
    partial sum over the ranks' heads: the tensor_parallel pass routes the input through Megatron's f); one group on
    sequence shards (sequence parallelism) is gathered first, a small (b, t, 1, n) tensor, not the scan's einsums."""
    x = node.args[0]
    p = ctx.pl(x)
    repeats = node.args[1]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if dim is None:
        return _whole(node, ctx, "a repeat_interleave of the flattened tensor")
    dim %= len(_shape(x))
    size, n = _shape(node)[dim], ctx.n
    if isinstance(p, Partial):
        return Decision({}, P)
    broadcast = _shape(x)[dim] == 1 and size % n == 0 and isinstance(repeats, int) and _floating(node)
    if broadcast and isinstance(p, Shard) and p == ctx.sp_dim(node):  # sequence parallel put B on sequence shards:
        return Decision({(0,): R}, Shard(dim), rewrite=lambda nd: _local_repeat(nd, repeats // n, size // n))  # heads
    if isinstance(p, Shard) and p.dim != dim:
        return Decision({}, p)
    if isinstance(p, Shard) and p.chunks == 1 and size % n == 0:
        return Decision({}, p, rewrite=lambda nd: _local_repeat(nd, None, size // n))
    if isinstance(p, Replicate) and broadcast:
        return Decision({}, Shard(dim), rewrite=lambda nd: _local_repeat(nd, repeats // n, size // n))
    if isinstance(p, Replicate):
        return Decision({}, R)
    return _whole(node, ctx, "a repeat_interleave of the sharded dim in blocks")


def _floating(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _local_repeat(node: fx.Node, repeats: int | None, size: int) -> None:
    if repeats is not None:
        node.update_arg(1, repeats)
    if "output_size" in node.kwargs:
        node.update_kwarg("output_size", size)
    elif len(node.args) > 3:
        node.update_arg(3, size)


SCAN_RULES = (conv1d_rule, einsum_rule, pad_rule, tensor_split_rule, repeat_interleave_rule)
