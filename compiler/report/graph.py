"""The report's graph section: the transformed graph of a chosen rank and stage (compiler/report/html.py).

Ranks whose coordinates differ only along dp (edp with experts) run one program up to process-group names, so
the page compiles one representative per combination of the other coordinates (pp, tp, cp, ep): this rank for
its own, the lowest rank for each other, at most `limit` of them (`passes_for_rank` on the same trace: a
fraction of a second each for a small model; no process group). Their stage graphs are then deduplicated by
their code with group names replaced by the axis (`'tp:2,3'` -> `'tp'`): one section per distinct graph,
named with its stage and every rank that runs it. A picker (a select element) shows one section at a time;
this rank's first stage is shown first.

Each section is the graph after every pass, grouped by module (node.meta["nn_module_stack"]) with identical
consecutive blocks folded into one entry (compiler/report/groups.py): collectives in red with the model's own
source line (node.meta["stack_trace"]) that made them necessary; hover: shape, placement, why.
"""
from __future__ import annotations

import hashlib
import html
import re
from pathlib import Path

from meshc.compiler.report import groups as report_groups
from meshc.compiler.compile import passes_for_rank
from meshc.compiler.ir.placement import format_placements
from meshc.compiler.ir.program import COMM, PLACEMENT, SHAPE, WHY
from meshc.compiler.pipeline.rank_plan import PipelinePlan
from meshc.compiler.ir.show import human_bytes

MAX_GRAPH_RANKS = 16  # representative ranks compiled for the picker (the page grows by one graph per distinct one)
e = html.escape


def section_key(stage: int | None, rank: int) -> str:
    """The id part of a graph section: `s0-r4` (stage 0 as rank 4 runs it), `p-r4` without a pipeline."""
    return f"{'p' if stage is None else f's{stage}'}-r{rank}"


def own_stages(compiled) -> list[tuple[int | None, object]]:
    """(stage index or None, GraphModule) of the report's own rank."""
    if compiled.pipeline is None:
        return [(None, compiled.program.gm)]
    return [(s.index, s.gm) for s in compiled.pipeline.local.values()]


def representatives(mesh, me: int, limit: int = MAX_GRAPH_RANKS) -> tuple[list[tuple[int, list[int]]], int]:
    """([(rank compiled, ranks it stands for)], ranks left out): one per combination of coordinates other than
    dp/edp, this rank's own first; at most `limit` representatives."""
    groups: dict[tuple, list[int]] = {}
    for r in range(mesh.world_size):
        key = tuple(sorted((a, c) for a, c in mesh.coords(r).items() if a not in ("dp", "edp")))
        groups.setdefault(key, []).append(r)
    mine = next(k for k, ranks in groups.items() if me in ranks)
    ordered = [(me, groups.pop(mine))] + [(ranks[0], ranks) for ranks in groups.values()]
    kept = ordered[:max(limit, 1)]
    return kept, sum(len(ranks) for _, ranks in ordered[len(kept):])


def _normalized(gm, names: dict[str, str]) -> str:
    """`gm`'s code with process-group names made axis names, and what each rank of a group has as its own left out
    (a vocabulary-parallel op's slice, start and end; a collective's position in its group, index): what peers that
    run the same graph have in common."""
    code = re.sub(r"'([^']*)'", lambda m: f"'{names.get(m.group(1), m.group(1))}'", gm.code)
    return re.sub(r"\b(start|end|index) = \d+", r"\1 = .", code)


def _group_names(mesh) -> dict[str, str]:
    out = {}
    for axis in mesh.sizes:
        for row in mesh.all_groups(axis):
            out.setdefault(mesh.group_name(axis, row[0]), axis)
    return out


def rank_sections(compiled, limit: int = MAX_GRAPH_RANKS) -> tuple[list[dict], int]:
    """The distinct graphs of the representative ranks, as dicts (stage, rank, ranks, gm), in stage order, and
    the number of ranks left out by `limit`."""
    program = compiled.program
    reps, left_out = representatives(program.mesh, program.rank, limit)
    names = _group_names(program.mesh)
    sections: dict[tuple, dict] = {}
    for rep, ranks in reps:
        if rep == program.rank:
            stages = own_stages(compiled)
        else:
            other = passes_for_rank(compiled.traced, rep)
            pipeline = None if compiled.pipeline is None else PipelinePlan(other, compiled.pipeline.plan)
            stages = own_stages(type(compiled)(compiled.traced, other, pipeline))
        for stage, gm in stages:
            digest = hashlib.sha1(_normalized(gm, names).encode()).hexdigest()
            entry = sections.setdefault((stage, digest), {"stage": stage, "rank": rep, "ranks": [], "gm": gm})
            entry["ranks"] += ranks
    ordered = sorted(sections.values(), key=lambda s: (-1 if s["stage"] is None else s["stage"], min(s["ranks"])))
    return ordered, left_out


def graphs(compiled, limit: int = MAX_GRAPH_RANKS) -> str:
    """The graph section: a picker and one folded graph per distinct (stage, graph) of the representative ranks."""
    me = compiled.program.rank
    sections, left_out = rank_sections(compiled, limit)
    first = section_key(own_stages(compiled)[0][0], me)
    options, out = [], []
    for s in sections:
        key, gm = section_key(s["stage"], s["rank"]), s["gm"]
        ranks = sorted(s["ranks"])
        name = ("program" if s["stage"] is None else f"stage {s['stage']}") + f" · ranks {_ranges(ranks)}"
        comms = sum(bool(n.meta.get(COMM)) for n in gm.graph.nodes)
        chosen = key == first
        options.append(f'<option value="{key}"{" selected" if chosen else ""}>{e(name)}'
                       f'{" (this rank)" if me in ranks else ""}</option>')
        tree = grouped(gm)
        out.append(f'<details class="tree graph{"" if chosen else " hidden"}" data-stage="{key}" '
                   f'data-ranks="{",".join(map(str, ranks))}" open><summary>{e(name)}: {len(gm.graph.nodes)} nodes, '
                   f'{comms} collectives</summary><div class="tree-root">{_render(key, gm, tree)}</div></details>')
    omitted = (f" {left_out} ranks are not drawn (the page compiles at most {limit} representatives): "
               "meshc explain --rank N draws another." if left_out else "")
    return (f'<p>Show <select id="graph-pick">{"".join(options)}</select> {len(sections)} distinct graphs: ranks '
            "that differ only in their dp coordinate run one graph up to process-group names, and ranks whose "
            f"graphs match share an entry.{omitted}</p>\n"
            "<p>Each graph after every pass, collapsed by module (nn_module_stack: blocks.3.attn), modules in the "
            "order the program first runs them: the inputs first, the step's own nodes (gradient sync, ZeRO "
            "buckets, the outputs) last, a collective under the module that needs it. Consecutive blocks that run "
            "the same ops, placements and collectives fold into one entry (e.g. blocks.0–11, 12 identical) holding "
            "each of them; a block that differs stands apart. Click a module to expand it, hover a node for its "
            "shape, placement and why. Collectives are red, with the line of the model that made them necessary; "
            "⇄ marks a group that holds one.</p>\n" + "\n".join(out))


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(r) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def grouped(gm) -> dict:
    """The graph's nodes as report_groups' tree: grouped by module, identical consecutive blocks folded."""
    nodes = list(gm.graph.nodes)
    return report_groups.fold(report_groups.module_tree(nodes, report_groups.node_paths(nodes)))


def _render(key: str, gm, tree: dict) -> str:
    return report_groups.render(tree["items"], {n: _node_html(key, n, gm) for n in gm.graph.nodes})


def _node_html(key: str, node, gm) -> str:
    comm = node.meta.get(COMM) or ()
    shape = node.meta.get(SHAPE)
    placement = node.meta.get(PLACEMENT)
    info = [node.format_node() or node.name]
    if shape is not None:
        info.append("shape (global): (" + ", ".join(str(d) for d in shape) + ")")
    if placement:
        info.append(f"placement: {format_placements(placement)}")
    for r in comm:
        info.append(f"{r.kind} over {r.axis}, {human_bytes(r.bytes)} × {r.count}, {r.phase}")
    if node.meta.get(WHY):
        info.append(f"why: {node.meta[WHY]}")
    src = ""
    if comm:
        line = source_line(node, gm)
        info.append(f"source: {line}" if line else "source: (no model line: inserted for the step)")
        src = f'<span class="src">{e(line or "")}</span>'
    label = f"{node.name} = {_target(node)}"
    cls = "node comm" if comm else "node"
    return (f'<div class="{cls}" id="n-{key}-{e(node.name)}" data-node="{e(node.name)}" '
            f'data-info="{e(chr(10).join(info))}"><span class="mono">{e(label)}</span>{src}</div>')


def _target(node) -> str:
    if node.op in ("placeholder", "output"):
        return node.op
    target = node.target
    return getattr(target, "__name__", None) or str(target)


def source_line(node, gm) -> str:
    """The model's own line that made `node` necessary: its stack trace's last frame outside torch, else that
    of the tensor its why names (%name), else of its nearest input or user that has one ("" if none)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    named = [by_name[m] for m in re.findall(r"%(\w+)", str(node.meta.get(WHY, ""))) if m in by_name]
    seen, queue = set(), [node, *named]
    while queue:
        n = queue.pop(0)
        if n in seen:
            continue
        seen.add(n)
        line = _last_frame(n.meta.get("stack_trace"))
        if line:
            return line
        queue += list(n.all_input_nodes) + [u for u in n.users if u.op != "output"]
    return ""


def _last_frame(trace) -> str:
    if not trace:
        return ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    own = [f for f in frames if "/torch/" not in f[0] and "site-packages" not in f[0]] or frames
    if not own:
        return ""
    path, line, fn, code = own[-1]
    return f"{Path(path).name}:{line} in {fn}: {code.strip()}"
