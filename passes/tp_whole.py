"""Column-parallel matmuls whose weight holds some blocks whole on every rank (Whole chunks: the k and v heads
of a multi-query projection fused with q): the rewrite that keeps their gradients right.

One matmul over [q part | k | v] would give x a gradient that is partial in q's rows (each rank has its heads)
and whole in k's and v's (every rank computes them all): no single all-reduce of x's gradient is right. So the
node is split into one matmul per run of blocks: the sharded runs column-parallel (x through Megatron's f,
inserted by the tensor_parallel pass for sharded consumers), the Whole runs replicated (x's gradient there is
whole on every rank, like any replicated compute), and the parts joined by tp_ops.join_blocks, which the pass
knows takes replicated parts without an f.

    %mm = aten.matmul(%x, %w_t)                    # w_t: S(1)x(64+R16+R16), local (64, 32+16+16)
->  %w_q = aten.slice(%w_t, 1, 0, 32)              S(1)x(64)
    %mm_q = aten.matmul(%x, %w_q)                  S(2)
    %w_kv = aten.slice(%w_t, 1, 32, 64)            R
    %mm_kv = aten.matmul(%x, %w_kv)                R
    %mm = join_blocks([%mm_q, %mm_kv], -1)         S(2)x(64+R16+R16)
"""
from __future__ import annotations

import itertools

import torch
import torch.fx as fx

from meshc.compiler.ir.fx_ops import get_arg, set_arg
from meshc.compiler.ir.placement import Whole, blocks_placement, local_blocks
from meshc.runtime.ops.tp_ops import join_blocks

aten = torch.ops.aten


def runs(chunks: tuple) -> list[tuple[bool, tuple]]:
    """Consecutive blocks grouped by whether every rank holds them whole: [(whole, blocks), ...]."""
    return [(whole, tuple(group)) for whole, group in itertools.groupby(chunks, key=lambda b: isinstance(b, Whole))]


def split_whole_matmul(node: fx.Node, placements: dict, n: int, b_path: tuple, b_dim: int,
                       bias_path: tuple | None) -> None:
    """Replace the (local) matmul `node`, whose operand at `b_path` is sharded with Whole blocks on its dim
    `b_dim` (the output's last dim), by one matmul per run of blocks joined on the last dim."""
    graph = node.graph
    b = get_arg(node, b_path)
    bias = get_arg(node, bias_path) if bias_path else None
    chunks = placements[b].chunks
    shape = list(node.meta["meshc.shape"])
    b_shape = list(b.meta["meshc.shape"])
    parts, lo = [], 0
    for _, blocks in runs(chunks):
        size = sum(local_blocks(blocks, sum(blocks), n))
        total = sum(int(x) for x in blocks)
        placement = blocks_placement(b_dim, blocks)
        with graph.inserting_before(node):  # the operands' slices first: the part's copy reads them
            w = _slice(graph, b, b_dim, lo, size, b_shape, total, placement, placements, node)
            sliced_bias = None if bias is None else _slice(graph, bias, 0, lo, size, list(bias.meta["meshc.shape"]),
                                                           total, blocks_placement(0, blocks), placements, node)
            part = graph.node_copy(node)
            set_arg(part, b_path, w)
            if sliced_bias is not None:
                set_arg(part, bias_path, sliced_bias)
        part.meta["meshc.shape"] = tuple(shape[:-1]) + (total,)
        placements[part] = blocks_placement(len(shape) - 1, blocks)
        parts.append(part)
        lo += size
    with graph.inserting_before(node):
        joined = graph.call_function(join_blocks, (parts, -1))
    joined.meta.update({k: node.meta[k] for k in ("val", "meshc.shape", "nn_module_stack", "stack_trace")
                        if k in node.meta})  # "val" (its dtype) until the pass refreshes local values
    joined.meta["meshc.why"] = "tensor parallel: a fused projection's blocks, sharded and held whole, joined"
    placements[joined] = placements[node]
    node.replace_all_uses_with(joined)
    graph.erase_node(node)


def _slice(graph, src, dim, lo, size, shape, total, placement, placements, like) -> fx.Node:
    out = graph.call_function(aten.slice.Tensor, (src, dim, lo, lo + size))
    shape = list(shape)
    shape[dim] = total
    out.meta["meshc.shape"] = tuple(shape)
    out.meta["val"] = src.meta.get("val")  # its dtype, until the pass refreshes local values
    if "nn_module_stack" in like.meta:
        out.meta["nn_module_stack"] = like.meta["nn_module_stack"]
    placements[out] = placement
    return out
