"""The invariants every pass must leave true; `verify(program)` raises MeshcInternalError if one is broken.

1. The graph lints (fx's own checks: defined-before-use, one output, well-formed nodes).
2. Placeholders come first, in the order params, buffers, user inputs, and match the Program's specs
   one to one (every spec has exactly one placeholder with its FQN).
3. Every ParamSpec has a placement for every mesh axis, and each Shard dim divides evenly.
4. Every node meshc inserted (a meshc.* call, or a node with "meshc.comm") says why ("meshc.why").
5. Node metadata meshc writes uses only its known keys (ir/program.py's META_KEYS).
6. The value meta of each param placeholder, where present, has the local shape its placements imply on
   the axes the graph has been made local for (Program.local_axes); every value with a tp placement has
   the local shape of its global "meshc.shape".
"""
from __future__ import annotations

from meshc.compiler.ir.errors import MeshcInternalError
from meshc.compiler.ir.placement import Shard, local_length, owned_elsewhere
from meshc.compiler.ir.program import META_KEYS, Program
from meshc.compiler.ir.sizes import sizes_of


def verify(program: Program, after_pass: str | None = None) -> None:
    problems = list(_problems(program))
    if problems:
        where = f" after pass {after_pass!r}" if after_pass else ""
        raise MeshcInternalError(f"verify{where}: {len(problems)} broken invariant(s):\n  " + "\n  ".join(problems))


def _problems(program: Program):
    graph = program.gm.graph
    try:
        graph.lint()
    except Exception as e:  # noqa: BLE001 - reported as a broken invariant
        yield f"graph lint: {e}"
    roles = []
    seen_call = False
    for node in graph.nodes:
        if node.op == "placeholder":
            if seen_call:
                yield f"placeholder after a computation: {node.format_node()}"
            roles.append((node.meta.get("meshc.role"), node.meta.get("meshc.fqn"), node))
        else:
            seen_call = True
        for key in node.meta:
            if key.startswith("meshc.") and key not in META_KEYS:
                yield f"unknown meta key {key!r} on {node.format_node()}"
        inserted = node.op == "call_function" and getattr(node.target, "__module__", "").startswith("meshc.")
        if (inserted or "meshc.comm" in node.meta) and not node.meta.get("meshc.why"):
            yield f"inserted node without meshc.why: {node.format_node()}"
    rank = {"param": 0, "buffer": 1, "input": 2}
    order = [rank.get(r, -1) for r, _, _ in roles]
    if -1 in order:
        bad = roles[order.index(-1)][2]
        yield f"placeholder without a meshc.role: {bad.format_node()}"
    elif order != sorted(order):
        yield "placeholders are not ordered params, buffers, inputs"
    for role, specs in (("param", program.params), ("buffer", program.buffers)):
        fqns = [fqn for r, fqn, _ in roles if r == role]
        if fqns != list(specs):
            missing = set(specs) - set(fqns)
            extra = set(fqns) - set(specs)
            yield f"{role} placeholders differ from the specs (missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]})"
    if len([r for r, _, _ in roles if r == "input"]) != len(program.input_names):
        yield "user-input placeholders differ from Program.input_names"
    sizes = program.mesh.sizes
    nodes = {fqn: n for _, fqn, n in roles if fqn}
    for spec in list(program.params.values()) + list(program.buffers.values()):
        if set(spec.placements) != set(sizes):
            yield f"{spec.fqn}: placements {spec.placements} do not cover the mesh axes {tuple(sizes)}"
            continue
        for axis, p in spec.placements.items():
            if isinstance(p, Shard) and spec.shape[p.dim] % sizes[axis]:
                yield f"{spec.fqn}: dim {p.dim} of size {spec.shape[p.dim]} sharded over {axis}={sizes[axis]} unevenly"
        val = nodes[spec.fqn].meta.get("val") if spec.fqn in nodes else None
        want = spec.local_shape(sizes, program.local_axes)
        if val is not None and hasattr(val, "shape") and tuple(val.shape) != want:
            yield f"{spec.fqn}: placeholder shape {tuple(val.shape)} != local shape {want}"
    if "tp" in program.local_axes:
        yield from _local_values(program)


def _local_values(program: Program):
    n = program.mesh.size("tp")
    ep = program.mesh.size("ep")
    for node in program.gm.graph.nodes:
        if node.op == "placeholder" and node.meta.get("meshc.role") in ("param", "buffer"):
            continue  # checked against their ParamSpec above (a ZeRO-3 placeholder holds a flat shard)
        placement = node.meta.get("meshc.placement", {}).get("tp")
        shape, val = node.meta.get("meshc.shape"), node.meta.get("val")
        if placement is None or shape is None:
            continue
        expert = node.meta.get("meshc.placement", {}).get("ep")  # a view of expert weights (experts pass)
        pairs = zip(placement, shape, val) if isinstance(placement, tuple) else [(placement, shape, val)]
        for p, s, v in pairs:
            if s is None or not hasattr(v, "shape"):
                continue
            want = [d if isinstance(d, int) else None for d in sizes_of(s)]
            if isinstance(p, Shard):
                want[p.dim] = local_length(p, want[p.dim], n)
            if owned_elsewhere(p, program.mesh.coord("tp", program.rank)) and want:
                want[0] = 0  # another rank's whole
            if isinstance(expert, Shard):
                want[expert.dim] //= ep
            # a dim known only at run time (rows routed to an expert) is never the sharded one: not compared
            if [d for d, w in zip(v.shape, want) if w is not None] != [w for w in want if w is not None] \
                    or len(v.shape) != len(want):
                yield f"{node.format_node()}: local shape {tuple(v.shape)} != {tuple(want)} for {p} of {tuple(s)}"
