"""pipeline_split: decide which pipeline stage computes each activation (the decision, not the cut).

Purpose: cut the forward graph into pp x virtual stages. Cuts may only fall where no more activation
bytes cross than between two of the model's repeated blocks (the residual stream: between blocks, between
attention and MLP, or after a pooling that leaves less); among those, the pass minimizes the slowest
stage's predicted time: 3 x its forward time by the cost model's roofline (compiler/ir/roofline.py: each op's
FLOPs at the device's FLOP/s, the bytes it reads and writes at its memory bandwidth, its per-op overhead, at the
profile's compute scale; forward and backward) plus 2 x the bytes it sends (activations forward, their
gradients back) at the pp link's bandwidth (Program.stage_rates, set by the compiler from the hardware profile;
without them, FLOPs alone); crossing bytes only break ties. Balancing FLOPs alone put 9 of GPT-2 small's 12
blocks on stage 0 of 2 (the LM head's 0.1 TFLOP on stage 1), a split the cost model's own timeline priced at
several times stage 1's forward on the h100 profile. Where the blocks are too coarse for every
stage to come within 10% of the mean, Program.warnings says so and why. `Plan(split_points=[module, ...])` cuts before each named
module instead, and a `meshc.pipe_split()` call in model code cuts where it stands. compiler/pipeline/stages.py
is the mechanism that turns the decision into stage GraphModules.

Requires: "meshc.shape" and "val" on values (shapes, tensor_parallel); the loss is the graph's output.
Ensures: every activation (a value computed from both parameters and inputs, or from other activations)
    carries "meshc.stage"; values computed only from parameters, or only from inputs and buffers, carry
    none: each stage that needs one computes it itself. Program.stage_info describes the stages.
Terms: stage s in [0, pp*virtual) runs on pipeline rank s % pp (zbv, dualpipev: in a V, see ir/schedule.py); crossing
    bytes at a cut = bytes of the activations defined before it and used after it (sent between the stages, per
    micro-batch).

Before:  %linear_4 = aten.linear(%mul_10, %p_layers_1_w)
After:   %linear_4 = aten.linear(%mul_10, %p_layers_1_w)        meta meshc.stage = 1
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.fx_ops import op_name, val_nbytes
from meshc.compiler.ir.program import Program
from meshc.compiler.ir.roofline import node_cost

from meshc.runtime.ops.experts import combine

from meshc.passes.blocks import block_of
from meshc.passes.stage_memory import StageMemory, budget

AXIS = "pp"
MARKER = "pippy::_pipe_split"


@dataclass
class StageInfo:
    stage: int
    blocks: list[str]
    flops: float
    param_bytes: int
    boundary_bytes: int  # activations sent to the next stage, per micro-batch
    memory: float = 0.0  # predicted bytes its rank holds for it: states and in-flight activations (stage_memory)
    seconds: float = 0.0  # predicted compute, forward and backward, per micro-batch (the roofline; 0: no rates)


def pipeline_split_pass(program: Program) -> Program:
    stages = program.mesh.size(AXIS) * program.plan.virtual
    if stages == 1:
        return program.unchanged("one pipeline stage")
    program = program.copy()
    graph = program.gm.graph
    acts = activations(program)
    order = [n for n in graph.nodes if n in acts]
    costs = [node_cost(n) for n in order]
    cost = [flops for flops, _, _ in costs]
    rates = program.stage_rates
    times = [3 * (rates.forward_seconds(*c) if rates else c[0]) for c in costs]  # forward and backward
    crossing = _crossing_bytes(order, acts)
    memory = StageMemory(program, order, crossing, stages)
    cuts = _chosen_cuts(program, order, cost, times, crossing, stages, memory)
    stage = 0
    for i, node in enumerate(order):
        if stage < len(cuts) and i == cuts[stage]:
            stage += 1
        node.meta["meshc.stage"] = stage
    program.stage_info = _describe(program, order, cost, times if rates else None, crossing, cuts, stages, memory)
    for s in program.stage_info:
        program.notes.append(f"stage {s.stage}: {', '.join(s.blocks) or '-'}; {s.flops / 1e9:.3f} GFLOP forward, "
                             + (f"{s.seconds * 1e3:.3g} ms predicted forward and backward, " if s.seconds else "")
                             + f"{s.param_bytes / 2**20:.2f} MiB parameters, {s.boundary_bytes / 2**10:.1f} KiB sent on, "
                             f"{s.memory / 2**20:.1f} MiB predicted held")
    return program


def _exchanges(order: list[fx.Node]) -> list[tuple[int, int]]:
    """(dispatch, combine) positions of every expert layer: no stage may begin in (dispatch, combine], as the
    rows in between have a data-dependent count (passes/experts.py) and a stage boundary has a fixed shape."""
    position = {n: i for i, n in enumerate(order)}
    return [(position.get(n.args[1].args[0], 0), position[n]) for n in order  # combine(rows, getitem(dispatch, 2), ..)
            if n.op == "call_function" and n.target is combine]


def _outside_expert_exchanges(order: list[fx.Node], cuts: list[int]) -> None:
    for lo, hi in _exchanges(order):
        inside = [c for c in cuts if lo < c <= hi]
        if inside:
            raise MeshcValueError(f"pipeline split: a stage would begin at {order[inside[0]].format_node()}, "
                                  f"between an expert layer's dispatch ({order[lo].name}) and its combine "
                                  f"({order[hi].name}); move the cut (Plan(split_points=...) or meshc.pipe_split()) "
                                  f"before or after the expert layer")


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


def _crossing_bytes(order: list[fx.Node], acts: set[fx.Node]) -> list[int]:
    """crossing[i]: bytes of activations defined at or before order[i] and used after it."""
    position = {n: i for i, n in enumerate(order)}
    last_use = {n: max((position.get(u, -1) for u in n.users), default=-1) for n in order}
    # a value is live across the cut after order[i] iff it is defined at or before i and used after
    diff = [0] * (len(order) + 1)
    for i, node in enumerate(order):
        if last_use[node] > i:
            diff[i] += val_nbytes(node)
            diff[last_use[node]] -= val_nbytes(node)
    running, out = 0, []
    for i in range(len(order)):
        running += diff[i]
        out.append(running)
    return out


def _chosen_cuts(program: Program, order, cost, times, crossing, stages: int, memory: StageMemory) -> list[int]:
    """Indices i into `order` where stage s+1 begins (len = stages - 1)."""
    markers = [i for i, n in enumerate(order) if _is_marker(n)]
    forced = _forced_cuts(program, order) or _marker_cuts(program, markers)
    if forced:
        if len(forced) != stages - 1:
            raise MeshcValueError(f"pipeline split: expected {stages - 1} cut(s) for pp×virtual = {stages} stages, got "
                                  f"{len(forced)} from "
                                  f"{'Plan.split_points' if program.plan.split_points else 'pipe_split()'}")
        _outside_expert_exchanges(order, forced)
        return forced
    spans = _exchanges(order)  # the automatic cuts avoid them
    candidates = [c for c in _candidates(order, cost, crossing) if not any(lo < c <= hi for lo, hi in spans)]
    if len(candidates) < stages - 1:
        raise MeshcValueError(f"pipeline split: expected at least {stages - 1} places to cut for pp×virtual = {stages} "
                              f"stages, got {len(candidates)} (boundaries between blocks); use fewer stages "
                              f"(pp or virtual), or a model with more layers")
    sends = [2 * b / (program.stage_rates.send_bandwidth if program.stage_rates else float("inf")) for b in crossing]
    total = budget(program)
    cuts = _balance(times, sends, crossing, candidates, stages, memory if total else None, total or 0.0)
    if cuts is None:  # no split fits: balance time, and say by how much the fullest stage is over
        cuts = _balance(times, sends, crossing, candidates, stages)
        _say_memory(program, memory, cuts, len(order), total)
    _say_balance(program, times, sends, cuts, len(candidates))
    return cuts


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
    """Cut positions (stage starts) with compute on both sides where no more activation bytes cross than
    between two repeated blocks ("layers.3" -> "layers.4"; the global least where there are none); of a run of
    adjacent positions with equal crossing (views between blocks), the first, and each where a block ends and
    another begins (a stack of equal-width blocks crosses the same bytes everywhere)."""
    total = sum(cost)
    prefix = 0.0
    spots = []
    for i in range(1, len(order)):
        prefix += cost[i - 1]
        if 0 < prefix < total and crossing[i - 1] > 0:
            spots.append((i, crossing[i - 1]))
    if not spots:
        return []
    blocks = [block_of(n) for n in order]
    before, after = _filled(blocks), _filled(blocks[::-1])[::-1]  # nearest block on each side (adds may be in none)
    between = [b for i, b in spots if _repeated(before[i - 1], after[i])]
    limit = max(min(b for _, b in spots), max(between, default=0))
    chosen = [i for i, b in spots if b <= limit * 1.01]
    return [i for k, i in enumerate(chosen) if k == 0 or i != chosen[k - 1] + 1 or crossing[i - 1] != crossing[i - 2]
            or before[i - 1] != after[i]]


def _filled(blocks: list[str]) -> list[str]:
    """Each position's block, or the last one before it where it has none."""
    out, last = [], ""
    for b in blocks:
        last = b or last
        out.append(last)
    return out


def _repeated(a: str, b: str) -> bool:
    """Whether a cut between blocks `a` and `b` falls between two blocks of a repeated list ("h.2" -> "h.3")."""
    return a != b and a[-1:].isdigit() and b[-1:].isdigit() and a.rsplit(".", 1)[0] == b.rsplit(".", 1)[0]


def _balance(times: list[float], sends: list[float], crossing: list[int], candidates: list[int],
             stages: int, memory: StageMemory | None = None, total: float = 0.0) -> list[int] | None:
    """Choose stages-1 cuts among candidates minimizing the slowest stage (its compute, plus its send when it has
    a next stage), then the bytes crossing the cuts (dynamic programming); with `memory`, only among the splits
    whose every stage fits its share of `total` bytes (None: none fits)."""
    prefix = [0.0]
    for c in times:
        prefix.append(prefix[-1] + c)
    scale = prefix[-1] + sum(sends) or 1.0
    points = [0] + candidates + [len(times)]
    k = len(points)
    # best[j][s]: ((slowest stage, bytes crossing), cuts) covering points[0]..points[j] with s stages
    best: list[dict[int, tuple[tuple[float, int], tuple]]] = [dict() for _ in range(k)]
    best[0][0] = ((0.0, 0), ())
    for j in range(1, k):
        last = j == k - 1
        for i in range(j):
            seg = prefix[points[j]] - prefix[points[i]] + (0.0 if last else sends[points[j] - 1])
            sent = 0 if last else crossing[points[j] - 1]
            for s, ((worst, nbytes), cuts) in best[i].items():
                if s + 1 > stages or (last and s + 1 != stages) or (not last and s + 1 == stages):
                    continue
                if memory is not None and memory.of(s, points[i], points[j]) > memory.limit(s, total):
                    continue
                # stage times equal to 1e-9 of the step are a tie: the fewer bytes win
                key = (round(max(worst, seg) / scale, 9), nbytes + sent)
                cand = ((max(worst, seg), nbytes + sent), cuts + (() if last else (points[j],)))
                old = best[j].get(s + 1)
                if old is None or key < (round(old[0][0] / scale, 9), old[0][1]):
                    best[j][s + 1] = cand
    found = best[k - 1].get(stages)
    return None if found is None else list(found[1])


def _say_memory(program: Program, memory: StageMemory, cuts: list[int], n: int, total: float) -> None:
    """A warning when no split keeps every stage within the device's memory."""
    bounds = [0] + cuts + [n]
    held = [memory.of(s, bounds[s], bounds[s + 1]) / memory.limit(s, total) for s in range(len(bounds) - 1)]
    worst = max(range(len(held)), key=held.__getitem__)
    program.warnings.append(
        f"pipeline split: no split keeps every stage within {total / 2**30:.3g} GiB per device (the hardware "
        f"profile's); balanced for time, stage {worst} is predicted at {held[worst]:.2f}x its share (parameter "
        "states and in-flight activations); more stages, ZeRO, remat or fewer micro-batches in flight would fit")


def _say_balance(program: Program, times: list[float], sends: list[float], cuts: list[int], places: int) -> None:
    """A warning when the slowest stage is more than 10% above the mean: the cut places are too few or too coarse."""
    bounds = [0] + cuts + [len(times)]
    stage = [sum(times[bounds[s]: bounds[s + 1]]) + (sends[bounds[s + 1] - 1] if s < len(cuts) else 0.0)
             for s in range(len(bounds) - 1)]
    mean = sum(stage) / len(stage)
    slowest = max(range(len(stage)), key=stage.__getitem__)
    if mean > 0 and stage[slowest] > 1.10 * mean:
        program.warnings.append(
            f"pipeline split: stage {slowest} is predicted {stage[slowest] / mean - 1:.0%} slower than the mean of the "
            f"{len(stage)} stages (each stage's compute and send: "
            f"{', '.join(f'{t / mean:.2f}' for t in stage)} of the mean): cuts fall only where no more than the "
            f"residual stream crosses, and the {places} such places allow no better; fewer stages, or a model with "
            "more (smaller) blocks, balance better")


def _describe(program, order, cost, times, crossing, cuts, stages, memory: StageMemory) -> list[StageInfo]:
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
        info.append(StageInfo(s, blocks, sum(cost[bounds[s]: bounds[s + 1]]), pbytes, sent,
                              memory.of(s, bounds[s], bounds[s + 1]),
                              sum(times[bounds[s]: bounds[s + 1]]) if times else 0.0))
    return info

