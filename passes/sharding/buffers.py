"""Buffers made by a factory from sizes alone (`torch.zeros(B, H, n * d, d)`: a chunkwise scan's states) that sharded
values are written into (`states[:, :, i * d:(i + 1) * d] = s_i`, a copy_ into a view of the buffer).

Made whole, the buffer makes every write gather its shard, and the layers whose flows write there stay whole (xLSTM's
mLSTM keys, values and gates, written chunk by chunk into its states). Its values before the writes are a constant
(or none), the same whichever part of it a rank holds, so the buffer can be sharded on the dim the writes are
sharded on instead, made at its local sizes, and each write lands in the rank's own part. tp_placement seeds such a
buffer's placement into a trial where a write into it needed the written value whole; where the trial's pairing is
taken, the factory node carries the placement (TP_FACTORY) and the tensor_parallel pass's rule makes it at its local
sizes.

    written_factory(copy_node, placement of the written value, n) -> (factory node, its placement) | None
"""
from __future__ import annotations

import torch
import torch.fx as fx

from meshc.compiler.ir.placement import Shard, has_whole
from meshc.compiler.ir.sizes import static_sizes

aten = torch.ops.aten
FACTORIES = (aten.zeros.default, aten.ones.default, aten.full.default, aten.empty.memory_format)
_VIEWS = (aten.slice.Tensor, aten.select.int)


def written_factory(node: fx.Node, p, n: int) -> tuple[fx.Node, Shard] | None:
    """For `dst.copy_(src)` with src under placement `p`: the factory whose buffer dst views (through slices and
    selects of other dims than the written shard's) and the placement of that buffer that holds src's shard in
    place, where one exists (the buffer's dim divisible by n, sizes known at trace time); else None."""
    if node.target is not aten.copy_.default or not isinstance(p, Shard) or has_whole(p.chunks):
        return None
    dst, src = node.args[0], node.args[1]
    if not isinstance(dst, fx.Node) or not isinstance(src, fx.Node):
        return None
    src_sizes, dst_sizes = static_sizes(src), static_sizes(dst)
    dim = p.dim + len(dst_sizes) - len(src_sizes)  # src broadcast over dst: dims aligned from the right
    if dim < 0 or dst_sizes[dim] != src_sizes[p.dim]:
        return None
    x = dst
    while x.op == "call_function" and x.target in _VIEWS:
        base = x.args[0]
        cut = x.args[1] % len(static_sizes(base))
        if x.target is aten.select.int:
            dim += dim >= cut  # the selected dim is gone from the view
        elif cut == dim:  # a slice of the written dim itself: its shard would not line up
            return None
        x = base
    if x.op != "call_function" or x.target not in FACTORIES or x.all_input_nodes:
        return None
    sizes = static_sizes(x)
    if not isinstance(sizes[dim], int) or sizes[dim] != src_sizes[p.dim] or sizes[dim] % n:
        return None
    return x, Shard(dim, p.chunks)
