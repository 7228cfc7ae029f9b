"""The graph section's groups (compiler/report/graph.py): a stage graph's nodes by module, identical blocks folded.

Each node sits under its full module path, the innermost entry of node.meta["nn_module_stack"] that torch.export
keeps (`blocks.3.attn.qkv`); groups nest by path (`blocks.3` > `blocks.3.attn` > `blocks.3.attn.qkv`) and each
stands where its first node is in program order, so a module's nodes stay together even where a pass put others
between them. Nodes without a module path:

  inputs  placeholders: the `(inputs)` group, first;
  step    the step's own nodes, outside the model's modules: gradient-sync and ZeRO buckets (meta
          "meshc.bucket"), their getitems, what feeds only them (a ZeRO gather's start), the graph's output,
          and whatever has no neighbour in a module: the `(step)` group, last;
  module  any other node a pass inserted without a path (an expert dispatch) joins the module of its nearest
          producer or consumer that has one (breadth-first over the graph's edges, inputs before users).

Consecutive siblings `blocks.i`, `blocks.i+1`, ... that run the same ops (`signature`: each node's path inside
the block, its target, placement and collectives, in order) fold into one entry, "blocks.0–11, 12 identical",
which holds every member (the first open, the others collapsed) so that each node stays in the page and the
collectives table can link to it; a block that differs (a pipeline stage's first or last) stands apart. A
module list (`blocks`: no node of its own, only indexed members) is no level of its own: its members sit with
its siblings.
"""
from __future__ import annotations

import html
import operator
import re

from meshc.compiler.ir.placement import format_placements
from meshc.compiler.ir.program import BUCKET, COMM, PLACEMENT

INPUTS, STEP = "(inputs)", "(step)"
_INDEXED = re.compile(r"^(.*)\.(\d+)$")
e = html.escape


def own_path(node) -> str | None:
    """The node's full module path ("" for the model's own forward code), None without nn_module_stack."""
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else None


def node_paths(nodes) -> dict:
    """Each node's group: its module path, INPUTS or STEP (see the module's doc)."""
    nodes = list(nodes)
    own = {n: own_path(n) for n in nodes}
    step = step_nodes(nodes, own)
    out = {}
    for n in nodes:
        if own[n] is not None:
            out[n] = own[n]
        elif n.op == "placeholder":
            out[n] = INPUTS
        elif n in step:
            out[n] = STEP
        else:
            near = _nearest(n, own)
            out[n] = STEP if near is None else near
    return out


def step_nodes(nodes: list, own: dict) -> set:
    """The nodes without a module path that serve the step: buckets (gradient sync, ZeRO), the getitems of one,
    the output, and the nodes whose every user is one of those."""
    loose = [n for n in nodes if own[n] is None and n.op != "placeholder"]
    step = {n for n in loose if BUCKET in n.meta or n.op == "output"}
    for n in loose:
        if n.target is operator.getitem and n.args and n.args[0] in step:
            step.add(n)
    for n in reversed(loose):
        if n.op == "call_function" and n.users and all(u in step for u in n.users):
            step.add(n)
    return step


def _nearest(node, own: dict) -> str | None:
    """The module path of the nearest node with one, breadth-first over producers and consumers."""
    seen, frontier = {node}, [node]
    while frontier:
        after = []
        for n in frontier:
            for m in [*n.all_input_nodes, *n.users]:
                if m in seen:
                    continue
                seen.add(m)
                if own.get(m) is not None:
                    return own[m]
                after.append(m)
        frontier = after
    return None


# ------------------------------------------------------------------------------------------------- the tree
def _group(name: str) -> dict:
    return {"name": name, "items": []}


def module_tree(nodes, paths: dict) -> dict:
    """The root group: `(inputs)`, then the model's modules and top-level nodes in program order, then `(step)`.
    A group is {"name", "items"}; an item is a node or a group."""
    root, inputs, step = _group(""), _group(INPUTS), _group(STEP)
    index = {"": root}
    for n in nodes:
        path = paths[n]
        if path in (INPUTS, STEP):
            (inputs if path == INPUTS else step)["items"].append(n)
            continue
        parts = [p for p in path.split(".") if p]
        group = root
        for i in range(len(parts)):
            name = ".".join(parts[: i + 1])
            if name not in index:
                index[name] = _group(name)
                group["items"].append(index[name])
            group = index[name]
        group["items"].append(n)
    root["items"] = [g for g in (inputs,) if g["items"]] + root["items"] + [g for g in (step,) if g["items"]]
    return root


def is_group(item) -> bool:
    return isinstance(item, dict) and "items" in item


def is_fold(item) -> bool:
    return isinstance(item, dict) and "members" in item


def walk(item):
    """(group name, node) of every node under `item` (a node, group or fold), in the tree's order."""
    if is_fold(item):
        for member in item["members"]:
            yield from walk(member)
    elif is_group(item):
        for sub in item["items"]:
            if is_group(sub) or is_fold(sub):
                yield from walk(sub)
            else:
                yield item["name"], sub


def signature(group: dict) -> tuple:
    """What a block runs: each node's module path inside the block, op, placement and collectives, in order."""
    base = len(group["name"])
    return tuple((name[base:], *_op(n)) for name, n in walk(group))


def _op(node) -> tuple:
    """A node's target, placement and collectives; a call_module's (a remat region) is its submodule's ops."""
    placement = node.meta.get(PLACEMENT)
    comms = tuple((r.kind, r.axis, r.phase, r.bytes, r.count) for r in node.meta.get(COMM) or ())
    target = str(node.target)
    if node.op == "call_module" and node.graph.owning_module is not None:
        sub = node.graph.owning_module.get_submodule(node.target)
        graph = getattr(sub, "graph", None)
        target = (type(sub).__name__, tuple(_op(n) for n in graph.nodes) if graph is not None else ())
    return node.op, target, format_placements(placement) if placement else "", comms


# ------------------------------------------------------------------------------------------------- folding
def fold(group: dict, same=None) -> dict:
    """Fold consecutive indexed siblings with one signature (`same(a, b)` compares two groups; default: equal
    signatures) and lift a module list's members into its parent; in place, returns `group`."""
    same = same or (lambda a, b: signature(a) == signature(b))
    group["items"] = _fold_runs(_lifted(group["items"], same), same)
    return group


def _lifted(items: list, same) -> list:
    out = []
    for item in items:
        if not is_group(item):
            out.append(item)
        elif _is_list(item):
            out += _lifted(item["items"], same)
        else:
            out.append(fold(item, same))
    return out


def _index(item) -> tuple[str, int] | None:
    match = _INDEXED.match(item["name"]) if is_group(item) else None
    return (match.group(1), int(match.group(2))) if match else None


def _is_list(group: dict) -> bool:
    return bool(group["items"]) and all(_index(i) and _index(i)[0] == group["name"] for i in group["items"])


def _fold_runs(items: list, same) -> list:
    runs: list[list] = []
    for item in items:
        last = runs[-1][-1] if runs else None
        at, before = _index(item), _index(last) if last is not None else None
        if at and before and at == (before[0], before[1] + 1) and same(runs[-1][0], item):
            runs[-1].append(item)
        else:
            runs.append([item])
    return [run[0] if len(run) == 1 else {"members": run} for run in runs]


def fold_label(fold_item: dict) -> str:
    """ "blocks.0–11, 12 identical" """
    members = fold_item["members"]
    prefix, first = _index(members[0])
    return f"{prefix}.{first}–{_index(members[-1])[1]}, {len(members)} identical"


# ------------------------------------------------------------------------------------------------- the page
def render(items: list, node_html: dict) -> str:
    """The groups as nested <details> (collapsed; a fold's first member open), nodes as `node_html[node]`."""
    out = []
    for item in items:
        if is_fold(item):
            members = item["members"]
            size = sum(1 for _ in walk(members[0]))
            inner = [_details(m, node_html, opened=i == 0) for i, m in enumerate(members)]
            name = fold_label(item)
            out.append(f'<details class="tree fold" data-module="{e(name.split(",")[0])}" '
                       f'data-count="{len(members)}"><summary class="{_comm_class(item)}">{e(name)}'
                       f'<span class="meta">{len(members)} × {_nodes(size)}</span></summary>{"".join(inner)}</details>')
        elif is_group(item):
            out.append(_details(item, node_html))
        else:
            out.append(node_html[item])
    return "\n".join(out)


def _details(group: dict, node_html: dict, opened: bool = False) -> str:
    count = sum(1 for _ in walk(group))
    note = ", outside the model's modules" if group["name"] == STEP else ""
    return (f'<details class="tree" data-module="{e(group["name"])}"{" open" if opened else ""}>'
            f'<summary class="{_comm_class(group)}">{e(group["name"])}<span class="meta">{_nodes(count)}{note}</span>'
            f'</summary>{render(group["items"], node_html)}</details>')


def _nodes(count: int) -> str:
    return f"{count} node" + ("" if count == 1 else "s")


def _comm_class(item) -> str:
    return "has-comm" if any(n.meta.get(COMM) for _, n in walk(item)) else ""
