"""The cost model's compiled path: memory and step time read off a rank's transformed graphs.

Where compiler/cost/formulas.py evaluates formulas of a model's sizes, this file measures the Program the passes
produced for one rank: every parameter's local bytes under its placements and ZeRO stage (as the
runtime holds them), the activations autograd will keep for backward (from each op's saved tensors,
under the remat policy of each checkpointed block), FLOPs and bytes of every node (a roofline per node
on the hardware profile), every collective the passes recorded (kind, axis, bytes, count, phase), and,
for a pipeline, the schedule simulated with each stage's own costs.

Terms: node cost = max-free roofline: FLOPs / device FLOP/s + bytes touched / memory bandwidth, plus
op overhead per op; backward = 2 × forward in FLOPs and bytes; saved bytes = bytes of the distinct
storages that ops keep for backward (views share their base's storage); in flight = micro-batches of
activations a rank holds at the schedule's peak (compiler/ir/schedule_sim).

Zero-bubble (a schedule with I and W actions): I and W each cost half of B, W also the split's autograd calls
(hardware.split_overhead per weight op); weight ops whose backward is one opaque function (not an ATen op:
runtime/pipeline/backward_split.py cannot ask it for one gradient only) run their whole backward in I and again in W,
so I + W = B + that backward (`unsplit`, carried in the estimate's recompute), shared half and half. These
extras are paid per W action of the stage (m under ZB-H1 and ZBV; DualPipeV splits only the backwards at its ends).

Context parallelism: a context attention (passes/context.py) computes (local queries against every key) and
communicates (its CommRecords on axis cp: cp consecutive dp ranks, tp apart); it saves its inputs and output, and
all-gathered the whole K, V. A "ring" record is `count` α-β `send`s of `bytes` on the group's link, each hidden
behind one block of the attention (its FLOPs / cp, twice that backward) as far as `overlap` allows (cp.py).
"""
from __future__ import annotations

import math
import operator
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from meshc.compiler.cost.formulas import Estimate
from meshc.compiler.cost.hardware import Hardware
from meshc.compiler.ir.fx_ops import VIEW_NAMES, is_view, op_short_name, val_nbytes
from meshc.compiler.ir.placement import FlatShard
from meshc.compiler.ir.roofline import COMPUTE_WITH_COMM, is_compute, node_flops

aten = torch.ops.aten
SAVES_NOTHING = VIEW_NAMES | {"add", "sub", "neg", "cat", "stack", "clone", "contiguous", "sum", "mean", "zeros_like",
                              "ones_like", "full", "arange", "empty", "new_ones", "new_zeros", "zeros", "ones", "copy_",
                              "to", "_to_copy", "type_as", "wait_tensor", "all_reduce", "all_gather_into_tensor",
                              "reduce_scatter_tensor", "embedding", "cumsum", "topk", "sort", "histc", "argsort",
                              "floor_divide", "eq", "ne", "lt", "le", "gt", "ge", "where", "masked_fill", "diff", "sin",
                              "cos", "index_put_", "index_put"}
SAVES_OUTPUT = {"softmax", "_softmax", "log_softmax", "_log_softmax", "tanh", "sigmoid", "exp", "rsqrt", "relu"}
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "linear", "matmul"}
DATA_AXES = ("dp", "edp", "dps", "dpr")  # gradient reductions, overlappable with backward; ep's all-to-all blocks
# like tp's (dps, dpr: hybrid sharding's shard and replica groups)


def _vals(node: fx.Node) -> list[torch.Tensor]:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return [x for x in vals if isinstance(x, torch.Tensor)]


@dataclass
class GraphCost:
    """What one graph (a stage, or a whole program) costs per micro-batch."""

    flops: float = 0.0
    bytes: float = 0.0
    ops: int = 0
    saved: float = 0.0  # bytes of activations kept for backward
    recompute_flops: float = 0.0
    recompute_bytes: float = 0.0
    recompute_ops: int = 0
    receives_grad: bool = False  # a received activation needs a gradient (not a first stage): I has work
    weight_ops: int = 0  # ops between a received activation and a parameter: zero-bubble W's autograd calls
    # those of them whose backward is one opaque function (not ATen's: a torch.library or user autograd op, a
    # meshc kernel): asked for either gradient it computes both, so zero-bubble runs it in I and again in W
    unsplit_flops: float = 0.0
    unsplit_bytes: float = 0.0
    unsplit_ops: int = 0
    comms: list = field(default_factory=list)  # (CommRecord, recomputed_in_backward, FLOPs a call hides behind,
    #                                             its ZeRO bucket's copies run as meshc kernels)

    def time(self, hw: Hardware) -> tuple[float, float]:
        """(forward + backward seconds, recompute seconds) of compute, without communication."""
        return (3 * _forward_seconds(self.flops, self.bytes, self.ops, hw),
                _forward_seconds(self.recompute_flops, self.recompute_bytes, self.recompute_ops, hw))

    def unsplit_time(self, hw: Hardware) -> float:
        """Seconds of the backward of the weight ops zero-bubble cannot split (twice their forward)."""
        return 2 * _forward_seconds(self.unsplit_flops, self.unsplit_bytes, self.unsplit_ops, hw)


def _forward_seconds(flops: float, nbytes: float, ops: int, hw: Hardware) -> float:
    """One forward of ops with these FLOPs and bytes on `hw` (roofline.Rates.forward_seconds)."""
    return hw.rates({}).forward_seconds(flops, nbytes, ops)


def _splits_backward(node: fx.Node) -> bool:
    """Whether autograd computes only the gradients asked of `node` (an ATen op's derivative formula, which
    skips the outputs nobody needs); a custom op's backward is one function that computes them all."""
    return getattr(node.target, "namespace", None) in ("aten", "prims")


def graph_cost(gm: fx.GraphModule) -> GraphCost:
    """FLOPs, bytes, ops, saved activations and collectives of one graph, descending into remat blocks."""
    cost = GraphCost()
    acts, grads = _flow(gm.graph)
    saved: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            _remat_block(gm, node, acts, cost, saved)
            continue
        _add_node(node, cost)
        for base in _saved_by(node, acts, grads):
            saved[base] = val_nbytes(base)
        if node in grads and node.op == "call_function" and node.kwargs.get("method") == "all_gather" and \
                op_short_name(node.target) in COMPUTE_WITH_COMM:  # the gathered K and V, saved for backward
            cost.saved += (int(node.kwargs.get("size", 1)) - 1) * sum(val_nbytes(x) for x in node.args[1:3])
        _add_comms(cost, node, [r for r in node.meta.get("meshc.comm", ()) if not _skipped_regather(node, r, grads)])
    cost.saved += float(sum(saved.values()))
    closure = _from_received(gm.graph, grads)
    cost.receives_grad = bool(closure)
    weight_ops = [n for n in closure if is_compute(n) and any(x in grads and x not in closure for x in n.all_input_nodes)]
    cost.weight_ops = len(weight_ops)
    for n in weight_ops:
        if not _splits_backward(n):
            cost.unsplit_flops += node_flops(n)
            cost.unsplit_bytes += sum(val_nbytes(a) for a in n.all_input_nodes) + val_nbytes(n)
            cost.unsplit_ops += 1
    return cost


def _from_received(graph: fx.Graph, grads: set[fx.Node]) -> set[fx.Node]:
    """Values that need a gradient and depend on a received activation that needs one (backward's input
    closure, runtime/pipeline/backward_split.py): empty in a first stage."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node in grads and node.meta.get("meshc.role") not in ("param", "buffer"):
                out.add(node)
        elif node in grads and any(x in out for x in node.all_input_nodes):
            out.add(node)
    return out


def _add_comms(cost: GraphCost, node: fx.Node, records, recomputed=lambda record: False) -> None:
    """`node`'s records into cost.comms, a ring hop with the FLOPs of the attention block it overlaps."""
    block = 0.0
    if any(r.kind == "ring" for r in records):
        block = node_flops(node) / max(int(node.kwargs.get("size", 1)), 1)
    fused = bool(node.kwargs.get("fused")) if node.op == "call_function" else False
    for r in records:
        hide = (2 * block if r.phase == "backward" else block) if r.kind == "ring" else 0.0
        cost.comms.append((r, recomputed(r), hide, fused))


def _skipped_regather(node: fx.Node, record, grads: set[fx.Node]) -> bool:
    """A ZeRO-3 bucket is gathered again in backward only when autograd unpacks a saved parameter of it
    (runtime/zero/context.py's saved-tensor hooks): a bucket no op saves (an embedding table: its backward needs
    only the indices) is never gathered again, though the pass records the gather."""
    if record.kind != "all_gather" or record.phase != "backward" or "meshc.bucket" not in node.meta:
        return False
    return not any(_saves(user, item, grads) for item in _through_views(node) for user in item.users)


def _through_views(node: fx.Node) -> list[fx.Node]:
    """`node` and the getitems and views that read its storage."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack += [u for u in n.users if u.op == "call_function" and (u.target is operator.getitem or
                                                                       is_view(u.target))]
    return out


def _saves(user: fx.Node, value: fx.Node, grads: set[fx.Node]) -> bool:
    """Whether `user` keeps its input `value` for backward (the rules of _saved_by, for any input)."""
    if user.op == "call_module":
        return True
    if user.op != "call_function" or user.target is operator.getitem:
        return False
    name = op_short_name(user.target)
    if name in SAVES_NOTHING or name in SAVES_OUTPUT:
        return False
    tensors = [x for x in user.args if isinstance(x, fx.Node)]
    if name in MATMULS | {"mul", "div"} and len(tensors) >= 2:
        first, second = tensors[-2], tensors[-1]
        return (value is first and second in grads) or (value is second and (first in grads or name == "div"))
    return True


def _add_node(node: fx.Node, cost: GraphCost) -> None:
    if not is_compute(node):
        return
    cost.flops += node_flops(node)
    cost.bytes += sum(val_nbytes(a) for a in node.all_input_nodes) + val_nbytes(node)
    cost.ops += 1


def _flow(graph: fx.Graph) -> tuple[set[fx.Node], set[fx.Node]]:
    """(activations, values that need a gradient). Activations are computed from the inputs (model inputs,
    or what a stage receives), not from parameters and buffers alone; a value needs a gradient when it
    depends on a trainable parameter or on a received floating activation."""
    acts: set[fx.Node] = set()
    grads: set[fx.Node] = set()
    for node in graph.nodes:
        ins = node.all_input_nodes
        if node.op == "placeholder":
            role = node.meta.get("meshc.role")
            vals = _vals(node)
            if role not in ("param", "buffer"):
                acts.add(node)
                if role != "input" and vals and vals[0].is_floating_point():
                    grads.add(node)  # a stage's received activation
            elif role == "param":  # trainable as a rule; frozen parameters are rare and cheap to misjudge
                grads.add(node)
            continue
        if node.op not in ("call_function", "call_module"):
            continue
        if any(x in acts for x in ins):
            acts.add(node)
        vals = _vals(node)  # nodes a pass inserted may carry no "val": assume they pass gradients on
        if any(x in grads for x in ins) and (not vals or any(v.is_floating_point() for v in vals)):
            grads.add(node)
    return acts, grads


def _base(node: fx.Node) -> fx.Node:
    """The node whose storage a view (or a getitem of a split) shares."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node) and (
            is_view(node.target) or node.target is operator.getitem):
        parent = node.args[0]
        if node.target is operator.getitem and not is_view(getattr(parent, "target", None)):
            break
        node = parent
    return node


def _saved_by(node: fx.Node, acts: set[fx.Node], grads: set[fx.Node]) -> list[fx.Node]:
    """The activation storages `node` keeps for its backward (autograd's saved tensors, by op)."""
    if node.op != "call_function" or node not in grads:
        return []
    name = op_short_name(node.target)
    if "meshc.comm" in node.meta and name not in COMPUTE_WITH_COMM:
        return []
    if name in SAVES_NOTHING or node.target is operator.getitem:
        return []
    if name in SAVES_OUTPUT:
        return [_base(node)] if node in acts else []
    tensors = [x for x in node.args if isinstance(x, fx.Node)]
    if name in MATMULS | {"mul", "div"} and len(tensors) >= 2:
        first, second = tensors[-2], tensors[-1]  # addmm/baddbmm: the last two are the operands
        keep = ([first] if second in grads else []) + ([second] if first in grads or name == "div" else [])
    else:
        keep = list(node.all_input_nodes)
    if name in ("scaled_dot_product_attention", "context_attention"):
        keep.append(node)
    return [_base(x) for x in keep if x in acts]


def _remat_block(gm: fx.GraphModule, node: fx.Node, acts: set[fx.Node], cost: GraphCost, saved: dict) -> None:
    """A checkpointed block: its inputs are kept; full recompute runs its forward again in backward
    (collectives included); selective keeps matmul and tensor-parallel collective outputs."""
    module = gm.get_submodule(node.target)
    block = getattr(module, "block", None)
    if not isinstance(block, fx.GraphModule):
        return
    policy = getattr(module, "policy", "full")
    for a in node.all_input_nodes:
        if a in acts:
            saved[_base(a)] = val_nbytes(_base(a))
    for inner in block.graph.nodes:
        _add_node(inner, cost)
        records = inner.meta.get("meshc.comm", ())
        tp_comm = any(r.axis not in DATA_AXES for r in records)
        kept = policy == "selective" and (op_short_name(inner.target) in MATMULS or tp_comm)
        if kept:
            saved[inner] = val_nbytes(inner)
        elif is_compute(inner):
            cost.recompute_flops += node_flops(inner)
            cost.recompute_bytes += sum(val_nbytes(a) for a in inner.all_input_nodes) + val_nbytes(inner)
            cost.recompute_ops += 1
        _add_comms(cost, inner, records, lambda r: policy == "full" and r.phase == "forward" and r.axis not in DATA_AXES)


# ---------------------------------------------------------------------------------------------- memory
def model_state_bytes(specs, sizes: dict[str, int], plan) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer states (AdamW) a rank holds for `specs`, as the
    runtime stores them (runtime/zero/param_store.py): ZeRO-1/2 keep whole compute copies in one padded buffer
    (fp32) or beside fp32 master shards (mixed precision); ZeRO-3 keeps only the shards."""
    out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    for spec in specs:
        n = next((sizes.get(a, 1) for a, pl in spec.placements.items() if isinstance(pl, FlatShard)), 1)
        floating = spec.dtype.is_floating_point
        item = spec.dtype.itemsize
        compute = (plan.param_dtype.itemsize if plan.param_dtype is not None and floating else item)
        whole = math.prod(spec.unflat_shape(sizes))
        flat = any(isinstance(pl, FlatShard) for pl in spec.placements.values())
        shard = math.prod(spec.local_shape(sizes)) if flat else whole
        zero = spec.zero if flat else 0
        if zero in (1, 2):
            out["params"] += whole * compute + shard * item if compute != item else shard * n * item
        else:
            out["params"] += shard * item
        if not spec.requires_grad:
            continue
        out["grads"] += whole * compute if zero in (0, 1) else shard * item
        out["optimizer"] += 2 * shard * item
    return out


# ---------------------------------------------------------------------------------------------- time
def comm_time(record, sizes: dict[str, int], hw: Hardware) -> float:
    """Seconds of one CommRecord (all its calls) on the link its axis uses."""
    tp, ep = sizes.get("tp", 1), sizes.get("ep", 1)  # ep, cp: consecutive dp ranks; edp: every ep-th of them
    stride = {"tp": 1, "dp": tp, "ep": tp, "cp": tp, "edp": tp * ep, "dps": tp, "dpr": tp * sizes.get("dps", 1),
              "pp": tp * sizes.get("dp", 1)}.get(record.axis, 1)
    n = sizes.get(record.axis, 1)
    if record.kind == "ring":  # `count` hops to the next rank of the group, all ranks at once: the slowest link's
        return record.count * hw.link(stride, n).time("send", 2, record.bytes) if n > 1 else 0.0
    if record.kind == "send":
        link = hw.link(1, stride * n) if n > 1 else hw.intra
        return record.count * link.time("send", 2, record.bytes)
    return record.count * hw.link(stride, n).time(record.kind, n, record.bytes)


def copy_time(record, sizes: dict[str, int], hw: Hardware, fused: bool = False) -> float:
    """Seconds of the copies around a ZeRO bucket's collective (`record.tensors` tensors; 0 for other records):
    runtime/ops/zero.py packs a bucket into one flat buffer before its reduce-scatter or all-gather and copies
    each tensor out of the gathered buffer; runtime/zero/param_store.py's ZeRO-1/2 step also copies the gathered
    parameters into the compute copies. Priced as ATen calls (views and casts included: a third of
    op_overhead each, which calibrate measures per forward op with its backward) and bytes read and written at
    memory bandwidth; fused (kernels/zero_copy.py), one kernel packs and one unpacks."""
    k, n = record.tensors, sizes.get(record.axis, 1)
    if not k or record.kind not in ("reduce_scatter", "all_gather"):
        return 0.0
    if record.kind == "reduce_scatter":  # per tensor a flat view, a cast and a row view, then one cat and the
        calls, nbytes = (3 if fused else 4 * k + 2), 4 * record.bytes  # 1/dp scaling; the result split per shard
    else:
        full = n * record.bytes  # record.bytes: this rank's slice; each copy reads and writes what it moves
        calls, nbytes = (k + 2, 2 * record.bytes + 2 * full) if fused else (8 * k + 1, 2 * record.bytes + 4 * full)
        if record.phase == "step":  # and into the compute copies
            calls, nbytes = calls + k, nbytes + 2 * full
    return _forward_seconds(0.0, nbytes, calls, hw)


@dataclass
class StageTimes:
    forward: float  # compute and blocking (tp) collectives of a forward, per micro-batch
    backward: float
    recompute: float
    tp: float
    dp: float  # data-parallel collectives per micro-batch
    compute: float
    ep: float = 0.0  # expert all-to-alls (blocking, like tp's; part of forward and backward above)
    cp: float = 0.0  # context attention's traffic not hidden behind its blocks (part of forward and backward too)
    first: bool = False  # no received activation needs a gradient: zero-bubble's I is empty, W is all of B
    split: float = 0.0  # seconds zero-bubble's split adds to W (its autograd calls, hardware.split_overhead)
    unsplit: float = 0.0  # seconds of the backward zero-bubble runs twice (ops it cannot split: in I and in W)
    # ZeRO-3's backward gathers once more in zero-bubble's W (it reruns nodes I ran, which unpack their saved
    # parameters again: ZeroContext.holding gathers each bucket once): their traffic, and their copies in W
    regather: float = 0.0
    regather_copies: float = 0.0


def _regathered(record) -> bool:
    """A ZeRO-3 bucket gathered again for backward (what zero-bubble's W gathers once more)."""
    return record.kind == "all_gather" and record.phase == "backward" and record.axis in DATA_AXES


def stage_times(cost: GraphCost, sizes: dict[str, int], hw: Hardware) -> StageTimes:
    work, again = cost.time(hw)
    tp_fwd = tp_bwd = dp = regather = regather_copies = 0.0
    copies = {"forward": 0.0, "backward": 0.0}
    by_axis = {"ep": 0.0, "cp": 0.0}
    for record, recomputed, hide, fused in cost.comms:
        copies[record.phase] = copies.get(record.phase, 0.0) + copy_time(record, sizes, hw, fused)
        seconds = comm_time(record, sizes, hw)
        if record.kind == "ring" and seconds:  # each hop overlaps one block of the attention
            hidden = hw.overlap * hide / hw.flops * hw.compute_scale
            seconds = record.count * max(0.0, seconds / record.count - hidden)
        if record.axis in DATA_AXES:
            dp += seconds
            if cost.receives_grad and _regathered(record):
                regather += seconds
                regather_copies += copy_time(record, sizes, hw, fused)
            continue
        if record.phase == "forward":
            tp_fwd += seconds
            tp_bwd += seconds if recomputed else 0.0
        elif record.phase == "backward":
            tp_bwd += seconds
        if record.axis in by_axis:
            by_axis[record.axis] += seconds * (2 if recomputed else 1)
    fwd, bwd = work / 3 + copies["forward"], 2 * work / 3 + copies["backward"]
    return StageTimes(forward=fwd + tp_fwd, backward=bwd + again + tp_bwd, recompute=again,
                      tp=tp_fwd + tp_bwd - by_axis["ep"] - by_axis["cp"], dp=dp, compute=fwd + bwd,
                      first=not cost.receives_grad, split=cost.weight_ops * hw.split_overhead,
                      unsplit=cost.unsplit_time(hw), regather=regather, regather_copies=regather_copies, **by_axis)


# ---------------------------------------------------------------------------------------------- estimate
def compiled_estimate(program, hw: Hardware, pipeline=None, pp_rank: int | None = None) -> Estimate:
    """Memory and step time of a compiled program (and its pipeline stages, if it has them).

    Memory is that of the fullest pp rank; step time is the simulated schedule's makespan (each stage's
    forward and backward costing its compute plus its blocking tensor-parallel collectives, messages
    costing the send of its boundary activations), plus data-parallel collectives not hidden behind
    compute, the optimizer step's collectives and the update itself.
    """
    sizes = program.mesh.sizes
    stages, schedule = _stages(program, pipeline)
    m = schedule.microbatches if schedule is not None else 1
    pp = sizes.get("pp", 1) if schedule is not None else 1
    rank_of = schedule.rank_of if schedule is not None else (lambda index: 0)
    by_rank = [[i for i, (index, *_rest) in enumerate(stages) if rank_of(index) == r] for r in range(pp)]  # stage indices
    costs = [graph_cost(gm) for _, gm, _, _ in stages]
    times = [stage_times(c, sizes, hw) for c in costs]
    makespan, busy, in_flight = _makespan(stages, times, schedule, sizes, hw)
    # a pp rank's ZeRO-1/2 step reduces and gathers its own stages' parameters (runtime/zero/param_store.py)
    held = [None] if pp == 1 else [{f for i in local for f in stages[i][2]} for local in by_rank]
    step = sum(comm_time(r, sizes, hw) for r in _extra_records(program, pipeline)) + max(
        sum(comm_time(r, sizes, hw) + copy_time(r, sizes, hw) for r in program.step_records(fqns)) for fqns in held)
    ranks = [_rank_memory(program, stages, costs, local, in_flight[r], schedule, hw, sizes)
             for r, local in enumerate(by_rank)]
    fullest = max(range(len(ranks)), key=lambda r: sum(ranks[r][0].values())) if pp_rank is None else pp_rank
    memory = ranks[fullest][0]
    busiest = max(range(len(ranks)), key=lambda r: busy[r])
    local = by_rank[busiest]
    dp = m * sum(times[i].dp for i in local)
    pipelined = twice = 0.0  # overheads and work inside the simulated actions (_makespan): part of busy time
    ws = _weight_actions(schedule, busiest) if schedule is not None else Counter()  # m per stage under zero-bubble
    if schedule is not None:
        pipelined = len(schedule.actions[busiest]) * hw.action_overhead
        pipelined += sum(ws[stages[i][0]] * times[i].split for i in local)
        twice = sum(ws[stages[i][0]] * (times[i].unsplit + times[i].regather_copies) for i in local)
        dp += sum(ws[stages[i][0]] * times[i].regather for i in local)
    time = {"compute": m * sum(times[i].compute for i in local),
            "recompute": m * sum(times[i].recompute for i in local) + twice,
            "bubble": max(makespan - busy[busiest], 0.0), "tp": m * sum(times[i].tp for i in local),
            "ep": m * sum(times[i].ep for i in local), "cp": m * sum(times[i].cp for i in local), "pp": 0.0,
            "dp": max(dp - hw.overlap * busy[busiest], 0.0), "step": step,
            "optimizer": max(hw.adam_time(elements, tensors) for _, elements, tensors in ranks),
            "overhead": hw.step_overhead + pipelined}
    if makespan < busy[busiest]:  # shared cores (see _makespan): the busiest rank ran faster than calibrated
        scale = makespan / busy[busiest]
        for key in ("compute", "recompute", "tp", "ep", "cp"):
            time[key] *= scale
        time["overhead"] = hw.step_overhead + pipelined * scale
    flops = m * sum(3 * costs[i].flops + costs[i].recompute_flops + ws[stages[i][0]] * 2 * costs[i].unsplit_flops
                    for i in local)
    by_axis: dict[str, float] = {}
    for (kind, axis), nbytes in comm_bytes(program, pipeline).items():
        by_axis[axis] = by_axis.get(axis, 0.0) + nbytes
    return Estimate(source="compiled", memory=memory, time=time, flops=flops, comm_bytes=by_axis)


def _weight_actions(schedule, rank: int) -> Counter:
    """stage index -> W actions of `rank` in one step (each one reruns its stage's unsplit ops and gathers)."""
    return Counter(a.stage for a in schedule.actions[rank] if a.kind == "W")


def _stages(program, pipeline):
    """(index, graph, parameter FQNs, boundary bytes sent) per stage, and the schedule (None: no pipeline)."""
    if pipeline is None:
        return [(0, program.gm, list(program.params), 0)], None
    out = [(s.index, s.gm, list(s.params), s.sent_bytes) for s in pipeline.all_stages]
    return out, pipeline.schedule


def _makespan(stages, times, schedule, sizes, hw):
    """(makespan, busy seconds per pp rank, peak micro-batches in flight per pp rank) of one step.

    Where a node's ranks share fewer cores than there are ranks (hw.cores), `times` are those of a rank
    computing while all do (as calibrated): the pipeline is simulated at the speed of a rank alone (times over
    the calibration's sharing), its ranks sharing the job's cores (schedule_sim's capacity: each pp rank stands
    for its dp x tp replicas, all computing at once), so a rank in another's bubble runs faster and ranks that
    compute together slow each other down. Busy times stay in calibrated units. Each action also costs
    hw.action_overhead (the executor's own work and, with more ranks than cores, a woken rank's wait for a core:
    calibrated on a pipeline over the whole world, meshc/calibrate.py)."""
    if schedule is None:
        t = times[0]
        return t.forward + t.backward, [t.forward + t.backward], [1]
    calibrated = hw.sharing(hw.ranks_per_node)
    from meshc.compiler.ir.schedule_sim import simulate

    pp = sizes.get("pp", 1)
    world = pp * sizes.get("dp", 1) * sizes.get("tp", 1)  # mesh.AXES: ep and cp are sub-axes of dp
    capacity = hw.cores * -(-world // hw.ranks_per_node) / (world // pp) if hw.cores else None
    send = max((s[3] for s in stages), default=0)
    link = hw.link(1, world)
    delay = link.time("send", 2, send) if pp > 1 else 0.0
    by_stage = {s[0]: times[i] for i, s in enumerate(stages)}

    def cost(action) -> float:
        st = by_stage[action.stage]
        whole = st.backward + st.unsplit  # I and W each run the unsplit ops' whole backward
        half = 0.0 if st.first else whole / 2
        seconds = {"F": st.forward, "B": st.backward, "I": half,
                   "W": whole - half + st.split + st.regather_copies}[action.kind]
        return (seconds + hw.action_overhead) / calibrated
    result = simulate(schedule, cost=cost, comm=delay, capacity=capacity)
    return result.makespan, [b * calibrated for b in result.busy], list(result.peak_in_flight)


def _rank_memory(program, stages, costs, local, in_flight, schedule, hw, sizes):
    """({params, grads, optimizer, activations, buffers}, elements the optimizer updates, in how many tensors)
    of one pp rank."""
    fqns = {f for i in local for f in stages[i][2]}
    specs = [s for f, s in program.params.items() if f in fqns]
    states = model_state_bytes(specs, sizes, program.plan)
    saved = sum(costs[i].saved for i in local) / max(len(local), 1)
    last = any(stages[i][0] == len(stages) - 1 for i in local)
    outputs = _output_bytes(stages[-1][1]) if last else 0
    held_last = in_flight if schedule is None or schedule.name == "gpipe" else 1
    activations = saved * in_flight + outputs * held_last
    buffers = _buffers(program, sizes, max((stages[i][3] for i in local), default=0))
    trainable = [math.prod(s.local_shape(sizes)) for s in specs if s.requires_grad]
    return {**states, "activations": float(activations), "buffers": float(buffers)}, sum(trainable), len(trainable)


def _output_bytes(gm: fx.GraphModule) -> int:
    """Bytes of a graph's floating outputs in fp32: the loss keeps its log-softmax of the logits."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    nodes = [a for a in fx.node.map_aggregate(out.args[0], lambda x: x) if isinstance(a, fx.Node)] \
        if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    total = 0
    for node in nodes:
        for val in _vals(node) if isinstance(node, fx.Node) else ():
            if val.is_floating_point() and val.dim() > 0:
                total += val.numel() * 4
    return total


def _buffers(program, sizes, boundary: int) -> float:
    """Communication buffers: a gradient bucket in flight (twice: the flat copy and its reduction), ZeRO-3's
    gathered bucket and the one prefetched, pipeline messages in both directions."""
    plan, out = program.plan, 2.0 * boundary
    grads = sum(s.local_bytes(sizes) for s in program.params.values() if s.requires_grad)
    if sizes.get("dp", 1) > 1 and plan.zero in (0, 2):
        out += min(2 * program.bucket_mb() * 2**20, 2 * grads) if plan.zero == 0 else min(plan.zero_bucket_mb * 2**20, grads)
    if plan.zero == 3:
        out += min(2 * plan.zero_bucket_mb * 2**20, 2 * grads * sizes.get("dp", 1))
    return out


def _extra_records(program, pipeline) -> list:
    """Collectives of a step that no graph node records: the dp loss average, the tied-gradient sum over pp."""
    from meshc.compiler.ir.program import CommRecord

    out = []
    if program.mesh.sizes.get("dp", 1) > 1:
        out.append(CommRecord("all_reduce", "dp", 4, "step", "job.step: the loss averaged over dp"))
    if pipeline is not None and program.mesh.sizes.get("pp", 1) > 1:
        out.append(CommRecord("all_reduce", "pp", 4, "step", "the pipeline's loss shared over pp"))
        if pipeline.tied:
            nbytes = sum(program.params[f].local_bytes(program.mesh.sizes) for f in pipeline.tied)
            out.append(CommRecord("all_reduce", "pp", nbytes, "step", "tied gradients summed over pp"))
    return out


def comm_bytes(program, pipeline=None) -> dict[tuple[str, str], float]:
    """(kind, axis) -> payload bytes this rank contributes per step: every graph collective of its stages
    (once per micro-batch), the optimizer step's, the loss average and the tied-gradient sum."""
    out: dict[tuple[str, str], float] = {}

    def add(record, times: int = 1) -> None:
        key = (record.kind, record.axis)
        out[key] = out.get(key, 0.0) + record.bytes * record.count * times
    if pipeline is None:
        stages, m, ws = [(0, program.gm, None)], 1, Counter()
    else:
        stages = [(index, s.gm, s) for index, s in pipeline.local.items()]
        m, ws = pipeline.schedule.microbatches, _weight_actions(pipeline.schedule, pipeline.coord)
    for index, gm, stage in stages:
        cost = graph_cost(gm)
        for record, *_ in cost.comms:
            add(record, m)
            if ws[index] and cost.receives_grad and _regathered(record):
                add(record, ws[index])  # gathered once more in each zero-bubble W (StageTimes.regather)
        if stage is not None:
            out[("send", "pp")] = out.get(("send", "pp"), 0.0) + sum(pipeline.messages(stage)) * m
    for record in program.step_records(None if pipeline is None else pipeline.params) + \
            _extra_records(program, pipeline):
        add(record)
    return out


def estimate_compiled(compiled, hardware="cpu", own_rank: bool = False) -> Estimate:
    """The compiled-path estimate of a CompiledRank (compiler/compile.py; `job.compiled` of a Job) on
    `hardware` (a profile, name or JSON path); memory of the fullest pp rank, or of its own with `own_rank`."""
    from meshc.compiler.cost.hardware import load

    pipeline = compiled.pipeline
    rank = pipeline.coord if own_rank and pipeline is not None else None
    return compiled_estimate(compiled.program, load(hardware), pipeline, pp_rank=rank)
