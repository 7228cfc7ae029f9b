"""grad_sync: make every trainable parameter's gradient whole and averaged, in buckets.

Purpose: data parallelism's gradient all-reduce (DDP), placed by the compiler as graph nodes that the
later passes see: gradients are averaged over dp. It also completes the gradients that tensor
parallelism leaves partial: a parameter replicated on tp whose every use is sharded compute (a norm
weight under sequence parallelism, a row-parallel bias) gets a partial gradient on each rank, summed
over tp here, in the same buckets (Megatron all-reduces those too, at the end of backward).

Requires: parameter placeholders carry "meshc.fqn"; ParamSpec.grad_partial names the axes over which a
    gradient is a partial sum (set by tensor_parallel).
Ensures: each trainable parameter that needs reduction is consumed only through a `grad_sync` bucket node,
    inserted right before the bucket's first use: identity forward; backward sums over each partial axis,
    then averages over dp. Each bucket node carries "meshc.why" and one backward CommRecord per axis.
    Nothing changes when dp = 1 and no gradient is partial. An expert parameter (sharded over ep, a
    sub-group of dp) already holds the sum over its ep group (the all-to-all's backward brought it every
    row routed to it): it is summed over edp only (the ranks holding the same experts), then divided by
    dp like every other gradient.
Terms: bucket = parameters grouped in order of first use, with one dtype, the same axes to reduce and the
    same pipeline stages using them, up to `Program.bucket_mb()` MiB (Plan.bucket_mb, else the cost model's
    choice); a bucket's gradients are complete once backward has passed the earliest use.

Before:
    %linear = aten.linear(%x, %p_w1, %p_b1)
After:
    %grad_sync = meshc.runtime.ops.collectives.grad_sync(%p_w1, %p_b1, groups=('3',), size=2)
    %getitem = getitem(%grad_sync, 0)
    %getitem_1 = getitem(%grad_sync, 1)
    %linear = aten.linear(%x, %getitem, %getitem_1)
"""
from __future__ import annotations

import operator

import torch.fx as fx

from meshc.compiler.ir.placement import data_axis
from meshc.compiler.ir.program import VALUE_META, CommRecord, Program
from meshc.runtime.ops.collectives import grad_sync

from meshc.passes.blocks import stages_using

DP = "dp"


def grad_sync_pass(program: Program) -> Program:
    program = program.copy()
    mesh = program.mesh
    dp = mesh.size(DP)
    graph = program.gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    trainable = [(fqn, node) for fqn, node in program.param_nodes().items()
                 if program.params[fqn].requires_grad and node.users
                 and (_axes(program, fqn) or _divisor(program, fqn) != 1)]
    if not trainable:
        program.notes.append("no gradient left to reduce here (dp = 1 and none partial, or ZeRO reduces them)")
        return program
    trainable.sort(key=lambda item: min(order[u] for u in item[1].users))
    buckets = _buckets(program, trainable, program.bucket_mb() * 2**20)
    for index, bucket in enumerate(buckets):
        _insert_bucket(program, index, bucket, order)
    program.gm.recompile()
    sizes = mesh.sizes
    total = sum(program.params[f].local_bytes(sizes) for f, _ in trainable)
    program.notes.append(f"{len(trainable)} params in {len(buckets)} bucket(s), {total / 2**20:.2f} MiB of gradients "
                         f"reduced" + (f", averaged over dp={dp}" if dp > 1 else ""))
    return program


def _axes(program: Program, fqn: str) -> tuple[str, ...]:
    """The axes a parameter's gradient is reduced over here, in order: its partial axes, then dp.

    ZeRO reduces its parameters itself: stages 2 and 3 in their bucket nodes (partial axes included),
    stage 1 over dp at the optimizer step (so only the partial axes remain for this pass)."""
    spec = program.params[fqn]
    if spec.zero in (2, 3):
        return ()
    axes = tuple(a for a in spec.grad_partial if program.mesh.size(a) > 1)
    data = data_axis(spec.placements)
    return axes + ((data,) if program.mesh.size(data) > 1 and spec.zero == 0 else ())


def _divisor(program: Program, fqn: str) -> int:
    """What the summed gradient is divided by: dp, where this pass averages over data parallelism."""
    return program.mesh.size(DP) if program.params[fqn].zero == 0 else 1


def _insert_bucket(program: Program, index: int, bucket: list[tuple[str, fx.Node]], order) -> None:
    graph, mesh = program.gm.graph, program.mesh
    nodes = [node for _, node in bucket]
    axes = _axes(program, bucket[0][0])
    first_user = min((u for n in nodes for u in n.users), key=order.__getitem__)
    nbytes = sum(program.params[fqn].local_bytes(mesh.sizes) for fqn, _ in bucket)
    groups = tuple(mesh.group_name(a, program.rank) for a in axes)
    size = _divisor(program, bucket[0][0])
    what = " then ".join(("average over dp" if a == DP else "sum over edp (ranks holding the same experts), "
                          "divide by dp" if a == "edp" else f"sum the partial gradients over {a}") for a in axes)
    if size != 1 and not {DP, "edp"} & set(axes):
        what = " then ".join(filter(None, (what, "divide by dp (the ep group's sum is already here)")))
    why = f"gradients of bucket {index} ({len(bucket)} params from {bucket[0][0]}): {what}"
    with graph.inserting_before(first_user):
        sync = graph.call_function(grad_sync, tuple(nodes), {"groups": groups, "size": size})
        sync.meta["meshc.why"] = why
        sync.meta["meshc.comm"] = [CommRecord("all_reduce", a, nbytes, "backward", why) for a in axes]
        sync.meta["meshc.bucket"] = [fqn for fqn, _ in bucket]
        for i, node in enumerate(nodes):
            item = graph.call_function(operator.getitem, (sync, i))
            item.meta.update({k: v for k, v in node.meta.items() if k in VALUE_META})
            item.meta["meshc.why"] = f"bucket {index} output for {bucket[i][0]}"
            node.replace_all_uses_with(item, delete_user_cb=lambda user: user is not sync)


def _buckets(program: Program, trainable: list[tuple[str, fx.Node]], cap: float) -> list[list[tuple[str, fx.Node]]]:
    """Consecutive parameters (in first-use order) up to `cap` bytes, one dtype and one axis list per bucket."""
    sizes = program.mesh.sizes
    buckets: list[list[tuple[str, fx.Node]]] = []
    used = 0.0
    for fqn, node in trainable:
        spec = program.params[fqn]
        nbytes = spec.local_bytes(sizes)
        key = _key(program, fqn, node)
        if not buckets or used + nbytes > cap or key != _key(program, buckets[-1][0][0], buckets[-1][0][1]):
            buckets.append([])
            used = 0.0
        buckets[-1].append((fqn, node))
        used += nbytes
    return buckets


def _key(program: Program, fqn: str, node: fx.Node):
    """Parameters share a bucket only with the same dtype, axes to reduce and pipeline stages using them."""
    return (program.params[fqn].dtype, _axes(program, fqn), _divisor(program, fqn), stages_using(node))
