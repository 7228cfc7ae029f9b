"""show(gm): a transformed graph, one node per line, with its shape, placement and collectives.

    %grad_sync = grad_sync(%p_w, %p_b, group='3', size=2)   # all_reduce dp 1.0 KiB backward | data parallel: ...
    %linear = aten.linear(%x, %getitem, %getitem_1)         (8, 16, 32) dp:R
"""
from __future__ import annotations

import sys
from typing import Any, TextIO

import torch
import torch.fx as fx

from meshc.compiler.ir.fx_ops import op_name
from meshc.compiler.ir.placement import format_placements


def format_graph(gm: fx.GraphModule, program: Any = None) -> str:
    """The annotated listing of `gm` as text (`program`, if given, adds parameter placements)."""
    lines = []
    specs = {}
    if program is not None:
        specs = {**program.params, **program.buffers}
    for node in gm.graph.nodes:
        text = _node_text(node)
        notes = []
        shape = _shape(node)
        if shape:
            notes.append(shape)
        placement = node.meta.get("meshc.placement")
        fqn = node.meta.get("meshc.fqn")
        if placement is None and fqn in specs:
            placement = specs[fqn].placements
        if placement:
            notes.append(format_placements(placement))
        if fqn:
            notes.append(fqn)
        comm = node.meta.get("meshc.comm")
        if comm:
            notes.append("; ".join(f"{c.kind} {c.axis} {human_bytes(c.bytes)} {c.phase}" for c in comm))
        why = node.meta.get("meshc.why")
        if why and comm:
            notes.append(f"| {why}")
        lines.append(f"{text:<72}  {'  '.join(notes)}".rstrip())
    return "\n".join(lines) + "\n"


def show(gm: Any, file: TextIO | None = None) -> None:
    """Print a GraphModule (or a Program's graph) with its placement and collective annotations."""
    program = gm if hasattr(gm, "gm") and hasattr(gm, "params") else None
    text = format_graph(program.gm if program else gm, program)
    (file or sys.stdout).write(text)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _shape(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return "(" + ", ".join(str(d) for d in val.shape) + ")"
    return ""


def _node_text(node: fx.Node) -> str:
    if node.op == "placeholder":
        return f"%{node.name} = input"
    if node.op == "output":
        return f"return {_arg(node.args[0])}"
    if node.op == "get_attr":
        return f"%{node.name} = self.{node.target}"
    args = [_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]
    return f"%{node.name} = {_target(node)}({', '.join(args)})"


def _target(node: fx.Node) -> str:
    return op_name(node.target).replace("::", ".")  # "aten::add.Tensor" -> "aten.add.Tensor"


def _arg(a: Any) -> str:
    if isinstance(a, fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, torch.dtype):
        return str(a).replace("torch.", "")
    return repr(a)
