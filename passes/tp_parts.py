"""Where a fused projection's output is cut into parts (q|k|v, gate|up): the chunks its weight is sharded in; and
the pieces of a weight cut before its linears (`weight_pieces`).

tp_placement shards a linear's weight on its output dim; when the output is several projections side by side
(GPT-2's c_attn, Phi-3's qkv_proj, nn.MultiheadAttention's in_proj), each part must be split over the ranks on its
own (S(dim, chunks)), or a rank would hold all of q and half of k. `chunks_of` follows the output to where it is
cut: split/chunk/slices on the last dim or on the heads, or an unflatten into (parts, width / parts) whose parts dim
is then taken apart (select/unbind after transposes), as nn.MultiheadAttention's packed projection is.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from meshc.compiler.ir.fx_ops import is_reshape
from meshc.compiler.ir.placement import Whole, as_chunks
from meshc.passes.sharding.loops import joined_in_order

aten = torch.ops.aten
# ops that move a dim without touching the data's order along it: what a parts dim may pass through
_MOVES = (aten.unsqueeze.default, aten.transpose.int, aten.squeeze.dim, aten.contiguous.default, aten.clone.default,
          aten.permute.default)


def chunks_of(node: fx.Node, n: int) -> int | tuple[int, ...]:
    """A fused projection: its output, through reshapes that keep the last dim or split it into (heads, head
    dim), is cut into parts on that dim or on the heads (split, chunk, or slices that tile it, as Phi-3's q|k|v
    and Falcon's q|k|v heads are): their count when equal, else their sizes. A part of heads whose count does
    not divide over the n ranks (multi-query k and v) is held whole on every rank (a Whole block), when
    another part still shards."""
    width = int(node.meta["meshc.shape"][-1])
    frontier = [(node, 1)]  # (value, elements of the flat last dim per position of the dim cut)
    while frontier:
        cur, unit = frontier.pop()
        ndim = len(cur.meta["meshc.shape"])
        cut = ndim - (1 if unit == 1 else 2)
        size = int(cur.meta["meshc.shape"][cut])
        slices = []
        for u in cur.users:
            shape = u.meta.get("meshc.shape") or ()
            if unit == 1 and (is_reshape(u) or u.target is aten.unsqueeze.default and u.args[1] % (ndim + 1) < ndim) \
                    and int(shape[-1]) == width:  # the last dim kept (GPT-BigCode: unsqueeze(1), then the split)
                frontier.append((u, 1))
            elif unit == 1 and _rows_joined(u, cur, width):  # the rows of several layers (a loop over experts)
                frontier.append((u, 1))
            elif unit == 1 and _packed_parts(u, width):  # (..., parts, width / parts), each part taken apart
                return _blocks([width // _packed_parts(u, width)] * _packed_parts(u, width), 1, n)
            elif unit == 1 and _head_split(u, width):
                frontier.append((u, _head_split(u, width)))  # (..., heads, head dim)
            elif u.target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
                dim = u.args[2] if len(u.args) > 2 else 0
                if dim % ndim == cut:
                    sizes = [int(s[dim]) for s in shape]
                    head = _split_head_dim(u) if unit == 1 else None
                    if head and all(s % head == 0 for s in sizes):  # q|k|v of whole heads (k, v maybe one each)
                        return _blocks([s // head for s in sizes], head, n)
                    nested = _nested_parts(u, dim % ndim, n) if unit == 1 else None
                    return nested or _blocks(sizes, unit, n)
            elif u.target == aten.slice.Tensor and len(u.args) > 1 and u.args[1] % ndim == cut:
                step = u.args[4] if len(u.args) > 4 else 1
                lo = u.args[2] if len(u.args) > 2 and u.args[2] is not None else 0
                if step == 1 and 0 <= lo < size:
                    slices.append((lo, lo + int(shape[cut]), _head_dim(u)))
        tiles = sorted(set(slices))
        if len(tiles) > 1 and tiles[0][0] == 0 and tiles[-1][1] == size and all(
                a[1] == b[0] for a, b in zip(tiles, tiles[1:])):
            heads = {d for *_, d in tiles}  # flat q|k|v slices each viewed as (heads, head dim) afterwards
            if unit == 1 and len(heads) == 1 and None not in heads and all((hi - lo) % min(heads) == 0
                                                                           for lo, hi, _ in tiles):
                return _blocks([(hi - lo) // min(heads) for lo, hi, _ in tiles], min(heads), n)
            return _blocks([hi - lo for lo, hi, _ in tiles], unit, n)
    later = _split_after(node, len(node.meta["meshc.shape"]) - 1)  # cut only after per-channel ops: Qwen3.5's q|k|v
    if later is None:                                                # after a depthwise conv1d, Falcon-H1's parts
        return 1                                                     # after a per-channel scale
    split, dim = later
    return _nested_parts(split, dim, n) or _held(_part_blocks(split, dim), n)


def _nested_parts(split: fx.Node, dim: int, n: int) -> int | tuple[int, ...] | None:
    """A split whose parts are cut again after ops that keep every channel apart (Mamba-2's in_proj: z | x|B|C | dt,
    x|B|C through a transpose and a depthwise conv1d, then split into x, B and C): the blocks of every part, each of
    heads where it is viewed as (heads, head dim) afterwards, one not dividing over n held whole (B and C of one
    group); None when no part is cut again."""
    parts = {u.args[1]: u for u in split.users if u.target is operator.getitem}
    sizes = [int(s[dim]) for s in split.meta["meshc.shape"]]
    if sorted(parts) != list(range(len(sizes))):
        return None
    blocks, cut_again = [], False
    for i, size in enumerate(sizes):
        inner = _cut_again(parts[i], dim)
        cut_again = cut_again or inner is not None
        blocks += inner or [(size, _viewed_head(parts[i], dim))]
    if not cut_again:
        return None
    return _held(blocks, n)


def _held(blocks: list[tuple[int, int]], n: int) -> int | tuple:
    """The chunks of (size, head dim) blocks: a block of heads not dividing over n held whole (a Whole block) when
    another block still shards."""
    whole = [hd > 1 and (size // hd) % n != 0 for size, hd in blocks]
    if any(whole) and not all(whole):
        return tuple(Whole(size) if w else size for (size, _), w in zip(blocks, whole))
    return as_chunks([size for size, _ in blocks])


def _per_channel(node: fx.Node, dim: int):
    """(user, where `dim` is in it) for each user of `node` that keeps every position of `dim` (a channel) apart from
    the others: a transpose, a dtype cast or copy, a unary elementwise op, a slice or tensor_split of another dim
    (through getitem), a depthwise conv1d over `dim` as its channels."""
    ndim = len(node.meta["meshc.shape"])
    for u in node.users:
        if u.op != "call_function" or not u.args or u.args[0] is not node:
            continue
        t, args = u.target, u.args
        if t is aten.transpose.int:
            yield u, _moved_dim(u, dim, ndim)
        elif t in _KEEPS or (hasattr(t, "tags") and torch.Tag.pointwise in t.tags and _same_or_broadcast(u, node)):
            yield u, dim  # elementwise: each channel from the same channel of its inputs (a per-channel scale)
        elif t in (aten.slice.Tensor, aten.tensor_split.indices, aten.tensor_split.sections) and \
                _dim_arg(u, 1 if t is aten.slice.Tensor else 2) % ndim != dim:
            yield from ((g, dim) for g in u.users) if t is not aten.slice.Tensor else [(u, dim)]
        elif t is operator.getitem:
            yield u, dim
        elif t is aten.conv1d.default and dim == ndim - 2 and len(args) > 6 and \
                args[6] == int(node.meta["meshc.shape"][dim]) == int(args[1].meta["meshc.shape"][0]):
            yield u, dim


def _same_or_broadcast(u: fx.Node, node: fx.Node) -> bool:
    """Is every other tensor operand of elementwise `u` no larger than `node` (so `u` has `node`'s shape: a
    per-channel multiplier such as Falcon-H1's mup_vector, a scalar)?"""
    shape = list(node.meta["meshc.shape"])  # ints, or symbols (rows known at run time): compared as expressions
    for other in u.all_input_nodes:
        dims = list(other.meta.get("meshc.shape") or ())
        if len(dims) > len(shape) or any(not (d == 1 or d == s) for d, s in zip(reversed(dims), reversed(shape))):
            return False
    return True


_KEEPS = (aten.to.dtype, aten._to_copy.default, aten.contiguous.default, aten.clone.default, aten.alias.default)


def _cut_again(part: fx.Node, dim: int) -> list[tuple[int, int]] | None:
    """[(size, head dim or 1)] of the split that cuts `part`'s channels on `dim` again after per-channel ops, if any."""
    found = _split_after(part, dim)
    if found is None:
        return None
    return _part_blocks(*found)


def _split_after(part: fx.Node, dim: int) -> tuple[fx.Node, int] | None:
    """(the split or chunk, the dim it cuts) that cuts `part`'s channels on `dim` after one or more per-channel ops
    (LFM3's B|C|x: a transpose, then chunk(3) of the channels), if any."""
    frontier, seen = [(part, dim)], set()
    while frontier:
        cur, d = frontier.pop()
        for u, ud in _per_channel(cur, d):
            if u not in seen:
                seen.add(u)
                frontier.append((u, ud))
        for u in cur.users:
            if u.target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default) and \
                    cur is not part and _dim_arg(u, 2) % len(cur.meta["meshc.shape"]) == d:
                return u, d
    return None


def _part_blocks(split: fx.Node, dim: int) -> list[tuple[int, int]]:
    """[(size, head dim or 1)] of each part `split` cuts `dim` into (1 for a part nothing takes)."""
    pieces = {g.args[1]: g for g in split.users if g.target is operator.getitem}
    return [(int(s[dim]), _viewed_head(pieces[i], dim) if i in pieces else 1)
            for i, s in enumerate(split.meta["meshc.shape"])]


def _viewed_head(part: fx.Node, dim: int) -> int:
    """The head dim `part`'s last dim `dim` is viewed with as (heads, head dim), after per-channel ops; else 1."""
    frontier, seen = [(part, dim)], set()
    while frontier:
        cur, d = frontier.pop()
        if d == len(cur.meta["meshc.shape"]) - 1:
            width = int(cur.meta["meshc.shape"][-1])
            heads = {_head_split(u, width) for u in cur.users} - {0}
            if len(heads) == 1:
                return heads.pop()
        for u, ud in _per_channel(cur, d):
            if u not in seen:
                seen.add(u)
                frontier.append((u, ud))
    return 1


def _head_split(u: fx.Node, width: int) -> int:
    """The head dim when `u` reshapes a last dim of `width` into (heads, head dim), else 0."""
    shape = u.meta.get("meshc.shape") or ()
    if is_reshape(u) and len(shape) >= 2 and int(shape[-2]) * int(shape[-1]) == width:
        return int(shape[-1])
    return 0


def _head_dim(part: fx.Node) -> int | None:
    """The head dim of the one reshape of `part` that splits its last dim in two (heads, head dim), if any."""
    width = int(part.meta["meshc.shape"][-1])
    dims = {_head_split(u, width) for u in part.users} - {0}
    return dims.pop() if len(dims) == 1 else None


def _split_head_dim(split: fx.Node) -> int | None:
    """The head dim of a flat q|k|v split's parts, where some part is then viewed as (heads, head dim) and all agree
    (GPT-BigCode's multi-query split (q, k, v) whose k and v are one head each, never viewed)."""
    dims = {_head_dim(u) for u in split.users if u.target is operator.getitem} - {None}
    return dims.pop() if len(dims) == 1 else None


def _blocks(parts: list[int], unit: int, n: int) -> int | tuple[int, ...]:
    """The chunks of parts of `unit` elements each (heads): a part of heads not dividing over n is Whole, unless
    every part would be (nothing would shard)."""
    sizes = [p * unit for p in parts]
    whole = [unit > 1 and p % n != 0 for p in parts]
    if any(whole) and not all(whole):
        return tuple(Whole(s) if w else s for s, w in zip(sizes, whole))
    return as_chunks(sizes)


def linear_of_index(use: fx.Node, weight: fx.Node) -> fx.Node | None:
    """The linear layer that reads one layer's weight out of a stack (E, out, in) by index, `F.linear(x, weight[i])`
    (a loop over experts, JetMoE), or None. Every index is such a layer with the same placement: the stack is
    sharded like the experts of a grouped matmul (out dim 1 column-, in dim 2 row-parallel)."""
    if use.op != "call_function" or use.target != aten.select.int or use.args[0] is not weight or \
            len(weight.meta.get("meshc.shape") or ()) != 3 or use.args[1] % 3 != 0 or len(use.users) != 1:
        return None
    (linear,) = use.users
    if linear.target == aten.linear.default and linear.args[1] is use and linear.args[0] is not use and \
            (len(linear.args) < 3 or linear.args[2] is None):
        return linear
    return None


def _rows_joined(u: fx.Node, cur: fx.Node, width: int) -> bool:
    """Does `u` gather `cur`'s rows into a tensor of the same last dim: a cat on another dim (the outputs of one
    layer per expert), or an index_add of them into positions (routed tokens summed back)?"""
    shape = u.meta.get("meshc.shape") or ()
    if not shape or shape[-1] != width:
        return False
    if u.target == aten.cat.default:
        dim = u.args[1] if len(u.args) > 1 else 0
        return dim % len(shape) != len(shape) - 1
    return u.target == aten.index_add.default and len(u.args) > 3 and u.args[3] is cur and \
        u.args[1] % len(shape) != len(shape) - 1


def _packed_parts(u: fx.Node, width: int) -> int:
    """k when `u` splits a last dim of `width` into (k, width / k) or (k, heads, head dim) (an unflatten, or a view
    that keeps the leading dims: nn.MultiheadAttention's packed projection, the reference ViTs' qkv) and the k parts
    are then taken apart (select or unbind on that dim, after dims moved by unsqueeze/transpose/squeeze/permute/
    contiguous), else 0."""
    if u.target is not aten.unflatten.int and not is_reshape(u) or not isinstance(u.args[0], fx.Node):
        return 0
    src = [int(s) for s in u.args[0].meta["meshc.shape"]]
    shape = [int(s) for s in u.meta.get("meshc.shape") or ()]
    if u.target is aten.unflatten.int and (len(u.args) < 3 or u.args[1] not in (-1, len(src) - 1)):
        return 0
    cut = len(src) - 1
    tail = shape[cut:]
    if shape[:cut] != src[:cut] or len(tail) not in (2, 3) or tail[0] < 2 or math.prod(tail) != width:
        return 0
    sizes = tail
    todo, seen, taken = [(u, cut)], set(), {}
    while todo:
        cur, dim = todo.pop()
        for user in cur.users:
            if user in seen:
                continue
            seen.add(user)
            moved = _moved_dim(user, dim, len(cur.meta["meshc.shape"]))
            if user.target in (aten.select.int, aten.unbind.int) and (user.args[1] if len(user.args) > 1 else 0) % \
                    len(cur.meta["meshc.shape"]) == dim:
                if user.target is aten.select.int and isinstance(user.args[2], int):
                    taken[user] = user.args[2] % sizes[0]
                continue  # a part taken
            if moved is None:
                return 0  # used as a whole somewhere: not parts
            todo.append((user, moved))
    if taken and sorted(set(taken.values())) == list(range(sizes[0])) and joined_in_order(taken, sizes[0]):
        return 0  # a loop over the parts (heads one by one), not q|k|v: sharding/loops.py splits the parts dim
    return sizes[0] if seen else 0


def _moved_dim(node: fx.Node, dim: int, ndim: int) -> int | None:
    """Where `dim` of the input of `node` (a dim-moving op) is in its output; None for any other op."""
    if node.target not in _MOVES:
        return None
    args = node.args
    if node.target is aten.unsqueeze.default:
        d = args[1] % (ndim + 1)
        return dim + (1 if d <= dim else 0)
    if node.target is aten.transpose.int:
        a, b = args[1] % ndim, args[2] % ndim
        return b if dim == a else a if dim == b else dim
    if node.target is aten.squeeze.dim:
        d = args[1] % ndim
        return None if d == dim else dim - (1 if d < dim else 0)
    if node.target is aten.permute.default:
        return [p % ndim for p in args[1]].index(dim)
    return dim


def weight_pieces(node: fx.Node) -> list[tuple[int, fx.Node]] | None:
    """A 2-D weight cut on its output dim (dim 0) by a split before linear layers, each piece the weight of one
    (nn.MultiheadAttention's cross-attention: in_proj_weight split into q and k|v, read by two linears with other
    inputs): [(piece's rows, its linear)] in order, else None."""
    uses = list(node.users)
    if len(uses) != 1 or uses[0].target not in (aten.split.Tensor, aten.split_with_sizes.default):
        return None
    split = uses[0]
    if (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) % 2 != 0:
        return None
    sizes = [int(s[0]) for s in split.meta.get("meshc.shape") or ()]
    items = {u.args[1]: u for u in split.users if u.target is operator.getitem}
    if sorted(items) != list(range(len(sizes))) or len(sizes) < 2:
        return None
    out = []
    for i, rows in enumerate(sizes):
        linears = list(items[i].users)
        if len(linears) != 1 or linears[0].target is not aten.linear.default or linears[0].args[1] is not items[i]:
            return None
        out.append((rows, linears[0]))
    return out


def bias_piece(linear: fx.Node) -> tuple[str, int, int] | None:
    """(FQN, index, size) when the bias `linear` adds is piece `index` of a bias parameter cut by split or chunk
    (nn.MultiheadAttention's in_proj_bias, cut into q, k, v or q, k|v), else None."""
    b = linear.args[2] if linear.target is aten.linear.default and len(linear.args) > 2 else None
    if not isinstance(b, fx.Node) or b.target is not operator.getitem:
        return None
    split = b.args[0]
    if not isinstance(split, fx.Node) or split.target not in (aten.split.Tensor, aten.split_with_sizes.default,
                                                              aten.chunk.default):
        return None
    src = split.args[0]
    if not isinstance(src, fx.Node) or src.op != "placeholder" or not src.meta.get("meshc.fqn"):
        return None
    return src.meta["meshc.fqn"], int(b.args[1]), int(b.meta["meshc.shape"][0])


def param_sources(node: fx.Node, dim: int, consumer: fx.Node) -> dict[str, int] | None:
    """{FQN: dim} of the parameters `node` is computed from alone, whose dim `dim` of `node` is, else None: a rule of
    `consumer` asking that value sharded asks it of those parameters, and the value is computed sharded, not whole.

    The walk goes back through dtype casts, copies, elementwise ops (an operand that broadcasts over `dim` is not
    followed: each rank needs it all), squeeze/unsqueeze, select/slice and split pieces along other dims, and the rows
    of a matmul by a parameter (`weight @ x`, x whole). Every operand carrying `dim` must end at a parameter, and each
    parameter found must be read only on the way: Mamba-2's conv1d.weight.squeeze(1).unsqueeze(1) and
    -exp(A_log.float()); Mamba-1's time step, softplus(dt_proj.weight @ t + dt_proj.bias[:, None]), and exp(A * dt)
    read one step of the scan at a time."""
    found: dict[str, int] = {}
    walked: set[fx.Node] = {consumer}
    done: set[tuple[fx.Node, int]] = set()  # walked with success: a value read twice on the way is walked once

    def walk(node: fx.Node, dim: int) -> bool:
        if (node, dim) in done:
            return True
        if len(walked) > _WALK_LIMIT:  # far from any parameter (a residual stream): computed whole, as before
            return False
        walked.add(node)
        if step(node, dim):
            done.add((node, dim))
            return True
        return False

    def step(node: fx.Node, dim: int) -> bool:
        if node.op == "placeholder":
            fqn = node.meta.get("meshc.fqn")
            return bool(fqn) and found.setdefault(fqn, dim) == dim
        shape = node.meta.get("meshc.shape")
        if node.op != "call_function" or not isinstance(shape, (tuple, list)) or not 0 <= dim < len(shape):
            return False
        t, src = node.target, node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if t is aten.unsqueeze.default and src is not None:
            k = node.args[1] % len(shape)
            return k != dim and walk(src, dim - (1 if dim > k else 0))
        if t is aten.squeeze.dim and src is not None:
            k = node.args[1] % len(src.meta["meshc.shape"])
            return walk(src, dim + (1 if len(src.meta["meshc.shape"]) > len(shape) and dim >= k else 0))
        if t in (aten.mm.default, aten.matmul.default) and len(node.args) == 2 and src is not None and \
                len(src.meta.get("meshc.shape") or ()) == 2 and dim == len(shape) - 2:
            return walk(src, 0)  # the rows of weight @ x: the weight's rows; x is needed whole
        if t in (aten.select.int, aten.slice.Tensor) and src is not None:  # a step of a loop over another dim
            k = _dim_arg(node, 1) % len(src.meta["meshc.shape"])
            inner = dim + (1 if t is aten.select.int and dim >= k else 0)
            return k != inner and walk(src, inner)
        if t is operator.getitem and src is not None and src.op == "call_function" and src.target in _PIECES:
            whole = src.args[0]  # one piece of a split, chunk or unbind along another dim
            k = _dim_arg(src, 2 if src.target is not aten.unbind.int else 1)
            k %= len(whole.meta["meshc.shape"])
            inner = dim + (1 if src.target is aten.unbind.int and dim >= k else 0)
            walked.add(src)
            return k != inner and walk(whole, inner)
        if not (t in _KEEPS or hasattr(t, "tags") and torch.Tag.pointwise in t.tags):
            return False
        for a in node.all_input_nodes:
            a_shape = a.meta.get("meshc.shape")
            if not isinstance(a_shape, (tuple, list)):
                return False
            k = dim - (len(shape) - len(a_shape))
            size = _static(a_shape[k]) if k >= 0 else 1
            if size is None:  # a size known only at run time: not followed
                return False
            if size != 1 and not walk(a, k):
                return False
        return True

    if not walk(node, dim) or not found:
        return None
    if any(u not in walked and not _reads_no_values(u) for n in walked if n.op == "placeholder" for u in n.users):
        return None  # a parameter also read elsewhere: sharding it would move it for that other reader
    return found


def _static(size) -> int | None:
    """A size as an int; None where it is a symbol (known only at run time)."""
    try:
        return int(size)
    except (TypeError, ValueError):
        return None


def _dim_arg(node: fx.Node, i: int) -> int:
    """The `dim` argument of `node`, at position i or by name (0 where left out)."""
    return node.args[i] if len(node.args) > i else node.kwargs.get("dim", 0)


_WALK_LIMIT = 256  # ops param_sources looks back through before it gives up
_PIECES = (aten.split.Tensor, aten.split_with_sizes.default, aten.tensor_split.indices, aten.tensor_split.sections,
           aten.chunk.default, aten.unbind.int)
_FILLS = (aten.new_zeros.default, aten.new_empty.default, aten.new_ones.default, aten.new_full.default)


def _reads_no_values(node: fx.Node) -> bool:
    """A use that reads neither the values nor the shape: an assertion of dtype (no output), a tensor of given sizes
    filled alike (`a.new_zeros(...)`), a view nothing reads (Mamba-2's conv1d.weight.squeeze(1) for its decode path)."""
    return node.target in _FILLS or node.op == "call_function" and (node.meta.get("val", 0) is None or not node.users)
