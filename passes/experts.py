"""experts: expert parallelism, found in the graph: expert weights sharded over ep, tokens moved by all-to-all.

Purpose: a mixture-of-experts layer keeps most of a model's bytes in its experts. This pass finds them from
the ATen graph alone (no module class is looked at) and shards them over the `ep` axis (a sub-group of dp,
compiler/ir/mesh_spec.py): each rank of an ep group holds E/ep consecutive experts, and the rows routed to
an expert another rank holds travel there and back by `all_to_all_single` (runtime/ops/experts.py),
dropless: every row is computed, as in the single process.

Recognition (as rules over ops and data flow):
  * a grouped matmul `grouped_mm(rows, weight, offsets)` (transformers' `grouped_mm_fallback`, torch's
    `_grouped_mm`): rows sorted by expert, `offsets` the running count per expert, `weight` a parameter
    with a leading expert dim E = len(offsets), read through views (a transpose);
  * the grouped matmuls sharing one `offsets` are one expert region; the ops between them must be
    row-wise (pointwise ops, splits of the feature dim, dtype casts): then the region is computed on the
    rows of the local experts only. Its one input (the sorted rows) is dispatched before the first grouped
    matmul; its one output is combined after the last.
What stops recognition is said in a MeshcWarning naming the node (the experts then stay replicated, which
is correct): a weight that is not a parameter with a leading expert dim, E not divisible by ep, an op in
the region that mixes rows, a tensor read from outside the region (a bias gathered per row), several
inputs or outputs.

Requires: "val" on every node; runs before tensor_parallel (which sees the experts' local shapes).
Ensures: expert parameters have placements["ep"] = S(0) and "ep" in Program.local_axes (placeholders hold
    E/ep experts); each region is `dispatch -> grouped matmuls on local offsets -> combine`, both nodes with
    "meshc.why" and forward/backward all_to_all CommRecords on ep; Program.experts lists what was found.
    With ep = 1 the graph is unchanged and the notes say which experts ep would shard.
Terms: S rows = tokens × top-k; E experts; El = E/ep local experts; H the rows' width at the region's input.

Before:
    %mm = transformers.grouped_mm_fallback(%rows, %transpose_w1, %offsets)      w1: (E, 2I, H)
    %act = ...row-wise ops of %mm...
    %mm_1 = transformers.grouped_mm_fallback(%act, %transpose_w2, %offsets)     w2: (E, H, I)
    %out = aten.mul(%mm_1, %weights)
After (ep=2):
    %dispatch = dispatch(%rows, %offsets, group='ep:0,1', size=2)              w1: (E/2, 2I, H)
    %mm = transformers.grouped_mm_fallback(%getitem, %transpose_w1, %getitem_1)
    ...
    %mm_1 = transformers.grouped_mm_fallback(%act, %transpose_w2, %getitem_1)
    %combine = combine(%mm_1, %getitem_2, %offsets, group='ep:0,1', size=2)
    %out = aten.mul(%combine, %weights)
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from meshc.compiler.ir.errors import MeshcWarning, warn
from meshc.compiler.ir.fx_ops import grouped_mm_args, is_grouped_mm, is_view, op_short_name
from meshc.compiler.ir.placement import Shard
from meshc.compiler.ir.program import CommRecord, Program
from meshc.runtime.ops.experts import combine, dispatch

from .tensor_parallel import refresh_vals

AXIS = "ep"
# Row-wise beyond pointwise ops: casts, metadata checks, and cuts of the feature dim (checked below).
_ROWWISE = frozenset({"_assert_tensor_metadata", "to", "_to_copy", "clone", "contiguous", "chunk", "split",
                      "split_with_sizes", "slice", "narrow", "getitem", "dropout", "native_dropout"})


@dataclass
class ExpertRegion:
    """One mixture-of-experts layer as found: its grouped matmuls, expert parameters and boundary."""

    offsets: fx.Node
    matmuls: list[fx.Node]
    params: list[str]  # FQNs with a leading expert dim
    experts: int
    entry: fx.Node | None = None
    exit: fx.Node | None = None
    stopped: list[str] = field(default_factory=list)  # why it cannot be sharded (empty: it can)


def experts_pass(program: Program) -> Program:
    program = program.copy()
    regions = find_regions(program)
    ep = program.mesh.size(AXIS)
    for region in regions:
        if not region.stopped and region.experts % ep:
            region.stopped.append(f"{region.experts} experts do not divide over ep={ep}")
        for why in region.stopped:
            if ep > 1:
                warn(f"experts: the experts of {_where(region.matmuls[0])} stay replicated: {why}; they are "
                     f"correct but every rank holds and computes all of them", MeshcWarning)
                program.warnings.append(f"experts stay replicated ({_where(region.matmuls[0])}): {why}")
    program.experts = regions
    good = [r for r in regions if not r.stopped]
    if not regions:
        program.notes.append("no expert layer found (no grouped matmul over a parameter with a leading expert dim)")
        return program
    names = "; ".join(f"{', '.join(r.params)} ({r.experts} experts)" for r in regions)
    if ep == 1:
        program.notes.append(f"experts found, replicated (ep = 1): {names}")
        return program
    for index, region in enumerate(good):
        _shard(program, index, region, ep)
    if good:
        program.local_axes = program.local_axes | {AXIS}
        program.gm.recompile()
        refresh_vals(program)
    program.notes.append(f"{len(good)} of {len(regions)} expert layer(s) sharded over ep={ep}: {names}")
    return program


def grouped_mm_flops(node: fx.Node) -> float:
    """Forward FLOPs of a grouped matmul: every row meets one expert's (K, N) matrix, 2·rows·K·N (the batched
    form, 3-D rows without offsets: 2·B·M·K·N)."""
    rows, weight, _, _ = grouped_mm_args(node)
    rows, weight = rows.meta["val"], weight.meta["val"]
    return 2.0 * math.prod(rows.shape[:-1]) * weight.shape[-2] * weight.shape[-1]


def find_regions(program: Program) -> list[ExpertRegion]:
    """Every expert region of the graph, each with the reasons (if any) it cannot be sharded."""
    fqn_of = {n: n.meta["meshc.fqn"] for n in program.placeholders("param")}
    by_offsets: dict[fx.Node, ExpertRegion] = {}
    for node in program.gm.graph.nodes:
        if not is_grouped_mm(node):
            continue
        rows, weight, offsets, bias = grouped_mm_args(node)
        if not isinstance(offsets, fx.Node):  # the batched form: no rows sorted by expert
            continue
        experts = int(offsets.meta["val"].shape[0])
        region = by_offsets.setdefault(offsets, ExpertRegion(offsets, [], [], experts))
        region.matmuls.append(node)
        param = _param_through_views(weight, fqn_of)
        if param is None or program.params[param].shape[0] != experts:
            region.stopped.append(f"the weight of {node.format_node()} is not a parameter with a leading dim of "
                                  f"{experts} experts read through views")
        elif param not in region.params:
            region.params.append(param)
        if bias is not None:
            region.stopped.append(f"{node.format_node()} adds a per-expert bias (not sharded with its experts)")
    order = {n: i for i, n in enumerate(program.gm.graph.nodes)}
    placeholders = program.param_nodes()
    for region in by_offsets.values():
        for fqn in region.params:  # a weight read elsewhere too would read only this rank's experts there
            other = _use_outside(placeholders[fqn], set(region.matmuls))
            if other is not None:
                region.stopped.append(f"{fqn} is also used by {other.format_node()}, outside the grouped matmuls")
        if not region.stopped:
            _bound(region, order)
    return list(by_offsets.values())


def _use_outside(param: fx.Node, matmuls: set[fx.Node]) -> fx.Node | None:
    """A node that uses `param` (through views) other than as a weight of `matmuls`, if any."""
    stack = [param]
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in matmuls and user.args[1] is node:
                continue
            if user.op == "call_function" and (is_view(user.target) or op_short_name(user.target) == "to") \
                    and user.args[0] is node:
                stack.append(user)
                continue
            return user
    return None


def _param_through_views(node: fx.Node, fqn_of: dict) -> str | None:
    """The parameter `node` is a view of, keeping its leading dim (a transpose of the last two dims)."""
    while node not in fqn_of:
        if node.op != "call_function" or not is_view(node.target) and op_short_name(node.target) not in ("to",):
            return None
        src = node.args[0]
        if not isinstance(src, fx.Node) or _lead(node) != _lead(src):
            return None
        node = src
    return fqn_of[node]


def _lead(node: fx.Node):
    val = node.meta.get("val")
    return val.shape[0] if isinstance(val, torch.Tensor) and val.dim() else None


def _bound(region: ExpertRegion, order: dict[fx.Node, int]) -> None:
    """Find the region's one input and one output, and check that everything between is row-wise."""
    mms = set(region.matmuls)
    inside = _between(region.matmuls, order)
    entries = {mm.args[0] for mm in region.matmuls if mm.args[0] not in inside and mm.args[0] not in mms}
    exits = [mm for mm in region.matmuls if any(u not in inside for u in mm.users)]
    if len(entries) != 1:
        region.stopped.append(f"{len(entries)} inputs enter the grouped matmuls (expected the sorted rows alone)")
    if len(exits) != 1:
        region.stopped.append(f"{len(exits)} grouped matmuls feed ops outside the region (expected one output)")
    for node in sorted(inside, key=order.__getitem__):
        if not _rowwise(node):
            region.stopped.append(f"{node.format_node()} is not row-wise (only pointwise ops, casts and cuts of "
                                  f"the feature dim may sit between grouped matmuls)")
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in mms and isinstance(arg.meta.get("val"), torch.Tensor) \
                    and arg.meta["val"].dim() > 0:
                region.stopped.append(f"{node.format_node()} reads {arg.name} from outside the region")
    if not region.stopped:
        region.entry, region.exit = entries.pop(), exits[0]


def _between(mms: list[fx.Node], order: dict[fx.Node, int]) -> set[fx.Node]:
    """Nodes on a path from one grouped matmul to another's rows (both excluded), searched only between the
    first and the last of them in graph order."""
    lo, hi = min(order[m] for m in mms), max(order[m] for m in mms)
    below, stack = set(), [u for m in mms for u in m.users]
    while stack:  # descendants of the matmuls, up to the last one
        node = stack.pop()
        if node in below or node in mms or order[node] > hi:
            continue
        below.add(node)
        stack.extend(node.users)
    above, stack = set(), [m.args[0] for m in mms]
    while stack:  # ancestors of the matmuls' rows, down to the first one
        node = stack.pop()
        if node in above or node in mms or order[node] < lo:
            continue
        above.add(node)
        stack.extend(node.all_input_nodes)
    return below & above


def _rowwise(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    name = op_short_name(node.target)
    if name in ("chunk", "split", "split_with_sizes", "slice", "narrow"):
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        return dim != 0
    return name in _ROWWISE or torch.Tag.pointwise in getattr(node.target, "tags", ())


def _shard(program: Program, index: int, region: ExpertRegion, ep: int) -> None:
    graph, mesh = program.gm.graph, program.mesh
    group = mesh.group_name(AXIS, program.rank)
    for fqn in region.params:
        program.params[fqn].placements[AXIS] = Shard(0)
    for mm in region.matmuls:  # the weight, and its views, hold E/ep experts
        node = mm.args[1]
        while True:
            node.meta["meshc.placement"] = {**node.meta.get("meshc.placement", {}), AXIS: Shard(0)}
            if node.op == "placeholder":
                break
            node = node.args[0]
    rows_val = region.entry.meta["val"]
    out_val = region.exit.meta["val"]
    # Payloads (what this rank contributes; the cost model puts (ep-1)/ep of it on the wire) in the balanced
    # case: a rank receives as many rows as it sends. The runtime census counts the real routing's.
    rows, width_in, width_out = rows_val.shape[0], rows_val[0].numel(), out_val[0].numel()
    nbytes_in = int(rows * width_in * rows_val.element_size())
    nbytes_out = int(rows * width_out * out_val.element_size())
    why = f"expert layer {index} ({', '.join(region.params)}): rows to the rank holding their expert"
    first = min(region.matmuls, key=lambda n: list(graph.nodes).index(n))
    with graph.inserting_before(first):
        sent = graph.call_function(dispatch, (region.entry, region.offsets),
                                   {"group": group, "size": ep, "layer": index})
        parts = [graph.call_function(operator.getitem, (sent, i)) for i in range(3)]
    sent.meta["meshc.why"] = why
    sent.meta["meshc.comm"] = [CommRecord("all_to_all", AXIS, nbytes_in, "forward", why),
                               CommRecord("all_to_all", AXIS, nbytes_in, "backward", f"{why}: their gradients back")]
    for i, what in enumerate(("local rows", "local running counts", "counts received")):
        parts[i].meta["meshc.why"] = f"{why}: {what}"
    local = region.experts // ep  # shapes (the rows' is the balanced case's): what placement rules read
    shapes = (region.entry.meta.get("meshc.shape") or tuple(rows_val.shape), (local,), (ep, local))
    sent.meta["meshc.shape"] = shapes
    for part, shape in zip(parts, shapes):
        part.meta["meshc.shape"] = shape
    for mm in region.matmuls:
        if mm.args[0] is region.entry:
            mm.update_arg(0, parts[0])
        mm.update_arg(2, parts[1])
    back_why = f"expert layer {index}: computed rows back to the rank they came from, in their order"
    with graph.inserting_after(region.exit):
        back = graph.call_function(combine, (region.exit, parts[2], region.offsets), {"group": group, "size": ep})
    back.meta["meshc.why"] = back_why
    back.meta["meshc.comm"] = [CommRecord("all_to_all", AXIS, nbytes_out, "forward", back_why),
                               CommRecord("all_to_all", AXIS, nbytes_out, "backward", f"{back_why}: gradients")]
    for key in ("meshc.shape", "meshc.placement"):
        if key in region.exit.meta:
            back.meta[key] = region.exit.meta[key]
    region.exit.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)


def _where(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    module = list(stack.values())[-1][0] if stack else ""
    return module or f"%{node.name}"
