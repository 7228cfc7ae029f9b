"""Indexing by a constant run of positions, written as the slice it is.

`fused[..., [-2], :]` (Falcon's key out of its fused q|k|v heads) traces to `aten.index.Tensor` with a tensor
constant lifted into the graph: an opaque gather for the sharding rules, which would have to read the
constant. When the index is one 1-D integer constant of consecutive positions on one dim (negative ones
counted from the end), it selects exactly what `aten.slice.Tensor(x, dim, first, last + 1)` does, and the
trace rewrites it so: one op the rules already place (blocks of a fused projection are slices). The index's
result is a copy and the slice a view: where an op writes into the result (or a view of it), a clone follows
the slice.

    %c = lift_fresh_copy(%lifted_tensor_0)            # tensor([-2]), dim 2 of size 6
    %k = index.Tensor(%fused, [None, None, %c])   ->   %k = slice.Tensor(%fused, 2, 4, 5)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from meshc.compiler.ir import torch_compat as compat

aten = torch.ops.aten
_INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def slices_for_constant_indices(gm: fx.GraphModule, tensors: dict[str, torch.Tensor]) -> int:
    """Rewrite each index.Tensor by a run of constant positions into a slice; returns how many were."""
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        found = _as_slice(node, tensors)
        if found is None:
            continue
        dim, lo, hi = found
        with graph.inserting_before(node):
            new = graph.call_function(aten.slice.Tensor, (node.args[0], dim, lo, hi))
            if _written(node):  # index returns a copy, slice a view: keep the copy where an op writes into it
                new.meta.update(node.meta)
                new = graph.call_function(aten.clone.default, (new,))
        new.meta.update(node.meta)
        index = node.args[1][dim]
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        if index.op == "call_function" and not index.users:
            graph.erase_node(index)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count


def _written(node: fx.Node) -> bool:
    """Does an op write into `node`'s value, directly or through views of it?"""
    for user in node.users:
        target = user.target
        if user.op != "call_function" or not hasattr(target, "_schema"):
            continue
        if compat.op_is_mutable(target):
            return True
        if compat.op_returns_view(target) and _written(user):
            return True
    return False


def _as_slice(node: fx.Node, tensors: dict) -> tuple[int, int, int] | None:
    """(dim, start, end) when `node` indexes one dim by a 1-D integer constant of consecutive positions."""
    if node.op != "call_function" or node.target != aten.index.Tensor:
        return None
    x, indices = node.args[0], node.args[1]
    used = [d for d, t in enumerate(indices) if t is not None]
    if len(used) != 1 or not isinstance(x, fx.Node) or not isinstance(x.meta.get("val"), torch.Tensor):
        return None
    dim, index = used[0], indices[used[0]]
    const = index.args[0] if index.op == "call_function" and index.target == aten.lift_fresh_copy.default else index
    value = tensors.get(const.meta.get("meshc.fqn")) if const.op == "placeholder" else None
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.dtype not in _INTS or not len(value):
        return None
    size = x.meta["val"].shape[dim]
    try:
        with compat.real_tensors():
            positions = [int(v) + (size if v < 0 else 0) for v in value.tolist()]
    except Exception:  # noqa: BLE001 - a constant without values (fake): left as an index
        return None
    if not all(0 <= p < size for p in positions) or positions != list(range(positions[0], positions[-1] + 1)):
        return None
    return dim, positions[0], positions[-1] + 1
