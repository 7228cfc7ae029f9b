"""data_parallel: average every trainable parameter's gradient over the dp axis, in buckets.

Purpose: data parallelism (DDP's gradient all-reduce) placed by the compiler, as graph nodes that the
later passes (ZeRO, tensor and pipeline parallelism) see and compose with.

Requires: a Program whose parameter placeholders carry "meshc.fqn"; every parameter replicated on dp.
Ensures: each trainable parameter is consumed only through a `grad_sync` bucket node (a dp all-reduce
    of the bucket's gradients in backward, averaged), inserted right before the bucket's first use;
    each bucket node carries "meshc.why" and one backward CommRecord. With dp = 1 nothing changes.
Terms: bucket = parameters grouped in order of first use, one dtype each, up to `Plan.bucket_mb` MiB;
    a bucket's gradients are all complete once backward has passed the earliest use of any of them.

Before:
    %linear = aten.linear(%x, %p_w1, %p_b1)
After:
    %grad_sync = meshc.runtime.collectives.grad_sync(%p_w1, %p_b1, group='3', size=2)
    %getitem = getitem(%grad_sync, 0)
    %getitem_1 = getitem(%grad_sync, 1)
    %linear = aten.linear(%x, %getitem, %getitem_1)
"""
from __future__ import annotations

import operator

import torch.fx as fx

from meshc.compiler.program import CommRecord, Program
from meshc.runtime.collectives import grad_sync

AXIS = "dp"


def data_parallel_pass(program: Program) -> Program:
    dp = program.mesh.size(AXIS)
    if dp == 1:
        program = program.copy()
        program.notes.append("dp = 1: no gradient averaging needed")
        return program
    program = program.copy()
    graph = program.gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    sizes = program.mesh.sizes
    trainable = [(fqn, node) for fqn, node in program.param_nodes().items()
                 if program.params[fqn].requires_grad and node.users]
    trainable.sort(key=lambda item: min(order[u] for u in item[1].users))
    group = program.mesh.group_name(AXIS, program.rank)
    buckets = _buckets(program, trainable, program.plan.bucket_mb * 2**20)
    for index, bucket in enumerate(buckets):
        nodes = [node for _, node in bucket]
        first_user = min((u for n in nodes for u in n.users), key=order.__getitem__)
        nbytes = sum(program.params[fqn].local_bytes(sizes) for fqn, _ in bucket)
        why = (f"data parallel: average the gradients of bucket {index} ({len(bucket)} params from "
               f"{bucket[0][0]}) over dp={dp}")
        with graph.inserting_before(first_user):
            sync = graph.call_function(grad_sync, tuple(nodes), {"group": group, "size": dp})
            sync.meta["meshc.why"] = why
            sync.meta["meshc.comm"] = [CommRecord("all_reduce", AXIS, nbytes, "backward", why)]
            sync.meta["meshc.bucket"] = [fqn for fqn, _ in bucket]
            for i, node in enumerate(nodes):
                item = graph.call_function(operator.getitem, (sync, i))
                item.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta")})
                item.meta["meshc.why"] = f"bucket {index} output for {bucket[i][0]}"
                node.replace_all_uses_with(item, delete_user_cb=lambda user: user is not sync)
    program.gm.recompile()
    total = sum(program.params[f].local_bytes(sizes) for f, _ in trainable)
    program.notes.append(f"{len(trainable)} params in {len(buckets)} bucket(s), {total / 2**20:.2f} MiB all-reduced over dp={dp}")
    return program


def _buckets(program: Program, trainable: list[tuple[str, fx.Node]], cap: float) -> list[list[tuple[str, fx.Node]]]:
    """Consecutive parameters (in first-use order) grouped up to `cap` bytes, one dtype per bucket."""
    sizes = program.mesh.sizes
    buckets: list[list[tuple[str, fx.Node]]] = []
    used = 0.0
    for fqn, node in trainable:
        spec = program.params[fqn]
        nbytes = spec.local_bytes(sizes)
        if not buckets or used + nbytes > cap or program.params[buckets[-1][0][0]].dtype != spec.dtype:
            buckets.append([])
            used = 0.0
        buckets[-1].append((fqn, node))
        used += nbytes
    return buckets
