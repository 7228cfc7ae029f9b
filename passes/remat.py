"""remat: activation checkpointing per block (Plan.remat = "full" | "selective").

Purpose: trade compute for activation memory, as Megatron-LM's full and selective recompute do. Each
transformer block's activations (per pipeline stage) become one checkpointed sub-graph: backward
recomputes what was not kept (runtime/ops/remat.py says what each policy keeps). Values that only that block
uses and that depend only on parameters (its ZeRO-3 gather, its parameter slices) move inside it, so
that its gathered parameters are recomputed with it rather than kept: remat composes with ZeRO-3. ZeRO-2's
gradient reduction (zero_reduce) stays outside: it is an identity in forward whose backward reduce-scatters
into the master shards, so recomputing it in backward would only run it again outside the step.

Requires: activations carry "meshc.stage" when pipelined; blocks are visible in nn_module_stack.
Ensures: each block whose outputs are only used after it becomes `call_module remat_<i>` (Remat) plus
    getitems; a block that cannot be cut out whole is left as it is and the note says why. Where Inductor
    compiles the programs (Program.decisions["inductor"]), nothing is cut out: each block's nodes are marked for
    AOTAutograd's partitioner instead (save or recompute, per the policy; ac_graph_id = the block's number), which
    puts the recomputation in the compiled backward graph: torch.utils.checkpoint's hooks are not traceable.
Terms: block = nodes under one indexed module path ("layers.3"); region = the block's activations and
    the parameter-only values used nowhere else.

Before:  %linear = aten.linear(%x, %getitem)  ...  %add_2 = aten.add.Tensor(%add_1, %dropout_2)
After:   %remat_0 = remat_0(%x, %p_w1_shard, ...)      (call_module: checkpoint of the block)
         %getitem_9 = getitem(%remat_0, 0)
"""
from __future__ import annotations

import operator

import torch.fx as fx

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.ir.program import COMM, ROLE, STAGE, VALUE_META, WHY, Program
from meshc.runtime.ops.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from meshc.runtime.ops.remat import SAVED, Remat
from meshc.runtime.ops.zero import zero_reduce

from meshc.passes.blocks import block_of
from meshc.passes.pipeline_split import activations


def remat_pass(program: Program) -> Program:
    policy = program.plan.remat
    if policy == "none":
        return program.unchanged("no activation checkpointing")
    program = program.copy()
    graph = program.gm.graph
    acts = activations(program)
    regions: dict[tuple, list[fx.Node]] = {}
    for node in graph.nodes:
        if node in acts and "." in block_of(node):
            regions.setdefault((node.meta.get(STAGE, 0), block_of(node)), []).append(node)
    dp_group = (program.mesh.group_name("dp", program.rank),) if program.plan.zero == 3 else ()
    compiled = program.decisions.get("inductor")
    if compiled is not None and compiled.value:
        for index, nodes in enumerate(regions.values()):
            _mark(nodes, policy, index)
        program.notes.append(f"{len(regions)} block(s) marked for recompute ({policy}): compiled, AOTAutograd's "
                             "partitioner recomputes them in the backward graph")
        return program
    done = 0
    for (stage, block), nodes in regions.items():
        own = policy
        if policy == "selective" and any(n.target in RINGS for n in nodes):
            own = "full"  # measured: selective around a collective matmul trained wrong (below)
            program.notes.append(f"{block}: checkpointed in full, not selectively: it holds a collective matmul, "
                                 "whose point-to-point ring torch's selective checkpoint would run again around "
                                 "the matmul outputs it keeps")
        reason = _checkpoint(program, nodes, f"remat_{done}", own, dp_group, stage)
        if reason:
            program.notes.append(f"{block}: not checkpointed: {reason}")
        else:
            done += 1
    program.gm.recompile()
    program.notes.append(f"{done} block(s) checkpointed ({policy})")
    return program


def _checkpoint(program, nodes, name, policy, dp_group, stage) -> str | None:
    graph = program.gm.graph
    members = set(nodes) | _private_inputs(nodes)
    order = {n: i for i, n in enumerate(graph.nodes)}
    ordered = sorted(members, key=order.__getitem__)
    last = ordered[-1]
    inputs = sorted({a for n in ordered for a in n.all_input_nodes if a not in members}, key=order.__getitem__)
    outputs = [n for n in ordered if any(u not in members for u in n.users)]
    if any(order[u] < order[last] for n in outputs for u in n.users if u not in members):
        return "a value it produces is used before the block ends"
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta.update(a.meta)
    for n in ordered:
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(tuple(env[n] for n in outputs))
    program.gm.add_submodule(name, Remat(fx.GraphModule(program.gm, sub), policy, dp_group))
    with graph.inserting_after(last):
        call = graph.call_module(name, tuple(inputs))
    call.meta.update({WHY: f"activation checkpointing ({policy}) of {block_of(nodes[0])}",
                      "nn_module_stack": nodes[0].meta.get("nn_module_stack", {}), STAGE: stage})
    anchor = call
    for i, n in enumerate(outputs):
        with graph.inserting_after(anchor):
            item = graph.call_function(operator.getitem, (call, i))
        item.meta.update({k: v for k, v in n.meta.items() if k in (*VALUE_META, "nn_module_stack")})
        item.meta[STAGE] = stage
        n.replace_all_uses_with(item, delete_user_cb=lambda u: u not in members)
        anchor = item
    for n in reversed(ordered):
        graph.erase_node(n)
    return None


# Collective matmuls (runtime/ops/collective_matmul.py: autograd functions passing chunks around a ring of
# point-to-point transfers). Under "selective", a block holding one is checkpointed in full: with torch's selective
# checkpoint keeping the matmul outputs and running the rest again, the ring included, the reference Transformer at
# tp2 x pp2 (SP, collective matmuls, GPipe over 2 micro-batches) had a step-1 w1 gradient 6.4e-3 off; in full,
# 1.8e-7 (the plan matrix's case tp2xpp2-z0-selective-gpipe-fp32-m2-sp-vocab-cm). Why the mix goes wrong is not
# found; full recompute runs the block's forward again whole, ring and matmuls together.
RINGS = (all_gather_matmul, matmul_reduce_scatter)


def _mark(nodes: list[fx.Node], policy: str, region: int) -> None:
    """A block's nodes tagged for AOTAutograd's partitioner (compat.mark_recompute) with what runtime/ops/remat.py's
    policies keep: under "full" nothing inside the block is saved, collectives included; under "selective" the
    matmuls' outputs and the tensor-parallel collectives are saved and the rest recomputed. ZeRO-3's gathers are
    already marked "must" (passes/zero.py) and stay so. The block's output, read by the next region, is saved at
    the boundary (the partitioner's rule for consecutive regions)."""
    for node in (*nodes, *_private_inputs(nodes)):
        if policy == "full" or compat.recomputed(node):
            compat.mark_recompute(node, "must", region)
        elif node.target in SAVED or node.meta.get(COMM):
            compat.mark_recompute(node, "save", region)
        else:
            compat.mark_recompute(node, "prefer", region)


def _private_inputs(nodes: list[fx.Node]) -> set[fx.Node]:
    """Parameter-only values (call_function nodes that are not activations) that only the block uses."""
    inside = set(nodes)
    changed = True
    while changed:
        changed = False
        for n in list(inside):
            for a in n.all_input_nodes:
                if a in inside or a.op != "call_function" or STAGE in a.meta:
                    continue
                if all(u in inside for u in a.users) and not _is_activation_like(a) and not _reduces(a):
                    inside.add(a)
                    changed = True
    return inside - set(nodes)


def _reduces(node: fx.Node) -> bool:
    """ZeRO-2's gradient reduction, or an item of its result: kept outside every checkpointed block."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node.target is zero_reduce


def _is_activation_like(node: fx.Node) -> bool:
    """Inputs of a block computed from model inputs (masks, positions) stay outside: they are shared."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if n.meta.get(ROLE) == "input":
                return True
            continue
        stack.extend(n.all_input_nodes)
    return False
