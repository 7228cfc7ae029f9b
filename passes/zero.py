"""zero: ZeRO stages 1, 2 and 3 on the dp axis.

Purpose: shard what data parallelism replicates. Every parameter's master copy is stored as a flat,
padded shard on dp (placement F), so optimizer states are sharded in all stages:
  stage 1: the graph computes with whole (tp-local) parameters and keeps whole gradients; at the
           optimizer step the gradients are reduce-scattered, each rank updates its slice, and the
           updated slices are all-gathered back (2Ψ(N−1)/N per step);
  stage 2: a bucket node per block reduce-scatters the gradients as soon as backward completes them,
           straight into the master shards' .grad; whole gradients are never kept (2Ψ(N−1)/N);
  stage 3: the graph takes the flat shards as inputs; each bucket is all-gathered (issued one bucket
           ahead, so the next gather overlaps this block's compute), freed after its last use,
           gathered again in backward, and its gradient reduce-scattered (3Ψ(N−1)/N).
Buckets follow the blocks of the model (Plan.zero_bucket_mb caps them); tp-partial gradients are summed
over tp inside the same bucket before the reduce-scatter.

Requires: tensor_parallel has run (placeholders hold tp-local shapes); "meshc.shape" on values.
Ensures: ParamSpec.placements["dp"] = F (["edp"] for an expert parameter, sharded over ep: the ranks holding the
    same experts; its gradients still averaged over dp) and ParamSpec.zero = stage for every parameter; stage 3: param
    placeholders are flat shards ("dp" in Program.local_axes) consumed only through zero_gather buckets;
    stage 2: trainable params consumed only through zero_reduce buckets; Program.step_comms lists the
    collectives of the optimizer step; notes list the buckets in order.
Terms: Ψ parameters, N = dp size; master shard = fp32 flat shard the optimizer updates; compute dtype =
    Plan.param_dtype (mixed precision) or the parameter's own.

Before (stage 3):
    %linear = aten.linear(%x, %p_w)                                  p_w: (64, 32)
After:
    %zero_gather_start = zero_gather_start(%p_w, %p_b, group='3', size=2, dtype=torch.float32)
    %zero_gather = zero_gather(%zero_gather_start, %p_w, %p_b, bucket=0, shapes=((64, 32), (64,)), ...)
    %getitem = getitem(%zero_gather, 0)                               p_w: (1024,) -> (64, 32)
    %linear = aten.linear(%x, %getitem)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.ir.placement import FlatShard, Replicate, data_axis
from meshc.compiler.ir.program import VALUE_META, CommRecord, Program
from meshc.runtime.ops.zero import shard_size, zero_gather, zero_gather_start, zero_reduce

from meshc.passes.blocks import block_of, stages_using

AXIS = "dp"
EXPERT_AXIS = "edp"  # expert parameters' ZeRO axis: the ranks holding the same experts
SHARD_AXIS, REPLICA_AXIS = "dps", "dpr"  # hybrid sharding (Plan.replicas): shards within dps, copies across dpr


def zero_pass(program: Program) -> Program:
    stage = program.plan.zero
    if stage == 0:
        return program.unchanged("zero = 0: parameters, gradients and optimizer states replicated on dp")
    program = program.copy()
    hybrid = program.mesh.size(REPLICA_AXIS) > 1
    for spec in program.params.values():
        axis = axis_of(spec)
        if hybrid and axis == AXIS:  # hybrid sharding: one copy of the shards per replica group
            axis, spec.placements[REPLICA_AXIS] = SHARD_AXIS, Replicate()
        spec.placements[axis] = FlatShard()
        spec.zero = stage
    if hybrid:
        program.notes.append(f"hybrid sharding: shards over dps={program.mesh.size(SHARD_AXIS)} ranks in each of "
                             f"{program.mesh.size(REPLICA_AXIS)} replica groups; gradient shards all-reduced over dpr")
    experts = [fqn for fqn, spec in program.params.items() if axis_of(spec) == EXPERT_AXIS]
    if experts:
        program.notes.append(f"{len(experts)} expert parameter(s) ZeRO-sharded over edp={program.mesh.size(EXPERT_AXIS)}"
                             f" (the ranks holding the same experts), their gradients averaged over dp")
    managed = [(fqn, node) for fqn, node in program.param_nodes().items()
               if node.users and (stage == 3 or program.params[fqn].requires_grad)]
    buckets = _buckets(program, managed)
    order = {n: i for i, n in enumerate(program.gm.graph.nodes)}
    if stage == 3:
        _gather_buckets(program, buckets, order)
        # a parameter the graph never reads (a decoder's cross-attention when used as a causal LM; one name of a tied
        # pair) is held as a flat shard all the same: its placeholder receives one
        _flat_placeholders(program, [fqn for fqn, node in program.param_nodes().items() if not node.users])
        compiled = program.decisions.get("inductor")
        if compiled is not None and compiled.value:
            program.notes.append("compiled: each bucket's all-gather is a forward graph node marked for recompute, "
                                 "gathered again in the compiled backward (never saved for it), its gradients "
                                 "reduce-scattered there; Inductor moves a gather earlier only while its estimated "
                                 "peak memory does not grow")
        program.local_axes = program.local_axes | {AXIS} | ({EXPERT_AXIS} if experts else set()) | \
            ({SHARD_AXIS} if hybrid else set())
    elif stage == 2:
        for index, bucket in enumerate(buckets):
            _reduce_bucket(program, index, bucket, order)
    program.step_comms = _step_comms(program, stage)
    program.gm.recompile()
    return program


def axis_of(spec) -> str:
    """The axis a parameter's ZeRO shards go over: dp, edp for an expert's (sharded over ep, a part of dp), dps
    under hybrid sharding (once this pass has placed them)."""
    return data_axis(spec.placements)


def _group(program: Program, fqn: str) -> tuple[str, int, str, int]:
    """(axis, its size, this rank's group on it, what gradients are divided by: 0 for the axis' size) of a
    parameter's ZeRO bucket."""
    axis, mesh = axis_of(program.params[fqn]), program.mesh
    return axis, mesh.size(axis), mesh.group_name(axis, program.rank), mesh.size(AXIS) if axis != AXIS else 0


def _replicas(program: Program, axis: str) -> str | None:
    """The dpr group a bucket's reduce-scattered gradient shard is all-reduced over (hybrid sharding), or None."""
    return program.mesh.group_name(REPLICA_AXIS, program.rank) if axis == SHARD_AXIS else None


def _replica_record(program: Program, axis: str, shard_bytes: int, phase: str, why: str, k: int) -> list[CommRecord]:
    if axis != SHARD_AXIS:
        return []
    return [CommRecord("all_reduce", REPLICA_AXIS, shard_bytes, phase,
                       f"{why}: gradient shards summed over the {program.mesh.size(REPLICA_AXIS)} replica groups",
                       tensors=k)]


def _compute_dtype(program: Program, fqn: str) -> torch.dtype:
    return program.plan.param_dtype or program.params[fqn].dtype


def _reduce_dtype(program: Program, fqn: str) -> torch.dtype:
    return program.plan.reduce_dtype or program.plan.param_dtype or program.params[fqn].dtype


def _buckets(program: Program, managed: list[tuple[str, fx.Node]]) -> list[list[tuple[str, fx.Node]]]:
    """Parameters in order of first use, a new bucket at each block or past Plan.zero_bucket_mb."""
    order = {n: i for i, n in enumerate(program.gm.graph.nodes)}
    first = {fqn: min((u for u in node.users), key=order.__getitem__) for fqn, node in managed}
    managed = sorted(managed, key=lambda item: order[first[item[0]]])
    cap = program.plan.zero_bucket_mb * 2**20
    buckets: list[list[tuple[str, fx.Node]]] = []
    used, block, key = 0.0, None, None
    for fqn, node in managed:
        spec = program.params[fqn]
        nbytes = spec.local_bytes(program.mesh.sizes)
        this_key = (spec.grad_partial, spec.requires_grad, _compute_dtype(program, fqn), stages_using(node),
                    axis_of(spec))
        this_block = block_of(first[fqn])
        if not buckets or this_block != block or this_key != key or used + nbytes > cap:
            buckets.append([])
            used, block, key = 0.0, this_block, this_key
        buckets[-1].append((fqn, node))
        used += nbytes
    return buckets


def _gather_buckets(program: Program, buckets, order) -> None:
    graph, mesh = program.gm.graph, program.mesh
    waits: list[fx.Node] = []
    last_use = [max(order[u] for _, node in b for u in node.users) for b in buckets]
    kept = last_use.index(max(last_use)) if program.plan.zero_keep_last else -1
    offloaded = program.plan.offload_params  # the shards live in the offload's file: their pages dropped once read
    for index, bucket in enumerate(buckets):
        fqns = [f for f, _ in bucket]
        nodes = [node for _, node in bucket]
        specs = [program.params[f] for f in fqns]
        axis, n, group, average = _group(program, fqns[0])
        shapes = tuple(s.unflat_shape(mesh.sizes) for s in specs)
        dtype, reduce_dtype = _compute_dtype(program, fqns[0]), _reduce_dtype(program, fqns[0])
        partial = tuple(mesh.group_name(a, program.rank) for a in specs[0].grad_partial if mesh.size(a) > 1)
        first_user = min((u for node in nodes for u in node.users), key=order.__getitem__)
        if n == 1 and not partial and average in (0, 1) and _replicas(program, axis) is None:
            _read_in_place(program, bucket, shapes, dtype, first_user)  # one rank on the axis: nothing to gather
            program.notes.append(f"bucket {index}: {block_of(first_user) or 'model'}, {len(bucket)} params, read in "
                                 f"place ({axis} has one rank: no gather, no reduce-scatter)")
            continue
        shard_elems = sum(shard_size(s.local_bytes(mesh.sizes) // s.dtype.itemsize, 1) for s in specs)
        gather_bytes = shard_elems * dtype.itemsize
        scatter_bytes = shard_elems * n * reduce_dtype.itemsize
        why = f"ZeRO-3 bucket {index} ({block_of(first_user) or 'model'}: {len(bucket)} params)"
        with graph.inserting_before(first_user):
            wait = graph.call_function(zero_gather, (None, *nodes), {
                "bucket": index, "shapes": shapes, "group": group, "size": n, "dtype": dtype,
                "partial": partial, "reduce_dtype": reduce_dtype, "keep": index == kept, "average": average,
                "replicas": _replicas(program, axis), "offloaded": offloaded})
        wait.meta["meshc.why"] = f"{why}: wait for the gathered parameters, copy them out; backward " \
                                 f"reduce-scatters their gradients"
        k = len(bucket)
        wait.meta["meshc.comm"] = [
            CommRecord("all_gather", axis, gather_bytes, "backward", f"{why}: gathered again for backward", tensors=k),
            CommRecord("reduce_scatter", axis, scatter_bytes, "backward", f"{why}: gradients averaged over dp",
                       tensors=k),
            *_replica_record(program, axis, shard_elems * reduce_dtype.itemsize, "backward", why, k)]
        if index == kept:  # used last in forward, first in backward: kept, not gathered again
            wait.meta["meshc.comm"] = wait.meta["meshc.comm"][1:]
        wait.meta["meshc.bucket"] = fqns
        anchor = waits[-1] if waits else wait  # issue this gather one bucket ahead
        with graph.inserting_before(anchor) if not waits else graph.inserting_after(anchor):
            start = graph.call_function(zero_gather_start, tuple(nodes), {"group": group, "size": n, "dtype": dtype,
                                                                          "offloaded": offloaded})
        start.meta["meshc.why"] = f"{why}: all-gather issued before the previous bucket's block computes"
        start.meta["meshc.comm"] = [CommRecord("all_gather", axis, gather_bytes, "forward", f"{why}: parameters",
                                               tensors=k)]
        wait.update_arg(0, start)
        if index != kept:  # compiled (AOTAutograd): the gather recomputed in backward, never saved for it
            compat.mark_recompute(start)
            compat.mark_recompute(wait)
        _route(graph, wait, bucket, mesh)
        waits.append(wait)
        program.notes.append(f"bucket {index}: {block_of(first_user) or 'model'}, {len(bucket)} params, "
                             f"{gather_bytes * n / 2**20:.2f} MiB gathered"
                             + (" (used last in forward: kept for backward)" if index == kept else ""))
    _flat_placeholders(program, [f for b in buckets for f, _ in b])


def _read_in_place(program: Program, bucket, shapes, dtype: torch.dtype, first_user: fx.Node) -> None:
    """A bucket over an axis of one rank: each flat shard is the whole parameter (no padding), viewed in its shape
    and cast to the compute dtype where that differs; its gradient flows back through the view into the shard's
    .grad, as the gather's reduce-scatter over one rank would leave it, without the packing, copies and hooks."""
    graph = program.gm.graph
    for (fqn, node), shape in zip(bucket, shapes):
        val, stored = node.meta.get("val"), program.params[fqn].dtype  # the shard's dtype: the master's
        with graph.inserting_before(first_user):
            value = graph.call_function(torch.ops.aten.view.default, (node, list(shape)))
            value.meta.update({k: v for k, v in node.meta.items() if k in VALUE_META})
            if val is not None:
                value.meta["val"] = val.to(stored)
            if stored != dtype:
                cast = graph.call_function(torch.ops.aten._to_copy.default, (value,), {"dtype": dtype})
                cast.meta.update(value.meta)
                if val is not None:
                    cast.meta["val"] = val.to(dtype)
                value = cast
        value.meta["meshc.why"] = f"ZeRO-3 over one rank: {fqn} read in place"
        keep = {value, *value.all_input_nodes}
        node.replace_all_uses_with(value, delete_user_cb=lambda u: u not in keep and (
            u.op != "call_function" or u.target not in (zero_gather, zero_gather_start, zero_reduce)))


def _route(graph: fx.Graph, bucket_node: fx.Node, bucket, mesh) -> None:
    """Every use of a bucket's parameters goes through the bucket node's outputs."""
    for i, (fqn, node) in enumerate(bucket):
        with graph.inserting_after(bucket_node):
            item = graph.call_function(operator.getitem, (bucket_node, i))
        item.meta.update({k: v for k, v in node.meta.items() if k in VALUE_META})
        item.meta["meshc.why"] = f"bucket output for {fqn}"
        node.replace_all_uses_with(item, delete_user_cb=lambda u: u.op != "call_function" or
                                   u.target not in (zero_gather, zero_gather_start, zero_reduce))


def _flat_placeholders(program: Program, fqns: list[str]) -> None:
    """Stage 3: parameter placeholders now receive flat master shards."""
    mode = compat.fake_tensor_mode()
    nodes = program.param_nodes()
    with mode:
        for fqn in fqns:
            spec = program.params[fqn]
            val = nodes[fqn].meta.get("val")
            device = val.device if val is not None else torch.device("cpu")
            nodes[fqn].meta["val"] = torch.empty(spec.local_shape(program.mesh.sizes), dtype=spec.dtype, device=device)


def _reduce_bucket(program: Program, index: int, bucket, order) -> None:
    graph, mesh = program.gm.graph, program.mesh
    fqns = tuple(f for f, _ in bucket)
    nodes = [node for _, node in bucket]
    specs = [program.params[f] for f in fqns]
    axis, n, group, average = _group(program, fqns[0])
    reduce_dtype = _reduce_dtype(program, fqns[0])
    partial = tuple(mesh.group_name(a, program.rank) for a in specs[0].grad_partial if mesh.size(a) > 1)
    first_user = min((u for node in nodes for u in node.users), key=order.__getitem__)
    elems = sum(shard_size(s.local_bytes(mesh.sizes) // s.dtype.itemsize, 1) for s in specs)
    why = f"ZeRO-2 bucket {index} ({block_of(first_user) or 'model'}: {len(bucket)} params): gradients " \
          f"reduce-scattered into the master shards as soon as backward completes them"
    with graph.inserting_before(first_user):
        node = graph.call_function(zero_reduce, tuple(nodes), {
            "bucket": index, "fqns": fqns, "group": group, "size": n,
            "partial": partial, "reduce_dtype": reduce_dtype, "average": average,
            "replicas": _replicas(program, axis)})
    node.meta["meshc.why"] = why
    node.meta["meshc.comm"] = [CommRecord("reduce_scatter", axis, elems * n * reduce_dtype.itemsize, "backward", why,
                                          tensors=len(bucket)),
                               *_replica_record(program, axis, elems * reduce_dtype.itemsize, "backward", why,
                                                len(bucket))]
    node.meta["meshc.bucket"] = list(fqns)
    _route(graph, node, bucket, mesh)
    program.notes.append(f"bucket {index}: {block_of(first_user) or 'model'}, {len(bucket)} params")


def _step_comms(program: Program, stage: int) -> list[CommRecord]:
    """The collectives the optimizer step runs (stages 1 and 2): not graph nodes, but per-step traffic."""
    if stage == 3:
        return []
    mesh = program.mesh
    out = []
    for axis in (AXIS, EXPERT_AXIS, SHARD_AXIS):
        trainable = [program.params[f] for f in program.zero_step_params(axis)]
        if not trainable:
            continue
        n = mesh.size(axis)
        shard_elems = sum(s.local_shape(mesh.sizes)[0] for s in trainable)
        reduce_bytes = (program.plan.reduce_dtype or program.plan.param_dtype or torch.float32).itemsize
        if stage == 1:
            out += _replica_record(program, axis, shard_elems * reduce_bytes, "step", "ZeRO-1", len(trainable))
        if n == 1:  # one rank on the axis: the step packs, reduces and gathers nothing (runtime/zero/param_store.py)
            continue
        if stage == 1:
            out.append(CommRecord("reduce_scatter", axis, shard_elems * n * reduce_bytes, "step",
                                  "ZeRO-1: gradients reduce-scattered at the step", tensors=len(trainable)))
        dtype = program.plan.param_dtype or torch.float32
        out.append(CommRecord("all_gather", axis, shard_elems * dtype.itemsize, "step",
                              f"ZeRO-{stage}: updated parameter slices all-gathered after the step",
                              tensors=len(trainable)))
    return out
