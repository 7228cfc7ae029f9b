"""The plan as one self-contained HTML page: `html_report(compiled, report)` and `write_report(path, ...)`.

Behind `job.report("plan.html")` and `meshc explain ... --html plan.html`. The page holds, with all CSS and
JavaScript inline (compiler/report/assets.py; no network, no CDN):

  mesh         every rank as a cell of a pp × (dp rows × tp columns) grid, coloured by a chosen axis, this
               rank outlined;
  parameters   every parameter, grouped by its module tree (collapsible), filterable: global and local
               shape, placement, local bytes, and the pp rank that holds it;
  graph        the stage graph of a rank chosen in a picker (compiler/report/graph.py: every distinct graph of
               the mesh, this rank's first), grouped by module (node.meta["nn_module_stack"]), identical
               consecutive blocks folded into one entry, the step's own nodes in one group (compiler/report/groups.py);
               collectives in red with the model's own source line (node.meta["stack_trace"]) that made them
               necessary; hover: shape, placement, why;
  collectives  explain()'s census (kind, axis, bytes, count, phase, why) with the predicted time on the
               hardware profile (compiler/cost/compiled.comm_time), each linked to its node;
  memory       predicted bytes per rank by part (compiler/cost/compiled's estimate of the rank's pp
               coordinate) and, when given, what the rank measured;
  schedule     the pipeline schedule simulated (compiler/ir/schedule_sim) with each stage's predicted
               forward and backward seconds: one bar per action, one row per pp rank; given a job.trace file,
               its last step measured: actions, messages, collectives, and the top-level modules of forwards.

It reads only compile-time data (a CompiledRank and its Report), so a simulated compile draws it too; the other
ranks' graphs are compiled from the same trace (compile.passes_for_rank).
"""
from __future__ import annotations

import html
import json
from pathlib import Path

from meshc.compiler.report import assets as report_assets
from meshc.compiler.report.graph import MAX_GRAPH_RANKS, graphs, own_stages, section_key, source_line
from meshc.compiler.cost.compiled import comm_time, compiled_estimate, graph_cost, stage_times
from meshc.compiler.cost.hardware import load as load_hardware
from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.placement import format_placements
from meshc.compiler.ir.program import COMM, CommRecord
from meshc.compiler.ir.schedule_sim import simulate
from meshc.compiler.ir.show import human_bytes

MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "buffers")
PART_COLOURS = {"params": "#4e79a7", "grads": "#f28e2b", "optimizer": "#59a14f", "activations": "#e15759",
                "buffers": "#b07aa1"}
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#9c755f")
MAX_MEMORY_ROWS = 64  # one bar per rank up to this world size, else one per pp rank
e = html.escape


def write_report(path, compiled, report, *, hardware="h100", measured: dict | None = None, title: str = "",
                 trace=None, graph_ranks: int = MAX_GRAPH_RANKS) -> Path:
    """Write `html_report(...)` to `path` (a .html file); returns the path."""
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise MeshcValueError(f"report: expected a path ending in .html, got {str(path)!r}; name the file plan.html")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html_report(compiled, report, hardware=hardware, measured=measured, title=title, trace=trace,
                                graph_ranks=graph_ranks))
    return path


def html_report(compiled, report, *, hardware="h100", measured: dict | None = None, title: str = "",
                trace=None, graph_ranks: int = MAX_GRAPH_RANKS) -> str:
    """The page for a CompiledRank (compiler/compile.py) and its explain() Report; `measured` is what the rank
    holds after a step (job.held_bytes(): params / grads / optimizer bytes), drawn beside the prediction;
    `trace` (a job.trace JSON file, or its parsed dict) adds the measured timeline of its last step;
    `graph_ranks`: how many representative ranks' graphs the picker offers (compiler/report/graph.py)."""
    hw = load_hardware(hardware)
    program = compiled.program
    title = title or f"meshc plan: rank {program.rank} of {program.mesh.world_size}"
    sections = [
        ("mesh", "Mesh", _mesh(program)),
        ("params", "Parameters", _params(program, compiled.pipeline)),
        ("graph", "Graph", graphs(compiled, graph_ranks)),
        ("collectives", "Collectives", _collectives(compiled, report, hw)),
        ("memory", "Memory", _memory(compiled, report, hw, measured)),
        ("schedule", "Pipeline schedule", _schedule(compiled, hw) + _measured(trace)),
    ]
    nav = " ".join(f'<a href="#{key}">{name}</a>' for key, name, _ in sections)
    body = "\n".join(f'<section id="{key}"><h2>{name}</h2>\n{text}\n</section>' for key, name, text in sections)
    header = "<br>".join(e(line) for line in report.header.splitlines())
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>\n'
            f"<style>{report_assets.CSS}</style></head>\n<body>\n<h1>{e(title)}</h1>\n"
            f'<p class="muted">{header}<br>plan: {e(report.plan)}<br>predictions on {e(hw.name)}</p>\n'
            f"<nav>{nav}</nav>\n{body}\n<div id=\"hover\"></div>\n"
            f"<script>{report_assets.JS}</script>\n</body></html>\n")


# ------------------------------------------------------------------------------------------------- mesh
def _mesh(program) -> str:
    mesh, me = program.mesh, program.rank
    sizes = mesh.sizes
    blocks = []
    for pp in range(sizes["pp"]):
        cells = []
        for dp in range(sizes["dp"]):
            for tp in range(sizes["tp"]):
                r = mesh.rank_at({"pp": pp, "dp": dp, "tp": tp})
                cls = "rank me" if r == me else "rank"
                cells.append(f'<div class="{cls}" data-rank="{r}" data-pp="{pp}" data-dp="{dp}" data-tp="{tp}" '
                             f'title="rank {r}: pp={pp} dp={dp} tp={tp}">{r}</div>')
        blocks.append(f'<div class="pp-block"><div class="muted">pp {pp}</div><div class="pp-grid" '
                      f'style="grid-template-columns: repeat({sizes["tp"]}, 46px)">{"".join(cells)}</div></div>')
    coords = ", ".join(f"{a}={c}" for a, c in mesh.coords(me).items())
    options = "".join(f'<option value="{a}">{a}</option>' for a in ("pp", "dp", "tp"))
    return (f"<p>{e(mesh.describe())}. Rows are dp, columns tp, one block per pp rank; this rank ({me}: {coords}) "
            f'is outlined. Colour by <select id="mesh-colour">{options}</select></p>\n'
            f'<div class="mesh">{"".join(blocks)}</div>')


# ------------------------------------------------------------------------------------------- a tree
def _tree() -> dict:
    return {"children": {}, "items": []}


def _insert(tree: dict, path: list[str], item: str) -> None:
    node = tree
    for i in range(len(path)):
        node = node["children"].setdefault(".".join(path[: i + 1]), _tree())
    node["items"].append(item)


def _count(tree: dict) -> int:
    return len(tree["items"]) + sum(_count(c) for c in tree["children"].values())


def _render_tree(tree: dict, wrap, open_depth: int = 0, depth: int = 0) -> str:
    """Nested <details> per module (open down to `open_depth`); `wrap(items)` renders a module's own items."""
    out = [wrap(tree["items"])] if tree["items"] else []
    for name, child in tree["children"].items():
        inner = _render_tree(child, wrap, open_depth, depth + 1)
        opened = " open" if depth < open_depth else ""
        out.append(f'<details class="tree" data-module="{e(name)}"{opened}><summary>{e(name)}'
                   f'<span class="meta">{_count(child)}</span></summary>{inner}</details>')
    return "\n".join(out)


# ------------------------------------------------------------------------------------------- parameters
def _params(program, pipeline) -> str:
    sizes = program.mesh.sizes
    tree = _tree()
    pp = sizes["pp"]
    for spec in program.params.values():
        holder = "all" if pipeline is None else ",".join(str(r) for r in sorted(pipeline.holders.get(spec.fqn, ())))
        here = pipeline is None or spec.fqn in pipeline.params
        row = (f'<tr class="param" data-fqn="{e(spec.fqn)}"><td class="mono">{e(spec.fqn)}</td>'
               f"<td>{tuple(spec.shape)}</td><td>{tuple(spec.local_shape(sizes))}</td>"
               f"<td>{e(format_placements(spec.placements))}</td><td class=\"num\">"
               f"{human_bytes(spec.local_bytes(sizes))}</td><td>{e(str(spec.dtype).removeprefix('torch.'))}</td>"
               f"<td>{holder if pp > 1 else ''}{'' if here else ' (not this rank)'}</td></tr>")
        _insert(tree, spec.fqn.split(".")[:-1], row)
    head = ("<tr><th>parameter</th><th>global shape</th><th>local shape</th><th>placement</th>"
            "<th class=\"num\">local bytes</th><th>dtype</th><th>pp rank</th></tr>")
    wrap = lambda rows: f"<table>{head}{''.join(rows)}</table>"
    total = sum(s.local_bytes(sizes) for s in program.params.values())
    return (f"<p>{len(program.params)} parameters, {human_bytes(total)} on a rank holding all of them. "
            f'<input type="search" id="param-filter" placeholder="filter by name, e.g. attn or mlp.up"></p>\n'
            f'<div class="tree-root">{_render_tree(tree, wrap, open_depth=1)}</div>')


# ------------------------------------------------------------------------------------------ collectives
def _collectives(compiled, report, hw) -> str:
    sizes = compiled.program.mesh.sizes
    where = {}
    for stage, gm in own_stages(compiled):
        key = section_key(stage, compiled.program.rank)
        for node in gm.graph.nodes:
            if node.meta.get(COMM):
                where.setdefault(node.name, (key, source_line(node, gm)))
    rows, total = [], 0.0
    for c in report.collectives:
        seconds = comm_time(CommRecord(c.kind, c.axis, c.bytes, c.phase, c.why, count=c.count), sizes, hw)
        total += seconds
        key, line = where.get(c.node, (None, ""))
        node = f'<a class="to-node" href="#n-{key}-{e(c.node)}">{e(c.node)}</a>' if key else e(c.node)
        rows.append(f'<tr class="collective"><td>{e(c.kind)}</td><td>{e(c.axis)}</td><td class="num">'
                    f'{human_bytes(c.bytes)}</td><td class="num">{c.count}</td><td>{e(c.phase)}</td>'
                    f'<td class="num">{_seconds(seconds)}</td><td>{node}</td><td>{e(c.why)}</td>'
                    f'<td class="mono">{e(line)}</td></tr>')
    head = ("<tr><th>kind</th><th>axis</th><th class=\"num\">bytes</th><th class=\"num\">count</th><th>phase</th>"
            "<th class=\"num\">predicted</th><th>node</th><th>why</th><th>model source</th></tr>")
    per_axis = ", ".join(f"{a}: {human_bytes(b)}" for a, b in report.bytes_per_step().items()) or "none"
    return (f"<p>{len(report.collectives)} collectives per step (explain()'s census); payload per step {per_axis}; "
            f"predicted {_seconds(total)} on {e(hw.name)} if none overlapped compute.</p>\n"
            f'<table id="collectives-table">{head}{"".join(rows)}</table>')


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.2f} s"


# ------------------------------------------------------------------------------------------------ memory
def _memory(compiled, report, hw, measured) -> str:
    program, pipeline = compiled.program, compiled.pipeline
    mesh = program.mesh
    pp = mesh.sizes["pp"] if pipeline is not None else 1
    by_pp = [compiled_estimate(program, hw, pipeline, pp_rank=r).memory for r in range(pp)]
    per_rank = mesh.world_size <= MAX_MEMORY_ROWS
    rows = []
    for r in range(mesh.world_size) if per_rank else range(pp):
        coord = mesh.coord("pp", r) if per_rank else r
        label = f"rank {r}" + (" (this)" if r == program.rank else "") if per_rank else f"pp rank {r}"
        rows.append((label, by_pp[coord % pp], "predicted"))
        if per_rank and r == program.rank and measured:
            rows.append((f"rank {r} measured", {k: measured.get(k, 0) for k in MEMORY_PARTS}, "measured"))
    scale = max(sum(m.values()) for _, m, _ in rows) or 1
    bars = []
    for label, parts, kind in rows:
        segs = "".join(f'<div class="seg" style="width:{100 * parts.get(k, 0) / scale:.3f}%;background:'
                       f'{PART_COLOURS[k]}" title="{k}: {human_bytes(parts.get(k, 0))}"></div>' for k in MEMORY_PARTS)
        bars.append(f'<div class="bar-row mem-{kind}"><div class="label">{e(label)}</div><div class="track">{segs}'
                    f'</div><div class="mono">&nbsp;{human_bytes(sum(parts.values()))}</div></div>')
    legend = "".join(f'<span><i style="background:{PART_COLOURS[k]}"></i>{k}</span>' for k in MEMORY_PARTS)
    held = ", ".join(f"{k} {human_bytes(v)}" for k, v in report.memory.items())
    how = "every rank" if per_rank else "each pp rank (dp and tp peers hold the same)"
    return (f"<p>Predicted bytes of {how} by part (compiled graphs on {e(hw.name)}); this rank's model state as "
            f"explain() counts it: {held}.</p>\n<p class=\"legend\">{legend}</p>\n"
            f'<div class="bars">{"".join(bars)}</div>')


# ---------------------------------------------------------------------------------------------- schedule
def schedule_timeline(compiled, hardware="h100"):
    """The SimResult of this rank's pipeline schedule with each stage's predicted seconds (None: no pipeline)."""
    pipeline = compiled.pipeline
    if pipeline is None:
        return None
    hw = load_hardware(hardware)
    sizes = compiled.program.mesh.sizes
    times = {s.index: stage_times(graph_cost(s.gm), sizes, hw) for s in pipeline.all_stages}
    parts = {"F": lambda t: t.forward, "B": lambda t: t.backward, "I": lambda t: t.backward / 2,
             "W": lambda t: t.backward / 2}
    cost = lambda a: parts[a.kind](times[a.stage])
    link = hw.link(1, compiled.program.mesh.world_size)
    delay = link.time("send", 2, max(s.sent_bytes for s in pipeline.all_stages)) if pipeline.pp > 1 else 0.0
    return simulate(pipeline.schedule, cost=cost, comm=delay)


def _schedule(compiled, hw) -> str:
    result = schedule_timeline(compiled, hw)
    if result is None:
        return "<p>No pipeline: this plan runs one forward and backward per step on every rank.</p>"
    sched = compiled.pipeline.schedule
    span = result.makespan or 1.0
    rows = []
    for r, spans in enumerate(result.timeline):
        bars = "".join(
            f'<div class="tl-bar {s.action.kind}" data-action="{s.action}" style="left:{100 * s.start / span:.4f}%;'
            f'width:{100 * (s.end - s.start) / span:.4f}%" title="{s.action}: {_seconds(s.start)} → '
            f'{_seconds(s.end)}">{s.action}</div>' for s in spans)
        rows.append(f'<div class="tl-row" data-pp="{r}"><span class="tl-label">pp rank {r}</span>{bars}</div>')
    data = json.dumps({"makespan": result.makespan, "bubble": result.bubble})
    batches = f"{sched.microbatches} micro-batch" + ("es" if sched.microbatches != 1 else "")
    return (f"<p>{e(sched.name)}: {batches} over {sched.pp} pp ranks; simulated with each "
            f"stage's predicted forward and backward time on {e(hw.name)}: step {_seconds(result.makespan)}, bubble "
            f"{result.bubble:.1%} of compute. F forward, B backward (I input gradient, W weight gradient).</p>\n"
            f'<div class="timeline" data-sim=\'{e(data)}\'>{"".join(rows)}</div>')


def _measured(trace) -> str:
    """Each rank's compute, p2p and collective events in the last step of a job.trace file, from its start."""
    if trace is None:
        return ""
    data = trace if isinstance(trace, dict) else json.loads(Path(trace).read_text())
    events = [ev for ev in data.get("traceEvents", []) if ev.get("ph") == "X"]
    names = {ev["pid"]: ev["args"]["name"] for ev in data.get("traceEvents", []) if ev.get("name") == "process_name"}
    rows, longest = [], 0.0
    for pid in sorted({ev["pid"] for ev in events}):
        steps = [ev for ev in events if ev["pid"] == pid and ev["cat"] == "step"]
        if not steps:
            continue
        last = max(steps, key=lambda ev: ev["ts"])
        inside = [ev for ev in events if ev["pid"] == pid and last["ts"] <= ev["ts"] <= last["ts"] + last["dur"]]
        modules = [ev for ev in inside if ev["cat"] == "module" and ev["args"].get("depth") == 1]
        inside = [ev for ev in inside if ev["cat"] in ("compute", "p2p", "collective")]
        rows.append((names.get(pid, f"rank {pid}"), last, inside, modules))
        longest = max(longest, last["dur"])
    span = longest or 1.0
    out = []
    for name, last, inside, modules in rows:
        bars = "".join(
            f'<div class="tl-bar measured {ev["name"][1] if ev["cat"] == "compute" else ev["cat"]}" '
            f'data-cat="{e(ev["cat"])}" style="left:{100 * (ev["ts"] - last["ts"]) / span:.4f}%;'
            f'width:{100 * ev["dur"] / span:.4f}%" title="{e(ev["name"])}: {ev["dur"] / 1e3:.3f} ms">'
            f'{e(ev["name"]) if ev["cat"] == "compute" else ""}</div>' for ev in inside)
        out.append(f'<div class="tl-row measured"><span class="tl-label">{e(name.split(" (")[0])}</span>{bars}</div>')
        if modules:
            out.append(_module_row(modules, last["ts"], span))
    return (f"<p>Measured (job.trace, the last traced step: {span / 1e3:.1f} ms at the longest): compute actions, "
            "messages (grey) and collectives (red) of each rank, and under them the model's top-level modules in "
            f'its forward actions.</p>\n<div class="timeline measured">{"".join(out)}</div>')


def _module_row(modules: list[dict], start: float, span: float) -> str:
    colour = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(sorted({ev["name"] for ev in modules}))}
    bars = "".join(
        f'<div class="tl-bar measured module" data-module="{e(ev["name"])}" style="left:'
        f'{100 * (ev["ts"] - start) / span:.4f}%;width:{100 * ev["dur"] / span:.4f}%;'
        f'background:{colour[ev["name"]]}" '
        f'title="{e(ev["name"])} ({e(ev["args"].get("type", ""))}): {ev["dur"] / 1e3:.3f} ms"></div>' for ev in modules)
    return f'<div class="tl-row measured modules"><span class="tl-label">modules</span>{bars}</div>'
