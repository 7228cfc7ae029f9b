"""pipeline_split: decide which pipeline stage computes each activation (the decision, not the cut).

Purpose: cut the forward graph into pp x virtual stages. Cuts may only fall where few activation bytes
cross (between blocks, or between attention and MLP, where only the residual stream is live); among
those, the pass balances the stages' cost (forward FLOPs, counted by torch's FlopCounterMode on fake
tensors) by minimizing the costliest stage. `Plan(split_points=[module, ...])` cuts before each named
module instead, and a `meshc.pipe_split()` call in model code cuts where it stands. compiler/stages.py
is the mechanism that turns the decision into stage GraphModules.

Requires: "meshc.shape" and "val" on values (shapes, tensor_parallel); the loss is the graph's output.
Ensures: every activation (a value computed from both parameters and inputs, or from other activations)
    carries "meshc.stage"; values computed only from parameters, or only from inputs and buffers, carry
    none: each stage that needs one computes it itself. Program.stage_info describes the stages.
Terms: stage s in [0, pp*virtual) runs on pipeline rank s % pp; crossing bytes at a cut = bytes of the
    activations defined before it and used after it (sent between the stages, per micro-batch).

Before:  %linear_4 = aten.linear(%mul_10, %p_layers_1_w)
After:   %linear_4 = aten.linear(%mul_10, %p_layers_1_w)        meta meshc.stage = 1
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode

from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.fx_ops import op_name
from meshc.compiler.ir.program import Program

from .blocks import block_of

AXIS = "pp"
MARKER = "pippy::_pipe_split"


@dataclass
class StageInfo:
    stage: int
    blocks: list[str]
    flops: float
    param_bytes: int
    boundary_bytes: int  # activations sent to the next stage, per micro-batch


def pipeline_split_pass(program: Program) -> Program:
    program = program.copy()
    stages = program.mesh.size(AXIS) * program.plan.virtual
    if stages == 1:
        program.notes.append("one pipeline stage")
        return program
    graph = program.gm.graph
    acts = activations(program)
    order = [n for n in graph.nodes if n in acts]
    cost = _flops(order)
    crossing = _crossing_bytes(order, acts)
    cuts = _chosen_cuts(program, order, cost, crossing, stages)
    stage = 0
    for i, node in enumerate(order):
        if stage < len(cuts) and i == cuts[stage]:
            stage += 1
        node.meta["meshc.stage"] = stage
    program.stage_info = _describe(program, order, cost, crossing, cuts, stages)
    for s in program.stage_info:
        program.notes.append(f"stage {s.stage}: {', '.join(s.blocks) or '-'}; {s.flops / 1e9:.3f} GFLOP forward, "
                             f"{s.param_bytes / 2**20:.2f} MiB parameters, {s.boundary_bytes / 2**10:.1f} KiB sent on")
    return program


def activations(program: Program) -> set[fx.Node]:
    """Values that depend on both a parameter and an input (or on another activation)."""
    seen_param: dict[fx.Node, bool] = {}
    seen_input: dict[fx.Node, bool] = {}
    out: set[fx.Node] = set()
    for node in program.gm.graph.nodes:
        if node.op == "placeholder":
            seen_param[node] = node.meta.get("meshc.role") == "param"
            seen_input[node] = node.meta.get("meshc.role") == "input"
            continue
        if node.op != "call_function":
            continue
        ins = node.all_input_nodes
        seen_param[node] = any(seen_param.get(a) for a in ins)
        seen_input[node] = any(seen_input.get(a) for a in ins)
        if any(a in out for a in ins) or (seen_param[node] and seen_input[node]):
            out.add(node)
    return out


def _flops(order: list[fx.Node]) -> list[float]:
    """Forward FLOPs of each node, by running its op on fake tensors under FlopCounterMode."""
    out = []
    for node in order:
        target = node.target
        if not hasattr(target, "_schema"):
            out.append(0.0)
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        counter = FlopCounterMode(display=False)
        try:
            with counter, _fake_mode(node):
                target(*args, **kwargs)
            out.append(float(counter.get_total_flops()))
        except Exception:  # noqa: BLE001 - an op fake tensors cannot run costs what its output weighs
            val = node.meta.get("val")
            out.append(float(val.numel()) if isinstance(val, torch.Tensor) else 0.0)
    return out


def _fake_mode(node: fx.Node):
    from meshc.compiler import _torch_compat as compat

    for a in node.all_input_nodes:
        val = a.meta.get("val")
        if isinstance(val, torch.Tensor) and hasattr(val, "fake_mode"):
            return val.fake_mode
    return compat.fake_tensor_mode()


def _crossing_bytes(order: list[fx.Node], acts: set[fx.Node]) -> list[int]:
    """crossing[i]: bytes of activations defined at or before order[i] and used after it."""
    position = {n: i for i, n in enumerate(order)}
    last_use = {n: max((position.get(u, -1) for u in n.users), default=-1) for n in order}
    # a value is live across the cut after order[i] iff it is defined at or before i and used after
    diff = [0] * (len(order) + 1)
    for i, node in enumerate(order):
        if last_use[node] > i:
            diff[i] += _nbytes(node)
            diff[last_use[node]] -= _nbytes(node)
    running, out = 0, []
    for i in range(len(order)):
        running += diff[i]
        out.append(running)
    return out


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def _chosen_cuts(program: Program, order, cost, crossing, stages: int) -> list[int]:
    """Indices i into `order` where stage s+1 begins (len = stages - 1)."""
    markers = [i for i, n in enumerate(order) if _is_marker(n)]
    forced = _forced_cuts(program, order) or _marker_cuts(program, markers)
    if forced:
        if len(forced) != stages - 1:
            raise MeshcValueError(f"pipeline split: expected {stages - 1} cut(s) for pp×virtual = {stages} stages, got "
                                  f"{len(forced)} from "
                                  f"{'Plan.split_points' if program.plan.split_points else 'pipe_split()'}")
        return forced
    candidates = _candidates(order, cost, crossing)
    if len(candidates) < stages - 1:
        raise MeshcValueError(f"pipeline split: expected at least {stages - 1} places to cut for pp×virtual = {stages} "
                              f"stages, got {len(candidates)} (boundaries between blocks); use fewer stages "
                              f"(pp or virtual), or a model with more layers")
    return _balance(cost, candidates, stages)


def _is_marker(node: fx.Node) -> bool:
    return op_name(node.target) == MARKER


def _marker_cuts(program: Program, markers: list[int]) -> list[int]:
    return [i + 1 for i in markers]


def _forced_cuts(program: Program, order: list[fx.Node]) -> list[int]:
    points = program.plan.split_points
    if not points:
        return []
    cuts = []
    for name in points:
        hits = [i for i, n in enumerate(order) if _in_module(n, name)]
        if not hits:
            raise MeshcValueError(f"Plan.split_points: expected {name!r} to name a module the forward runs, got no "
                                  f"node in it; blocks look like {sorted({block_of(n) for n in order})[:6]}")
        cuts.append(hits[0])
    if cuts != sorted(cuts) or len(set(cuts)) != len(cuts) or cuts[0] == 0:
        raise MeshcValueError("Plan.split_points: expected modules in forward order, each after the first, got "
                              f"{points}")
    return cuts


def _in_module(node: fx.Node, name: str) -> bool:
    return any(path == name or path.startswith(name + ".") for path, _ in node.meta.get("nn_module_stack", {}).values())


def _candidates(order, cost, crossing) -> list[int]:
    """Cut positions (stage starts) where the fewest activation bytes cross, with compute on both sides."""
    total = sum(cost)
    prefix = 0.0
    spots = []
    for i in range(1, len(order)):
        prefix += cost[i - 1]
        if 0 < prefix < total and crossing[i - 1] > 0:
            spots.append((i, crossing[i - 1]))
    if not spots:
        return []
    least = min(b for _, b in spots)
    chosen = [i for i, b in spots if b <= least * 1.01]
    # of a run of adjacent positions with equal crossing (views between blocks), keep the first
    return [i for k, i in enumerate(chosen) if k == 0 or i != chosen[k - 1] + 1]


def _balance(cost: list[float], candidates: list[int], stages: int) -> list[int]:
    """Choose stages-1 cuts among candidates minimizing the costliest stage (dynamic programming)."""
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    points = [0] + candidates + [len(cost)]
    k = len(points)
    # best[j][s]: (max stage cost, cuts) covering points[0]..points[j] with s stages
    best: list[dict[int, tuple[float, tuple]]] = [dict() for _ in range(k)]
    best[0][0] = (0.0, ())
    for j in range(1, k):
        for i in range(j):
            seg = prefix[points[j]] - prefix[points[i]]
            for s, (worst, cuts) in best[i].items():
                if s + 1 > stages:
                    continue
                cand = (max(worst, seg), cuts + ((points[j],) if j < k - 1 else ()))
                if s + 1 not in best[j] or cand[0] < best[j][s + 1][0]:
                    best[j][s + 1] = cand
    return list(best[k - 1][stages][1])


def _describe(program, order, cost, crossing, cuts, stages) -> list[StageInfo]:
    bounds = [0] + cuts + [len(order)]
    info = []
    for s in range(stages):
        nodes = order[bounds[s]: bounds[s + 1]]
        blocks = []
        for n in nodes:
            b = block_of(n)
            if b and b not in blocks:
                blocks.append(b)
        used = {a.meta["meshc.fqn"] for n in nodes for a in n.all_input_nodes
                if a.op == "placeholder" and a.meta.get("meshc.role") == "param"}
        pbytes = sum(program.params[f].local_bytes(program.mesh.sizes) for f in used)
        sent = crossing[bounds[s + 1] - 1] if s < stages - 1 else 0
        info.append(StageInfo(s, blocks, sum(cost[bounds[s]: bounds[s + 1]]), pbytes, sent))
    return info

