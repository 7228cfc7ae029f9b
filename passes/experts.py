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
  * or, gathered: `bmm(weight[ids], rows)` (transformers' batched_mm experts), `weight` a 3-D parameter indexed
    by a 1-D tensor of expert ids, one per row; the rows are sorted by id first (then as above) and put back
    in their order after the combine;
  * or, dense: `bmm(rows.view(E, T, H), weight)` (Llama 4: every token through every expert, the router's scores
    applied before), `weight` a 3-D parameter (E, in, out) read as it is, the region's output viewed back to
    (E·T, N) rows: the rows are sorted by expert already, T for each, so the same dispatch moves them
    (an even split) and the view keeps E/ep experts;
  * the grouped matmuls sharing one `offsets` (or one `ids`, or one dense input) are one expert region; the ops
    between them must be row-wise (pointwise ops, splits of the feature dim, dtype casts): then the region is
    computed on the rows of the local experts only. Its one input (the sorted rows) is dispatched before the
    first grouped matmul; its one output is combined after the last. A per-expert bias (E, N) gathered by the
    rows' sorted expert ids (`out + bias[ids]`, GPT-OSS) is read inside the region, by the local ids.
What stops recognition is said in a MeshcWarning naming the node (the experts then stay replicated, which
is correct): a weight that is not a parameter with a leading expert dim, E not divisible by ep, an op in
the region that mixes rows, a tensor read from outside the region (other than such a bias), several
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

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from meshc.compiler.ir.errors import MeshcWarning, warn
from meshc.compiler.ir.fx_ops import grouped_mm_args, is_grouped_mm, is_view, op_short_name
from meshc.compiler.ir.placement import Shard
from meshc.compiler.ir.program import CommRecord, Program
from meshc.runtime.ops.experts import combine, dispatch, even_offsets, local_ids, sort_rows, unsort_rows

from meshc.passes.layout import refresh_vals
from meshc.passes.tp_parts import linear_of_index

AXIS = "ep"
aten = torch.ops.aten
_ADDS = (aten.add.Tensor, aten.add_.Tensor)
# Row-wise beyond pointwise ops: casts, metadata checks, and cuts of the feature dim (checked below).
_ROWWISE = frozenset({"_assert_tensor_metadata", "to", "_to_copy", "clone", "contiguous", "chunk", "split",
                      "split_with_sizes", "slice", "narrow", "getitem", "dropout", "native_dropout"})


@dataclass
class ExpertRegion:
    """One mixture-of-experts layer as found: its grouped matmuls, expert parameters and boundary."""

    offsets: fx.Node | None  # the grouped matmuls' running counts (None in the gathered form)
    matmuls: list[fx.Node]
    params: list[str]  # FQNs with a leading expert dim
    experts: int
    entry: fx.Node | None = None
    exit: fx.Node | None = None
    stopped: list[str] = field(default_factory=list)  # why it cannot be sharded (empty: it can)
    ids: fx.Node | None = None  # the gathered form: each row's expert id, indexing the weights
    weight_at: dict = field(default_factory=dict)  # matmul -> position of its weight argument
    dense: fx.Node | None = None  # the dense form: the view of the rows into (E, T, H) that the first bmm reads
    biases: list[fx.Node] = field(default_factory=list)  # bias[ids] reads of per-expert biases (E, N)

    def rows_of(self, mm: fx.Node) -> fx.Node:
        return mm.args[1 - self.weight_at.get(mm, 1)]

    @property
    def row_dims(self) -> int:
        """The leading dims that index rows (the dense form's (E, T)); the rest are features."""
        return 2 if self.dense is not None else 1


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
        if ep > 1:  # asked for, and nothing to shard: say so rather than train as dp with nothing saved
            loop = _read_one_by_one(program)
            text = (f"experts: ep={ep} found no expert layer (expert weights stacked in one parameter with a leading "
                    "expert dim, read by a grouped matmul, an index by routing ids or a bmm); every rank holds every "
                    "parameter and ep only splits the batch, as dp does. Experts kept in a ModuleList are sharded by "
                    "tp (each expert's MLP column- and row-parallel)" +
                    (f". {loop} is a stack read one expert at a time in a Python loop (`F.linear(rows, weight[i])`): "
                     "ep cannot move rows between the loop's layers; tp shards each of them. To use ep, compute the "
                     "experts as one grouped matmul (torch.nn.functional.grouped_mm) over the stack"
                     if loop else ""))
            warn(text, MeshcWarning)
            program.warnings.append(text)
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


def find_regions(program: Program) -> list[ExpertRegion]:
    """Every expert region of the graph, each with the reasons (if any) it cannot be sharded."""
    fqn_of = {n: n.meta["meshc.fqn"] for n in program.placeholders("param")}
    by_offsets: dict[fx.Node, ExpertRegion] = {}
    dense_at: dict[fx.Node, ExpertRegion] = {}  # nodes computed from a dense region's rows, row-wise
    for node in program.gm.graph.nodes:
        if _dense_step(node, fqn_of, dense_at, by_offsets, program):
            continue
        if _gathered(node, fqn_of):  # weight[ids] @ rows, per row (transformers' batched_mm experts)
            (mm,) = node.users
            ids, param = node.args[1][0], fqn_of[node.args[0]]
            region = by_offsets.setdefault(ids, ExpertRegion(None, [], [], program.params[param].shape[0], ids=ids))
            region.matmuls.append(mm)
            region.weight_at[mm] = mm.args.index(node)
            region.params += [param] if param not in region.params else []
            continue
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
            other = _use_outside(placeholders[fqn], region)
            if other is not None:
                region.stopped.append(f"{fqn} is also used by {other.format_node()}, outside the grouped matmuls")
        if not region.stopped:
            _bound(region, order, fqn_of)
    return list(by_offsets.values())


def _dense_step(node: fx.Node, fqn_of: dict, dense_at: dict, regions: dict, program: Program) -> bool:
    """The dense form, one node at a time in graph order: a bmm over (E, T, H) rows viewed from (E·T, H) by a 3-D
    parameter with E experts starts a region (keyed by the view) or continues the one its rows come from; a
    row-wise op of a region's values carries the region on. True when `node` is such a bmm."""
    region = next((dense_at[a] for a in node.all_input_nodes if a in dense_at), None)
    if node.op != "call_function" or node.target != aten.bmm.default or len(node.args) != 2:
        if region is not None and _rowwise(node, 2):
            dense_at[node] = region
        return False
    rows, weight = node.args
    param = _param_through_views(weight, fqn_of)
    if param is None or len(program.params[param].shape) != 3 or rows is weight:
        return False
    experts = int(program.params[param].shape[0])
    if region is None:
        src = rows.args[0] if rows.op == "call_function" and is_view(rows.target) and rows.args else None
        shape = tuple(rows.meta["val"].shape)
        if not isinstance(src, fx.Node) or src.meta["val"].dim() != 2 or len(shape) != 3 or shape[0] != experts \
                or src.meta["val"].shape[0] != shape[0] * shape[1]:
            return False
        region = regions.setdefault(rows, ExpertRegion(None, [], [], experts, dense=rows))
    elif region.experts != experts:
        return False
    region.matmuls.append(node)
    region.weight_at[node] = 1
    region.params += [param] if param not in region.params else []
    dense_at[node] = region
    return True


def _gathered(node: fx.Node, fqn_of: dict) -> bool:
    """`weight[ids]` of a 3-D parameter by a 1-D index, whose one user is a bmm taking it as one operand."""
    if node.op != "call_function" or node.target != aten.index.Tensor or node.args[0] not in fqn_of:
        return False
    index = node.args[1]
    if len(index) != 1 or not isinstance(index[0], fx.Node) or node.args[0].meta["val"].dim() != 3:
        return False
    ids = index[0].meta.get("val")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point() or len(node.users) != 1:
        return False
    (mm,) = node.users
    return mm.op == "call_function" and mm.target == aten.bmm.default and node in mm.args[:2]


def _use_outside(param: fx.Node, region: ExpertRegion) -> fx.Node | None:
    """A node that uses `param` (through views) other than as a weight of the region's matmuls, if any."""
    stack = [param]
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in region.matmuls and user.args[region.weight_at.get(user, 1)] is node:
                continue
            if region.ids is not None and user.target == aten.index.Tensor and set(user.users) <= set(region.matmuls):
                continue
            if _view_like(user) and user.args[0] is node:
                stack.append(user)
                continue
            return user
    return None


def _param_through_views(node: fx.Node, fqn_of: dict) -> str | None:
    """The parameter `node` is a view of, keeping its leading dim (a transpose of the last two dims)."""
    while node not in fqn_of:
        if not _view_like(node):
            return None
        src = node.args[0]
        if not isinstance(src, fx.Node) or _lead(node) != _lead(src):
            return None
        node = src
    return fqn_of[node]


def _view_like(node: fx.Node) -> bool:
    """A view of its first input, or a cast of it (what may stand between a parameter and its matmul)."""
    return node.op == "call_function" and (is_view(node.target) or op_short_name(node.target) == "to")


def _lead(node: fx.Node):
    val = node.meta.get("val")
    return val.shape[0] if isinstance(val, torch.Tensor) and val.dim() else None


def _bound(region: ExpertRegion, order: dict[fx.Node, int], fqn_of: dict) -> None:
    """Find the region's one input and one output, and check that everything between is row-wise."""
    mms = set(region.matmuls)
    rows = [region.rows_of(mm) for mm in region.matmuls]
    inside = _between(region.matmuls, rows, order)
    entries = {r for r in rows if r not in inside and r not in mms}
    exits = [mm for mm in region.matmuls if any(u not in inside for u in mm.users)]
    if len(entries) != 1:
        region.stopped.append(f"{len(entries)} inputs enter the grouped matmuls (expected the sorted rows alone)")
    if len(exits) != 1:
        region.stopped.append(f"{len(exits)} grouped matmuls feed ops outside the region (expected one output)")
    expert_ids = region.ids if region.offsets is None else _sorted_ids(region.offsets)
    for node in sorted(inside, key=order.__getitem__):
        if not _rowwise(node, region.row_dims):
            region.stopped.append(f"{node.format_node()} is not row-wise (only pointwise ops, casts and cuts of "
                                  f"the feature dim may sit between grouped matmuls)")
        for arg in node.all_input_nodes:
            if arg in inside or arg in mms or not isinstance(arg.meta.get("val"), torch.Tensor) \
                    or arg.meta["val"].dim() == 0:
                continue
            bias = _bias_read(arg, expert_ids, region.experts, fqn_of)
            if bias is not None and len(arg.users) == 1:
                region.biases.append(arg)
                region.params += [bias] if bias not in region.params else []
            else:
                region.stopped.append(f"{node.format_node()} reads {arg.name} from outside the region")
    if not region.stopped:
        region.entry, region.exit = entries.pop(), exits[0]
        while len(region.exit.users) == 1:  # the last matmul's per-expert bias (GPT-OSS's down_proj_bias) joins
            add = next(iter(region.exit.users))
            other = [a for a in add.args if a is not region.exit] if add.target in _ADDS and len(add.args) == 2 else []
            bias = _bias_read(other[0], expert_ids, region.experts, fqn_of) \
                if len(other) == 1 and isinstance(other[0], fx.Node) else None  # not `out + 1`
            if bias is None or len(other[0].users) != 1:
                break
            region.biases.append(other[0])
            region.params.append(bias)
            region.exit = add
        if region.dense is not None:  # the rows before their (E, T, H) view; the output viewed back to rows
            region.entry = region.dense.args[0]
            users = list(region.exit.users)
            if len(users) != 1 or not is_view(users[0].target) or users[0].meta["val"].dim() != 2:
                region.stopped.append(f"{region.exit.format_node()} is not viewed back to (E·T, N) rows alone")
            else:
                region.exit = users[0]


def _sorted_ids(offsets: fx.Node) -> fx.Node | None:
    """The rows' sorted expert ids that the running counts were counted from (`cumsum(histc(ids.float()))`,
    transformers' grouped experts), if that is how they were made."""
    node = offsets
    while node.op == "call_function" and op_short_name(node.target) in ("cumsum", "histc", "bincount", "to",
                                                                         "_to_copy"):
        node = node.args[0]
    return node if node is not offsets and node.op == "call_function" else None


def _bias_read(node: fx.Node, ids: fx.Node | None, experts: int, fqn_of: dict) -> str | None:
    """The per-expert bias parameter (E, N) of `bias[ids]`, read by the region's own expert ids; else None."""
    if ids is None or node.target != aten.index.Tensor or list(node.args[1]) != [ids]:
        return None
    param = _param_through_views(node.args[0], fqn_of)
    if param is None or _lead(node.args[0]) != experts:
        return None
    src = node  # read by this gather alone: a bias used elsewhere too would see only this rank's experts there
    while src not in fqn_of:
        if len(src.args[0].users) != 1:
            return None
        src = src.args[0]
    return param


def _between(mms: list[fx.Node], rows: list[fx.Node], order: dict[fx.Node, int]) -> set[fx.Node]:
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
    above, stack = set(), list(rows)
    while stack:  # ancestors of the matmuls' rows, down to the first one
        node = stack.pop()
        if node in above or node in mms or order[node] < lo:
            continue
        above.add(node)
        stack.extend(node.all_input_nodes)
    return below & above


def _rowwise(node: fx.Node, row_dims: int = 1) -> bool:
    """Does `node` act on each row alone (its first `row_dims` dims index rows)?"""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    name = op_short_name(node.target)
    if name in ("chunk", "split", "split_with_sizes", "slice", "narrow"):
        at = 1 if name in ("slice", "narrow") else 2  # slice(x, dim, start, end, step); split(x, size, dim)
        dim = node.args[at] if len(node.args) > at else node.kwargs.get("dim", 0)
        return dim % node.args[0].meta["val"].dim() >= row_dims
    if name in ("squeeze", "unsqueeze"):  # a size-1 dim in or out beside the rows (the gathered form's bmm)
        return len(node.args) > 1 and isinstance(node.args[1], int) and node.args[1] % (node.args[0].meta["val"].dim()
                                                                                       + (name == "unsqueeze")) != 0
    return name in _ROWWISE or torch.Tag.pointwise in getattr(node.target, "tags", ())


def _shard(program: Program, index: int, region: ExpertRegion, ep: int) -> None:
    """Shard the region's experts over ep and move its rows: dispatch before its first matmul, combine after."""
    group = program.mesh.group_name(AXIS, program.rank)
    _mark_experts(program, region)
    why = f"expert layer {index} ({', '.join(region.params)}): rows to the rank holding their expert"
    parts, offsets, order = _dispatch(program.gm.graph, index, region, ep, group, why)
    _combine(program.gm.graph, index, region, ep, group, offsets, parts, order)


def _mark_experts(program: Program, region: ExpertRegion) -> None:
    """The expert parameters S(0) over ep; the weight, and its views, hold E/ep experts (gathered: the parameter
    alone: weight[ids] has a row per token; likewise a bias read as bias[ids])."""
    for fqn in region.params:
        program.params[fqn].placements[AXIS] = Shard(0)
    weights = [mm.args[region.weight_at.get(mm, 1)] for mm in region.matmuls]
    weights = [w.args[0] for w in weights] if region.ids is not None else weights
    for node in weights + [b.args[0] for b in region.biases]:
        while True:
            node.meta["meshc.placement"] = {**node.meta.get("meshc.placement", {}), AXIS: Shard(0)}
            if node.op == "placeholder":
                break
            node = node.args[0]


def _payload(val: torch.Tensor) -> int:
    """Bytes of an all-to-all's input in the balanced case (a rank receives as many rows as it sends): what the
    rank contributes; the cost model puts (ep-1)/ep of it on the wire, the runtime census counts the real routing's."""
    return int(val.shape[0] * val[0].numel() * val.element_size())


def _dispatch(graph: fx.Graph, index: int, region: ExpertRegion, ep: int, group: str, why: str):
    """Insert the dispatch (sorting the gathered form's rows first) and make the matmuls read local rows and
    local counts (or local ids); returns (dispatch's parts, the running counts it was given, the sort order)."""
    first = region.dense if region.dense is not None else min(region.matmuls, key=list(graph.nodes).index)
    rows_in, offsets, order = region.entry, region.offsets, None
    with graph.inserting_before(first):
        if region.ids is not None:  # sorted by expert first, as the grouped form arrives
            rows_in, offsets, order = _sorted(graph, region, why)
        if region.dense is not None:  # T rows for each expert, in expert order already
            offsets = graph.call_function(even_offsets, (rows_in,), {"experts": region.experts})
            offsets.meta.update({"meshc.why": f"{why}: the same count of rows for each expert",
                                 "meshc.shape": (region.experts,)})
        sent = graph.call_function(dispatch, (rows_in, offsets), {"group": group, "size": ep, "layer": index})
        parts = [graph.call_function(operator.getitem, (sent, i)) for i in range(3)]
    nbytes = _payload(region.entry.meta["val"])
    sent.meta["meshc.why"] = why
    sent.meta["meshc.comm"] = [CommRecord("all_to_all", AXIS, nbytes, "forward", why),
                               CommRecord("all_to_all", AXIS, nbytes, "backward", f"{why}: their gradients back")]
    for i, what in enumerate(("local rows", "local running counts", "counts received")):
        parts[i].meta["meshc.why"] = f"{why}: {what}"
    local = region.experts // ep  # shapes (the rows' is the balanced case's): what placement rules read
    shapes = (region.entry.meta.get("meshc.shape") or tuple(region.entry.meta["val"].shape), (local,), (ep, local))
    sent.meta["meshc.shape"] = shapes
    for part, shape in zip(parts, shapes):
        part.meta["meshc.shape"] = shape
    ids = None
    if region.ids is not None or region.biases:
        with graph.inserting_before(first):
            ids = graph.call_function(local_ids, (parts[0], parts[1]))
        ids.meta.update({"meshc.why": f"{why}: each row's local expert", "meshc.shape": (region.entry.meta["val"].shape[0],)})
    if region.ids is not None:
        for mm in region.matmuls:  # each weight[ids] moves next to its bmm, after the local ids exist
            mm.prepend(mm.args[region.weight_at[mm]])
    for bias in region.biases:  # bias[local ids] of the local experts, read where it is used
        next(iter(bias.users)).prepend(bias)
        bias.update_arg(1, [ids])
    if region.dense is not None:  # the rows' view holds the local experts: (E/ep, ep·T, H)
        _local_view(region.dense, parts[0], local, region.exit)
    for mm in region.matmuls:
        at = region.weight_at.get(mm, 1)
        if mm.args[1 - at] is region.entry:
            mm.update_arg(1 - at, parts[0])
        if region.ids is not None:
            mm.args[at].update_arg(1, [ids])  # weight[local ids] of the local experts
        elif region.dense is None:
            mm.update_arg(2, parts[1])
    return parts, offsets, order


def _local_view(view: fx.Node, rows: fx.Node, local: int, exit: fx.Node) -> None:
    """The dense form's `rows.view(E, T, H)` made `view(E/ep, -1, H)` of the dispatched rows; the shapes of the
    region's values, (E, T, ...) before, become (E/ep, ep·T, ...)."""
    view.update_arg(0, rows)
    view.update_arg(1, [local, -1, *list(view.args[1])[2:]])
    lead = tuple(int(d) for d in (view.meta.get("meshc.shape") or view.meta["val"].shape)[:2])
    stack, seen = [view], set()
    while stack:
        node = stack.pop()
        if node in seen or node is exit:
            continue
        seen.add(node)
        shape = node.meta.get("meshc.shape")
        if isinstance(shape, tuple) and shape and isinstance(shape[0], tuple):  # a tuple of tensors (chunk)
            node.meta["meshc.shape"] = tuple(_local_lead(s, lead, local) for s in shape)
        elif shape is not None:
            node.meta["meshc.shape"] = _local_lead(shape, lead, local)
        stack.extend(node.users)


def _local_lead(shape, lead: tuple[int, int], local: int):
    """(E, T, ...) -> (E/ep, ep·T, ...); other shapes as they are."""
    if shape is None or len(shape) < 2 or tuple(int(d) for d in shape[:2]) != lead:
        return shape
    return (local, lead[0] * lead[1] // local, *shape[2:])


def _combine(graph: fx.Graph, index: int, region: ExpertRegion, ep: int, group: str, offsets: fx.Node,
             parts: list[fx.Node], order: fx.Node | None) -> None:
    """Insert the combine after the region's output (and the gathered form's unsort) and route its users there."""
    why = f"expert layer {index}: computed rows back to the rank they came from, in their order"
    with graph.inserting_after(region.exit):
        back = graph.call_function(combine, (region.exit, parts[2], offsets), {"group": group, "size": ep})
    nbytes = _payload(region.exit.meta["val"])
    back.meta["meshc.why"] = why
    back.meta["meshc.comm"] = [CommRecord("all_to_all", AXIS, nbytes, "forward", why),
                               CommRecord("all_to_all", AXIS, nbytes, "backward", f"{why}: gradients")]
    out = back
    if order is not None:
        with graph.inserting_after(back):
            out = graph.call_function(unsort_rows, (back, order))
        out.meta["meshc.why"] = f"{why}: unsorted"
    for node in {back, out}:
        for key in ("meshc.shape", "meshc.placement"):
            if key in region.exit.meta:
                node.meta[key] = region.exit.meta[key]
    region.exit.replace_all_uses_with(out, delete_user_cb=lambda user: user is not back)


def _sorted(graph: fx.Graph, region: ExpertRegion, why: str) -> tuple[fx.Node, fx.Node, fx.Node]:
    """The gathered form's rows sorted by expert id: (rows, running counts per expert, the order)."""
    srt = graph.call_function(sort_rows, (region.entry, region.ids), {"experts": region.experts})
    parts = [graph.call_function(operator.getitem, (srt, i)) for i in range(3)]
    rows = tuple(region.entry.meta.get("meshc.shape") or region.entry.meta["val"].shape)
    shapes = (rows, (region.experts,), (rows[0],))
    srt.meta.update({"meshc.why": f"{why}: sorted by expert", "meshc.shape": shapes})
    for part, shape in zip(parts, shapes):
        part.meta.update({"meshc.why": f"{why}: sorted by expert", "meshc.shape": shape})
    return parts[0], parts[1], parts[2]


def _read_one_by_one(program: Program) -> str | None:
    """The FQN of a 3-D parameter read only as `weight[i]` by linear layers, one per index (JetMoE's loop), if any."""
    for fqn, node in program.param_nodes().items():
        if len(node.users) > 1 and all(linear_of_index(u, node) for u in node.users):
            return fqn
    return None


def _where(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    module = list(stack.values())[-1][0] if stack else ""
    return module or f"%{node.name}"
