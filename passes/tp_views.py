"""Placement rules for view-like ops on one mesh axis: where a shard goes when dims are split, merged,
moved, sliced or concatenated, and the local size arguments each rewritten op needs.

A rule returns a Decision (see tp_rules): the placement each tensor input must have, the output
placement, and a rewrite of the node's size arguments for local shapes. When a shard cannot follow a
view (it would straddle dims), the input is replicated first: always correct, never silently wrong.
VIEW_RULES lists this file's rules for tp_table.
"""
from __future__ import annotations

import itertools
import math
import operator

import torch
import torch.fx as fx

from meshc.compiler.ir.placement import (Partial, R, Replicate, Shard, Whole, as_chunks, block_sizes, blocks_placement,
                                         has_whole, local_blocks, local_shape)
from meshc.compiler.ir.sizes import static_sizes

from meshc.passes.tp_rules import Decision, RuleCtx, handles

aten = torch.ops.aten


def view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair dims of two shapes of equal numel into groups whose sizes multiply to the same product."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj, pi, pj = [], [], 1, 1
        if i < len(src):
            gi.append(i)
            pi = src[i]
            i += 1
        if j < len(dst):
            gj.append(j)
            pj = dst[j]
            j += 1
        while pi != pj:
            if (pi < pj and i < len(src)) or j >= len(dst):
                gi.append(i)
                pi *= src[i]
                i += 1
            else:
                gj.append(j)
                pj *= dst[j]
                j += 1
        groups.append((gi, gj))
    return groups


def shard_through_view(src: tuple[int, ...], dst: tuple[int, ...], shard: Shard, n: int) -> Shard | None:
    """Where S(d, chunks) of `src` lands in `dst` after a view, or None if it straddles dims.

    Within the group of dims holding the shard, the flattened group is (A blocks) x (n ranks) x (L
    elements): a rank holds L contiguous elements of each block. An output dim o of the group carries the
    shard iff the elements after o number exactly L / (o's local size per block), i.e. the pattern is
    expressible as S(o, chunks=A / (elements before o)).
    """
    for gi, gj in view_groups(src, dst):
        if shard.dim not in gi:
            continue
        if isinstance(shard.chunks, tuple):  # unequal blocks follow a view that keeps their dim or splits it
            return _blocks_through_split(shard, gi, gj, dst, n)
        k = gi.index(shard.dim)
        outer = math.prod(src[d] for d in gi[:k])
        inner = math.prod(src[d] for d in gi[k + 1:])
        blocks = outer * shard.chunks
        per_rank = src[shard.dim] // shard.chunks // n * inner
        for m, o in enumerate(gj):
            before = math.prod(dst[d] for d in gj[:m])
            after = math.prod(dst[d] for d in gj[m + 1:])
            if blocks % before or per_rank % after:
                continue
            chunks = blocks // before
            if dst[o] == chunks * n * (per_rank // after):
                return Shard(o, chunks)
        return None
    return None


def _blocks_through_split(shard: Shard, gi: list[int], gj: list[int], dst: tuple[int, ...], n: int) -> Shard | None:
    """Unequal blocks of one dim viewed as (positions, rest...) (q|k|v rows as heads x head dim): the shard
    lands on the first dim of the group, each block a whole number of positions that splits over n (a Whole
    block need not split)."""
    if len(gi) != 1:
        return None
    inner = math.prod(dst[d] for d in gj[1:])
    if any(b % inner or (not isinstance(b, Whole) and (b // inner) % n) for b in shard.chunks):
        return None
    return Shard(gj[0], tuple(Whole(b // inner) if isinstance(b, Whole) else b // inner for b in shard.chunks))


def _local(shape, placement, n) -> list[int]:
    return list(local_shape([int(s) for s in shape], placement, n))


def _ints(node: fx.Node) -> tuple[int, ...]:
    return static_sizes(node)


@handles(aten.view.default, aten.reshape.default, aten._unsafe_view.default)
def view_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    x = node.args[0]
    p = ctx.pl(x)
    src, dst = _ints(x), _ints(node)
    if isinstance(p, Shard):
        out = shard_through_view(src, dst, p, ctx.n)
        if out is None:
            whole = shard_through_view(src, dst, p, 1)
            bad = None
            if whole is not None:  # the parts each rank would hold a share of: the dim, or each of its blocks
                size = dst[whole.dim]
                parts = [b for b in block_sizes(whole.chunks, size) if not isinstance(b, Whole)]
                part = next((b for b in parts if b % ctx.n), size)
                within = f" in {len(parts)} blocks of {part}" if len(parts) > 1 else ""
                bad = (f"the view to {dst} splits the sharded dim into dim {whole.dim} of size {size} (e.g. heads)"
                       f"{within}, not divisible by tp", part)
            return Decision({(0,): R}, R, note=f"shard {p} of {src} cannot follow the view to {dst}",
                            indivisible=bad)
    else:
        out = p
    return Decision({}, out, rewrite=lambda nd, o=out: nd.update_arg(1, _local(dst, o, ctx.n)))


@handles(aten.unflatten.int)
def unflatten_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """unflatten(dim, sizes) (nn.MultiheadAttention's packed q|k|v projection as (..., 3, embed)): a view to the
    output's shape, made a reshape to the local one (its sizes argument is global)."""
    x = node.args[0]
    p = ctx.pl(x)
    src, dst = _ints(x), _ints(node)
    out = shard_through_view(src, dst, p, ctx.n) if isinstance(p, Shard) else p
    if out is None:
        return Decision({(0,): R}, R, note=f"shard {p} of {src} cannot follow the unflatten to {dst}")

    def rewrite(nd: fx.Node, o=out) -> None:
        nd.target = aten.reshape.default
        nd.args = (nd.args[0], _local(dst, o, ctx.n))
    return Decision({}, out, rewrite=rewrite)


@handles(aten.flatten.using_ints)
def flatten_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """flatten(start, end): a view whose arguments are dims, not sizes (nothing to make local)."""
    x = node.args[0]
    p = ctx.pl(x)
    if not isinstance(p, Shard):
        return Decision({}, p)
    src, dst = _ints(x), _ints(node)
    out = shard_through_view(src, dst, p, ctx.n)
    if out is None:
        return Decision({(0,): R}, R, note=f"shard {p} of {src} cannot follow the flatten to {dst}")
    return Decision({}, out)


@handles(aten.expand.default, aten.broadcast_to.default)
def expand_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    x = node.args[0]
    p = ctx.pl(x)
    dst = _ints(node)
    out = p
    if isinstance(p, Shard):
        out = Shard(p.dim + len(dst) - len(_ints(x)), p.chunks)
    return Decision({}, out, rewrite=lambda nd: nd.update_arg(1, _local(dst, out, ctx.n)))


@handles(aten.repeat.default)
def repeat_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """x.repeat(r0, r1, ...): the local tensor repeated alike holds each copy's share, so a shard follows (moved past
    the leading dims repeat adds); repeated along the sharded dim, the copies are its blocks (JetMoE's k and v repeated
    per routed head: Shard(heads, chunks=copies)); a partial sum stays one."""
    x, repeats = node.args[0], list(node.args[1])
    p = ctx.pl(x)
    if not isinstance(p, Shard):
        return Decision({}, p)
    dim = p.dim + len(repeats) - len(_ints(x))
    copies = repeats[dim]
    if copies == 1:
        return Decision({}, Shard(dim, p.chunks))
    return Decision({}, Shard(dim, as_chunks(block_sizes(p.chunks, _ints(x)[p.dim]) * copies)))


_AS = {aten.view_as.default: aten.view.default, aten.reshape_as.default: aten.reshape.default,
       aten.expand_as.default: aten.expand.default}


@handles(*_AS)
def as_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """x.view_as(y), x.reshape_as(y), x.expand_as(y): decided as the view (expand) to y's shape, and made one to the
    local shape, y then no longer read (its own placement may differ from the output's)."""
    dec = (expand_rule if node.target is aten.expand_as.default else view_rule)(node, ctx)
    dst = _ints(node)

    def rewrite(nd: fx.Node, o=dec.out) -> None:
        nd.target = _AS[nd.target]
        nd.args = (nd.args[0], _local(dst, o, ctx.n))
    return Decision(dec.inputs, dec.out, rewrite=rewrite, note=dec.note, indivisible=dec.indivisible)


@handles(aten.transpose.int)
def transpose_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    p = ctx.pl(node.args[0])
    if not isinstance(p, Shard):
        return Decision({}, p)
    ndim = len(_ints(node))
    a, b = (d % ndim for d in node.args[1:3])
    dim = b if p.dim == a else a if p.dim == b else p.dim
    return Decision({}, Shard(dim, p.chunks))


@handles(aten.t.default, aten.numpy_T.default, aten.mT.default, aten.adjoint.default)
def t_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """t and numpy_T (`weight.T`) reverse the dims; mT and adjoint swap the last two."""
    p = ctx.pl(node.args[0])
    if not isinstance(p, Shard):
        return Decision({}, p)
    ndim = len(_ints(node))
    if node.target in (aten.mT.default, aten.adjoint.default):
        dim = {ndim - 1: ndim - 2, ndim - 2: ndim - 1}.get(p.dim, p.dim)
    else:
        dim = ndim - 1 - p.dim
    return Decision({}, Shard(dim, p.chunks))


@handles(aten.permute.default)
def permute_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    p = ctx.pl(node.args[0])
    if not isinstance(p, Shard):
        return Decision({}, p)
    dims = [d % len(node.args[1]) for d in node.args[1]]
    return Decision({}, Shard(dims.index(p.dim), p.chunks))


@handles(aten.unsqueeze.default)
def unsqueeze_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    p = ctx.pl(node.args[0])
    if not isinstance(p, Shard):
        return Decision({}, p)
    d = node.args[1] % len(_ints(node))
    return Decision({}, Shard(p.dim + (1 if d <= p.dim else 0), p.chunks))


@handles(aten.view_as_complex.default)
def view_as_complex_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """(..., n, 2) real -> (..., n) complex (complex rotary embeddings): a shard of any dim but the pair's stays on
    that dim (a shard of n keeps whole pairs: n is the pairs' count); a shard of the pair dim is gathered."""
    x = node.args[0]
    p = ctx.pl(x)
    if not isinstance(p, Shard):
        return Decision({}, p)
    if p.dim == len(_ints(x)) - 1:
        return Decision({(0,): R}, R, note="view_as_complex of a value sharded on its (real, imaginary) pair: gathered")
    return Decision({}, Shard(p.dim, p.chunks))


@handles(aten.view_as_real.default)
def view_as_real_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """(...) complex -> (..., 2) real: every shard stays on its dim (the new last dim holds each number's pair)."""
    p = ctx.pl(node.args[0])
    return Decision({}, Shard(p.dim, p.chunks) if isinstance(p, Shard) else p)


@handles(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    x = node.args[0]
    p = ctx.pl(x)
    if not isinstance(p, Shard):
        return Decision({}, p)
    src = _ints(x)
    dims = node.args[1] if len(node.args) > 1 else [d for d, s in enumerate(src) if s == 1]
    dims = [dims] if isinstance(dims, int) else dims
    removed = {d % len(src) for d in dims if src[d % len(src)] == 1}
    return Decision({}, Shard(p.dim - sum(1 for d in removed if d < p.dim), p.chunks))


@handles(aten.slice.Tensor)
def slice_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    x = node.args[0]
    p = ctx.pl(x)
    src = _ints(x)
    dim = (node.args[1] if len(node.args) > 1 else 0) % len(src)
    if not isinstance(p, Shard) or p.dim != dim:
        return Decision({}, p)
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    start, end = _bound(start, src[dim], 0), _bound(end, src[dim], src[dim])
    if start == 0 and end == src[dim] and step == 1:
        return Decision({}, p)
    blocks = block_sizes(p.chunks, src[dim])
    edges = [0, *itertools.accumulate(int(b) for b in blocks)]
    if step == 1 and start in edges and end in edges and start < end:  # q = qkv[..., :q_size]: whole blocks
        i, j = edges.index(start), edges.index(end)
        held = blocks[i:j]
        local = [0, *itertools.accumulate(local_blocks(p.chunks, src[dim], ctx.n))]

        def rewrite(nd: fx.Node) -> None:
            nd.update_arg(2, local[i])
            if len(nd.args) > 3:
                nd.update_arg(3, local[j])
        return Decision({}, blocks_placement(dim, held), rewrite=rewrite)  # k of multi-query: R
    strided = _strided(p, src[dim], start, end, step, ctx.n)
    if strided is not None:
        return strided
    return Decision({(0,): R}, R, note=f"slice of the sharded dim {dim}")


def _strided(p: Shard, size: int, start: int, end: int, step: int, n: int) -> Decision | None:
    """x[..., start::step] over a sharded dim whose every local block is a whole number of steps (GPT-OSS's
    interleaved gate/up, `gate_up[..., ::2]` and `[..., 1::2]`): each rank's block begins at a multiple of the step,
    so the same slice of the local tensor keeps exactly its share of the picked positions, in order; the output is
    sharded alike, in blocks a step smaller."""
    if step <= 1 or not 0 <= start < step or end != size or has_whole(p.chunks):
        return None
    blocks = [int(b) for b in block_sizes(p.chunks, size)]
    if any(b % (step * n) for b in blocks):
        return None
    return Decision({}, Shard(p.dim, as_chunks([b // step for b in blocks])))


def _bound(i, size: int, default: int) -> int:
    """A slice bound as Python reads it: None -> default, negative from the end, clamped to [0, size]."""
    if i is None:
        return default
    return min(max(i + size if i < 0 else i, 0), size)


@handles(aten.select.int)
def select_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    p = ctx.pl(node.args[0])
    dim = node.args[1] % len(_ints(node.args[0]))
    if not isinstance(p, Shard):
        return Decision({}, p)
    if p.dim == dim:
        return Decision({(0,): R}, R, note=f"select on the sharded dim {dim}")
    return Decision({}, Shard(p.dim - (1 if dim < p.dim else 0), p.chunks))


@handles(aten.split.Tensor, aten.split_with_sizes.default)
def split_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    cut = _cut_blocks(node, ctx, "split")
    if isinstance(cut, Decision):
        return cut
    dim, parts, groups = cut
    if has_whole(ctx.pl(node.args[0]).chunks):
        return _split_with_whole(dim, groups, ctx.n)

    def rewrite(nd: fx.Node) -> None:
        if nd.target == aten.split.Tensor:
            nd.update_arg(1, node.args[1] // ctx.n)
        else:
            nd.update_arg(1, [s // ctx.n for s in parts])
    return Decision({}, tuple(Shard(dim, as_chunks(g)) for g in groups), rewrite=rewrite)


def _cut_blocks(node: fx.Node, ctx: RuleCtx, what: str, equal: bool = False):
    """split/chunk of `node.args[0]` along its dim arg: (dim, part sizes, the blocks each part holds) when the
    cut dim is sharded in blocks and every part is whole blocks (all parts equal, with `equal`); otherwise
    the Decision itself (parts keep the input's placement off the sharded dim, else are replicated)."""
    x = node.args[0]
    p = ctx.pl(x)
    src = _ints(x)
    dim = (node.args[2] if len(node.args) > 2 else 0) % len(src)
    shapes = node.meta["meshc.shape"]
    if not isinstance(p, Shard) or p.dim != dim:
        return Decision({}, tuple(p for _ in shapes))
    try:
        parts = [int(s[dim]) for s in shapes]
    except TypeError:  # sympy's int() of a free symbol: sizes known only at run time (tokens per expert)
        return Decision({(0,): R}, tuple(R for _ in shapes), note=f"{what} of the sharded dim {dim} into sizes "
                                                                  "known only at run time")
    groups = _whole_blocks(block_sizes(p.chunks, src[dim]), parts)
    if groups is None or (equal and len(set(parts)) != 1):
        return Decision({(0,): R}, tuple(R for _ in parts), note=f"{what} across the blocks of a shard")
    return dim, parts, groups


def _whole_blocks(blocks: tuple[int, ...], parts: list[int]) -> list[tuple[int, ...]] | None:
    """The blocks each consecutive part of a dim holds, or None when a part cuts a block."""
    out, i = [], 0
    for size in parts:
        held = []
        while size > 0 and i < len(blocks) and blocks[i] <= size:
            held.append(blocks[i])
            size -= blocks[i]
            i += 1
        if size or not held:
            return None
        out.append(tuple(held))
    return out


@handles(aten.chunk.default)
def chunk_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """chunk(c, dim) of a fused projection (gate|up): each part is whole blocks, so the local tensor chunked
    the same way gives every part's local share (nothing to rewrite)."""
    cut = _cut_blocks(node, ctx, "chunk", equal=True)
    if isinstance(cut, Decision):
        return cut
    dim, _, groups = cut
    if has_whole(ctx.pl(node.args[0]).chunks):
        return _split_with_whole(dim, groups, ctx.n)
    return Decision({}, tuple(Shard(dim, as_chunks(g)) for g in groups))


def _split_with_whole(dim: int, groups: list[tuple[int, ...]], n: int) -> Decision:
    """split/chunk of blocks some of which every rank holds whole: the local parts differ in size (a part of
    Whole blocks keeps its size), so the node becomes split_with_sizes of the local sizes; a part of Whole blocks
    only is replicated."""
    sizes = [sum(local_blocks(g, sum(g), n)) for g in groups]

    def rewrite(nd: fx.Node) -> None:
        nd.target, nd.args = aten.split_with_sizes.default, (nd.args[0], sizes, dim)
    return Decision({}, tuple(blocks_placement(dim, g) for g in groups), rewrite=rewrite)


@handles(aten.unbind.int)
def unbind_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    x = node.args[0]
    p = ctx.pl(x)
    parts = len(node.meta["meshc.shape"])
    dim = (node.args[1] if len(node.args) > 1 else 0) % len(_ints(x))
    if not isinstance(p, Shard):
        return Decision({}, tuple(p for _ in range(parts)))
    if p.dim == dim:
        return Decision({(0,): R}, tuple(R for _ in range(parts)), note="unbind of the sharded dim")
    out = Shard(p.dim - (1 if dim < p.dim else 0), p.chunks)
    return Decision({}, tuple(out for _ in range(parts)))


@handles(aten.cat.default)
def cat_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    # torch.cat skips 1-D empty tensors of another rank (legacy behaviour: transformers' DynamicCache starts
    # from torch.tensor([]) and concatenates the first keys onto it); they add nothing and constrain no
    # placement, so the rule decides over the others and leaves them as they are
    ndim = len(_ints(node))
    kept = [i for i, t in enumerate(node.args[0]) if ndim == 1 or tuple(t.meta["meshc.shape"]) != (0,)]
    if not kept:
        return Decision({}, R)
    sub = _cat_rule([node.args[0][i] for i in kept], node.args[1] if len(node.args) > 1 else 0, ndim, ctx)
    return Decision({(0, kept[path[1]]): p for path, p in sub.inputs.items()}, sub.out, note=sub.note)


def _cat_rule(tensors: list, dim: int, ndim: int, ctx: RuleCtx) -> Decision:
    dim = dim % ndim
    pls = [ctx.pl(t) for t in tensors]
    if all(isinstance(p, Replicate) for p in pls):
        return Decision({}, R)
    if all(isinstance(p, Partial) for p in pls):
        return Decision({}, Partial())
    shards = [p for p in pls if isinstance(p, Shard)]
    if shards and all(isinstance(p, Shard) and p.dim == dim for p in pls):
        blocks = [b for t, p in zip(tensors, pls) for b in block_sizes(p.chunks, _ints(t)[dim])]
        return Decision({}, Shard(dim, as_chunks(blocks)))
    if shards and shards[0].dim != dim:
        target = shards[0]
        if all(not isinstance(p, Partial) for p in pls):
            return Decision({(0, i): target for i in range(len(tensors))}, target)
    return Decision({(0, i): R for i in range(len(tensors))}, R, note="cat of differently placed tensors")


@handles(aten.stack.default)
def stack_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """stack along a new dim (GPT-J's interleaved rotary: stack((-x2, x1), -1)): tensors sharded alike keep the
    shard, moved past the new dim; replicated ones are sliced to match; partial sums stack as partial sums."""
    tensors = list(node.args[0])
    ndim = len(_ints(node))
    dim = (node.args[1] if len(node.args) > 1 else 0) % ndim
    pls = [ctx.pl(t) for t in tensors]
    if all(isinstance(p, Replicate) for p in pls) or all(isinstance(p, Partial) for p in pls):
        return Decision({}, pls[0])
    shards = [p for p in pls if isinstance(p, Shard)]
    if any(isinstance(p, Partial) for p in pls) or len(set(shards)) > 1:
        return Decision({(0, i): R for i in range(len(tensors))}, R, note="stack of differently placed tensors")
    p = shards[0]
    req = {(0, i): p for i, q in enumerate(pls) if q != p}
    return Decision(req, Shard(p.dim + (1 if p.dim >= dim else 0), p.chunks))


@handles(aten.index.Tensor)
def index_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """x[..., idx, ...] with index tensors on dims other than the sharded one (Falcon's qkv[:, :, :, [-2]]): the
    shard follows. Index tensors on consecutive dims replace those dims with the index's dims (torch's advanced
    indexing); other layouts, or an index on the sharded dim, are replicated."""
    x, indices = node.args[0], list(node.args[1])
    p = ctx.pl(x)
    idx = [(d, t) for d, t in enumerate(indices) if t is not None]
    if any(not isinstance(ctx.pl(t), Replicate) for _, t in idx):
        return Decision({(0,): R, **{(1, d): R for d, _ in idx}}, R, note="index by a sharded index tensor")
    if not isinstance(p, Shard):
        return Decision({}, p)
    dims = [d for d, _ in idx]
    if p.dim in dims:
        return Decision({(0,): R}, R, note=f"index on the sharded dim {p.dim}")
    if dims != list(range(dims[0], dims[0] + len(dims))):
        return Decision({(0,): R}, R, note="index tensors on dims apart from each other")
    if p.dim < dims[0]:
        return Decision({}, p)
    added = len(_ints(node)) - len(_ints(x)) + len(dims)  # the index's broadcast dims
    return Decision({}, Shard(p.dim - len(dims) + added, p.chunks))


@handles(aten.index_add.default)
def index_add_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """index_add(x, dim, index, rows): rows added into x at `index` along `dim` (routed tokens summed back into
    their positions, JetMoE's experts). A shard off `dim` is kept: x and rows sharded alike (a replicated one
    sliced), the index whole; a shard on `dim`, or a partial sum, makes the op run on whole inputs."""
    x, dim, index, rows = node.args[:4]
    ndim = len(node.meta["meshc.shape"])
    pls = [ctx.pl(x), ctx.pl(rows)]
    shards = [p for p in pls if isinstance(p, Shard)]
    if not shards and not any(isinstance(p, Partial) for p in pls):
        return Decision({}, R)
    target = shards[0] if shards else None
    if target is None or target.dim == dim % ndim or any(isinstance(p, Partial) for p in pls) or \
            len(set(shards)) > 1 or not isinstance(ctx.pl(index), Replicate):
        return Decision({(0,): R, (2,): R, (3,): R}, R, note="index_add along the sharded dim or of partial sums")
    return Decision({(0,): target, (3,): target}, target)


@handles(operator.getitem)
def getitem_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    p = ctx.pl(node.args[0])
    return Decision({}, p[node.args[1]] if isinstance(p, tuple) else p)


VIEW_RULES = (view_rule, unflatten_rule, flatten_rule, expand_rule, repeat_rule, transpose_rule, t_rule, permute_rule, unsqueeze_rule, squeeze_rule, slice_rule,
              view_as_complex_rule, view_as_real_rule, as_rule,
              select_rule, split_rule, chunk_rule, unbind_rule, cat_rule, stack_rule, index_rule, index_add_rule,
              getitem_rule)
