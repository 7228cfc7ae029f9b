"""The chains fuse_comm rewrites: for each kernel, where eligible chains are, how one must look (a match,
or the reason it does not), and its rewrite. See passes/fuse_comm.py for the list and the contract.

Each kernel has three functions, all typed:
    <kernel>_anchors(program) -> [Anchor, ...]     every eligible chain, with the structure found (once)
    match_<kernel>(program, anchor) -> match | str  what to rewrite (a dataclass: the anchor itself where it
                                                    holds all the rewrite needs), or why it does not apply
    rewrite_<kernel>(program, match) -> None
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from meshc.compiler.ir.fx_ops import is_call, is_reshape
from meshc.compiler.ir.placement import Shard
from meshc.compiler.ir.program import COMM, PLACEMENT, ROLE, STAGE, VALUE_META, WHY, Program
from meshc.kernels.bias_act import bias_gelu, bias_swiglu
from meshc.kernels.bias_dropout_add_norm import bias_dropout_add_norm
from meshc.runtime.ops import collectives as C
from meshc.runtime.ops.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from meshc.runtime.ops.zero import zero_gather, zero_reduce

aten = torch.ops.aten
REDUCTIONS = (C.all_reduce, C.reduce_scatter)
TO = (aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default)


@dataclass
class Anchor:
    """One eligible chain: `node` computes the chain's value (it names the chain in fuse_comm's reasons)."""

    node: fx.Node


def _only_user(node: fx.Node) -> fx.Node | None:
    users = [u for u in node.users if not is_call(u, aten._assert_tensor_metadata.default)]
    return users[0] if len(users) == 1 else None


def _drop_asserts(node: fx.Node) -> None:
    for u in list(node.users):
        if is_call(u, aten._assert_tensor_metadata.default):
            node.graph.erase_node(u)


def _erase(nodes) -> None:
    for n in nodes:
        if n is not None and n.graph is not None and not n.users:
            _drop_asserts(n)
            n.graph.erase_node(n)


def _copy_meta(dst: fx.Node, src: fx.Node) -> None:
    dst.meta.update({k: v for k, v in src.meta.items() if k in (*VALUE_META, "nn_module_stack", STAGE)})


def _why(node: fx.Node, text: str) -> None:
    node.meta[WHY] = f"fused kernel: {text}"


# ------------------------------------------------------------------------------ bias + dropout + add + norm
@dataclass
class NormMatch:
    out: fx.Node  # the node whose value is norm(s)
    chain: list[fx.Node]  # the norm's own nodes, removed
    s: fx.Node  # the residual add
    x: fx.Node  # the reduction's output
    bias: fx.Node | None
    between: list[fx.Node]  # bias add, views and dropout between x and the add
    residual: fx.Node
    weight: fx.Node
    norm_bias: fx.Node | None
    p: float
    kind: str
    eps: float
    alias: fx.Node | None = None  # a cast of s to its own dtype (an alias of s others may use)


@dataclass
class NormAnchor(Anchor):
    """A norm (node: its output) of a residual sum s; the chain is the norm's own nodes, s excluded."""

    s: fx.Node
    chain: list[fx.Node]
    kind: str  # "layernorm" | "rmsnorm"
    dims: int  # trailing dims normalized over
    weight: fx.Node | None
    norm_bias: fx.Node | None
    eps: float


def _norm_roots(program: Program) -> list[NormAnchor]:
    """Every layer_norm, rms_norm and Hugging Face's written-out RMSNorm, with its parts."""
    out = []
    for node in program.gm.graph.nodes:
        if is_call(node, aten.layer_norm.default, aten.rms_norm.default):
            kind = "layernorm" if node.target == aten.layer_norm.default else "rmsnorm"
            at = 4 if kind == "layernorm" else 3  # eps's position
            out.append(NormAnchor(node, node.args[0], [node], kind, len(node.args[1]),
                                  node.args[2] if len(node.args) > 2 else None,
                                  node.args[3] if kind == "layernorm" and len(node.args) > 3 else None,
                                  node.args[at] if len(node.args) > at else 1e-5))
        elif is_call(node, aten.rsqrt.default):
            found = _hf_rmsnorm(node)
            if found:
                final, s, chain, weight, eps = found
                out.append(NormAnchor(final, s, chain, "rmsnorm", 1, weight, None, eps))
    return out


def _hf_rmsnorm(rsqrt: fx.Node):
    """weight * to(to(s, f32) * rsqrt(mean(to(s, f32)^2, -1) + eps), dtype) -> (output, s, chain, weight, eps)."""
    add_eps = rsqrt.args[0]
    if not is_call(add_eps, aten.add.Tensor) or not isinstance(add_eps.args[1], float):
        return None
    mean = add_eps.args[0]
    if not is_call(mean, aten.mean.dim) or list(mean.args[1]) not in ([-1],):
        return None
    if not (len(mean.args) > 2 and mean.args[2]):  # keepdim
        return None
    power = mean.args[0]
    if not is_call(power, aten.pow.Tensor_Scalar) or power.args[1] != 2:
        return None
    h = power.args[0]
    s = h.args[0] if is_call(h, *TO) else h
    scaled = [u for u in rsqrt.users if is_call(u, aten.mul.Tensor)]
    if len(scaled) != 1 or h not in scaled[0].args:
        return None
    tail = _only_user(scaled[0])
    cast = tail if is_call(tail, *TO) else None
    final = _only_user(cast) if cast is not None else tail
    if not is_call(final, aten.mul.Tensor):
        return None
    other = final.args[0] if final.args[1] is (cast or scaled[0]) else final.args[1]
    if not (isinstance(other, fx.Node) and other.meta.get(ROLE) == "param") and not _param_like(other):
        return None
    chain = [n for n in (h if h is not s else None, power, mean, add_eps, rsqrt, scaled[0], cast, final) if n is not None]
    return final, s, chain, other, add_eps.args[1]


def _param_like(node) -> bool:
    """A parameter, maybe through getitem of a ZeRO/grad bucket."""
    while isinstance(node, fx.Node) and node.target is operator.getitem:
        node = node.args[0]
        if node.target in (zero_gather, zero_reduce) or getattr(node.target, "__name__", "") == "grad_sync":
            return True
    return isinstance(node, fx.Node) and node.meta.get(ROLE) == "param"


def _from_reduction(node: fx.Node):
    """Walk back from an add operand through dropout / views / a bias add to a tp reduction."""
    between, bias, p = [], None, 0.0
    cur = node
    while True:
        if is_call(cur, *REDUCTIONS):
            return cur, bias, list(reversed(between)), p
        if is_call(cur, aten.dropout.default) and p == 0.0:
            p = float(cur.args[1])
        elif is_reshape(cur):
            pass
        elif is_call(cur, aten.add.Tensor) and bias is None and _param_like(cur.args[1]):
            bias = cur.args[1]
        else:
            return None
        between.append(cur)
        cur = cur.args[0]


def norm_anchors(program: Program) -> list[NormAnchor]:
    """Norms whose input is a residual add with a tp reduction on one side."""
    return [a for a in _norm_roots(program) if is_call(a.s, aten.add.Tensor)
            and any(_from_reduction(x) for x in a.s.args if isinstance(x, fx.Node))]


def match_norm(program: Program, a: NormAnchor) -> NormMatch | str:
    out, s, chain = a.node, a.s, a.chain
    if chain[0].args[0] is not s:
        return "its residual add was rewritten by an earlier fusion"
    if a.dims != 1:
        return "normalized over more than the last dim"
    if a.weight is None:
        return "a norm without a weight"
    if s.meta.get(STAGE) != out.meta.get(STAGE):
        return "a pipeline stage boundary lies between the residual add and the norm"
    for side, other in ((s.args[0], s.args[1]), (s.args[1], s.args[0])):
        found = _from_reduction(side) if isinstance(side, fx.Node) else None
        if found:
            x, bias, between, p = found
            if any(_only_user(n) is None for n in [x, *between]):
                return "a value inside the chain is used elsewhere"
            if not isinstance(other, fx.Node) or tuple(other.meta["val"].shape) != tuple(s.meta["val"].shape):
                return "the residual's shape differs from the sum's"
            alias = chain[0] if is_call(chain[0], *TO) and chain[0].meta["val"].dtype == s.meta["val"].dtype else None
            reason = _norm_users(a, alias)
            if reason:
                return reason
            return NormMatch(out, chain, s, x, bias, between, other, a.weight, a.norm_bias, p, a.kind, float(a.eps),
                             alias)
    return "no reduction feeds the residual add"


def _norm_users(a: NormAnchor, alias: fx.Node | None) -> str | None:
    """Why the norm cannot be replaced by the kernel's output: an inner value or the sum used elsewhere first."""
    inside = set(a.chain)
    if any(u not in inside and not is_call(u, aten._assert_tensor_metadata.default)
           for n in a.chain[:-1] if n is not alias for u in n.users):
        return "a value inside the norm is used elsewhere"
    order = {n: i for i, n in enumerate(a.s.graph.nodes)}
    users = [u for n in (a.s, alias) if n is not None for u in n.users
             if u not in a.chain and not is_call(u, aten._assert_tensor_metadata.default)]
    if any(order[u] < order[a.node] for u in users):
        return "the sum is used before the norm ends"
    return None


def rewrite_norm(program: Program, m: NormMatch) -> None:
    graph = program.gm.graph
    _drop_asserts(m.s)
    with graph.inserting_before(m.out):  # where the norm ends: its inputs, weights included, exist by then
        x = m.x
        if any(is_reshape(n) for n in m.between):
            x = graph.call_function(aten.view.default, (m.x, list(m.s.meta["val"].shape)))
            _copy_meta(x, m.s)
            x.meta[WHY] = "fused kernel: the reduction's output in the residual's shape"
        fused = graph.call_function(bias_dropout_add_norm, (x, m.bias, m.residual, m.weight, m.norm_bias),
                                    {"p": m.p, "norm": m.kind, "eps": m.eps})
        _why(fused, f"bias + dropout + residual add + {m.kind} after the reduction %{m.x.name}")
        y = graph.call_function(operator.getitem, (fused, 0))
        s = graph.call_function(operator.getitem, (fused, 1))
    _copy_meta(fused, m.s)
    _copy_meta(y, m.out)
    _copy_meta(s, m.s)
    y.meta[WHY] = s.meta[WHY] = "fused kernel output"
    m.out.replace_all_uses_with(y)
    m.s.replace_all_uses_with(s, delete_user_cb=lambda u: u not in m.chain)
    if m.alias is not None:  # the no-op cast of s: its other users read the new sum
        m.alias.replace_all_uses_with(s, delete_user_cb=lambda u: u not in m.chain)
    _erase(reversed(m.chain))
    _erase([m.s, *reversed(m.between)])


# ------------------------------------------------------------------------------ bias + activation
@dataclass
class ColumnMatmul:
    """A matmul whose output is split on its last dim (column-parallel), and the reshapes from it to a value."""

    matmul: fx.Node
    views: list[fx.Node]


def _column_parallel(node: fx.Node) -> ColumnMatmul | None:
    """Walk back from `node` through reshapes to a column-parallel matmul."""
    views = []
    while is_reshape(node):
        views.append(node)
        node = node.args[0]
    if not is_call(node, aten.linear.default, aten.addmm.default, aten.mm.default):
        return None
    p = node.meta.get(PLACEMENT, {}).get("tp")
    if isinstance(p, Shard) and p.dim == node.meta["val"].dim() - 1:
        return ColumnMatmul(node, list(reversed(views)))
    return None


def _gpt2_gelu(tanh: fx.Node):
    """0.5 * v * (1 + tanh(sqrt(2/pi) * (v + 0.044715 * v^3))) written out -> (output, v, chain)."""
    scale = tanh.args[0]
    if not is_call(scale, aten.mul.Tensor) or not _close(scale.args[1], math.sqrt(2 / math.pi)):
        return None
    inner = scale.args[0]
    if not is_call(inner, aten.add.Tensor):
        return None
    v, cubic = inner.args
    if not (is_call(cubic, aten.mul.Tensor) and _close(cubic.args[1], 0.044715)
            and is_call(cubic.args[0], aten.pow.Tensor_Scalar) and cubic.args[0].args == (v, 3.0)):
        return None
    one = _only_user(tanh)
    if not (is_call(one, aten.add.Tensor) and one.args[1] == 1.0):
        return None
    final = _only_user(one)
    half = final.args[0] if final is not None and final.args[1] is one else None
    if not (is_call(final, aten.mul.Tensor) and is_call(half, aten.mul.Tensor) and half.args == (v, 0.5)):
        return None
    return final, v, [cubic.args[0], cubic, inner, scale, tanh, one, half, final]


def _close(value, want: float) -> bool:
    return isinstance(value, float) and abs(value - want) < 1e-6


@dataclass
class GeluAnchor(Anchor):
    """GeLU of a column-parallel matmul's output `value` (node: its output; chain: its nodes, aten.gelu alone
    or GPT-2's tanh form written out)."""

    value: fx.Node
    chain: list[fx.Node]
    approximate: str
    producer: ColumnMatmul


def gelu_anchors(program: Program) -> list[GeluAnchor]:
    found = []
    for node in program.gm.graph.nodes:
        if is_call(node, aten.gelu.default):
            producer = _column_parallel(node.args[0])
            approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
            if producer:
                found.append(GeluAnchor(node, node.args[0], [node], approximate, producer))
        elif is_call(node, aten.tanh.default):
            g = _gpt2_gelu(node)
            producer = _column_parallel(g[1]) if g else None
            if producer:
                found.append(GeluAnchor(g[0], g[1], g[2], "tanh", producer))
    return found


def match_gelu(program: Program, a: GeluAnchor) -> GeluAnchor | str:
    inner = [v for v in a.chain if v is not a.node]
    if any(len([u for u in n.users if u not in a.chain]) for n in inner):
        return "a value inside the activation is used elsewhere"
    if any(_only_user(n) is None for n in [a.producer.matmul, *a.producer.views]) \
            and not all(u in a.chain for u in a.value.users):
        return "the matmul's output is used elsewhere"
    return a


def _split_bias(graph: fx.Graph, matmul: fx.Node):
    """linear(x, W, b) -> linear(x, W); addmm(b, x, W) -> mm(x, W); returns the bias (or None)."""
    if is_call(matmul, aten.linear.default) and len(matmul.args) > 2 and matmul.args[2] is not None:
        bias = matmul.args[2]
        matmul.args = matmul.args[:2]
        return bias
    if is_call(matmul, aten.addmm.default):
        bias = matmul.args[0]
        matmul.target, matmul.args = aten.mm.default, (matmul.args[1], matmul.args[2])
        return bias
    return None


def rewrite_gelu(program: Program, m: GeluAnchor) -> None:
    graph = program.gm.graph
    bias = _split_bias(graph, m.producer.matmul)
    with graph.inserting_before(m.node):
        node = graph.call_function(bias_gelu, (m.value, bias), {"approximate": m.approximate})
    _copy_meta(node, m.node)
    _why(node, f"bias + GeLU ({m.approximate}) after the column-parallel %{m.producer.matmul.name}")
    m.node.replace_all_uses_with(node)
    _erase(reversed(m.chain))


@dataclass
class SwigluAnchor(Anchor):
    """silu(gate) * up (node: the product) with gate and up the outputs of column-parallel matmuls."""

    silu: fx.Node
    gate: fx.Node
    up: fx.Node
    gate_producer: ColumnMatmul
    up_producer: ColumnMatmul


def swiglu_anchors(program: Program) -> list[SwigluAnchor]:
    found = []
    for node in program.gm.graph.nodes:
        if is_call(node, aten.mul.Tensor) and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args):
            silu, up = node.args
            if not is_call(silu, aten.silu.default):
                continue
            gate_producer, up_producer = _column_parallel(silu.args[0]), _column_parallel(up)
            if gate_producer and up_producer:
                found.append(SwigluAnchor(node, silu, silu.args[0], up, gate_producer, up_producer))
    return found


def match_swiglu(program: Program, a: SwigluAnchor) -> SwigluAnchor | str:
    if _only_user(a.silu) is None:
        return "silu's output is used elsewhere"
    return a


def rewrite_swiglu(program: Program, m: SwigluAnchor) -> None:
    graph = program.gm.graph
    biases = [_split_bias(graph, p.matmul) if not p.views else None for p in (m.gate_producer, m.up_producer)]
    with graph.inserting_before(m.node):
        node = graph.call_function(bias_swiglu, (m.gate, m.up, biases[0], biases[1]))
    _copy_meta(node, m.node)
    _why(node, "bias + SwiGLU after the column-parallel gate and up projections")
    m.node.replace_all_uses_with(node)
    _erase([m.node, m.silu])


# ------------------------------------------------------------------------------ ZeRO copies
def zero_gather_anchors(program: Program) -> list[Anchor]:
    return [Anchor(n) for n in program.gm.graph.nodes if n.op == "call_function" and n.target is zero_gather]


def zero_reduce_anchors(program: Program) -> list[Anchor]:
    return [Anchor(n) for n in program.gm.graph.nodes if n.op == "call_function" and n.target is zero_reduce]


def match_flag(program: Program, a: Anchor) -> Anchor:
    return a


def set_fused(program: Program, a: Anchor) -> None:
    node = a.node
    node.update_kwarg("fused", True)
    start = node.args[0] if node.target is zero_gather else None
    if isinstance(start, fx.Node):
        start.update_kwarg("fused", True)


# ------------------------------------------------------------------------------ collective matmuls
def ag_matmul_anchors(program: Program) -> list[Anchor]:
    if not program.plan.sequence_parallel:
        return []
    return [Anchor(n) for n in program.gm.graph.nodes if n.op == "call_function" and n.target is C.all_gather_rs]


@dataclass
class GatherMatmulMatch:
    gather: fx.Node  # sequence parallel's all-gather (all_gather_rs)
    linears: list[fx.Node]  # its users, all linears of the gathered value


def match_ag_matmul(program: Program, a: Anchor) -> GatherMatmulMatch | str:
    gather = a.node
    users = list(gather.users)
    if not all(is_call(u, aten.linear.default) and u.args[0] is gather for u in users):
        return "the gathered value feeds something other than linears"
    if gather.kwargs["chunks"] != 1:
        return "a gather of several blocks"
    return GatherMatmulMatch(gather, users)


def rewrite_ag_matmul(program: Program, m: GatherMatmulMatch) -> None:
    gather, linears = m.gather, m.linears
    graph = program.gm.graph
    kw = gather.kwargs
    ranks = program.mesh.group_ranks("tp", program.rank)
    args = [gather.args[0]]
    for lin in linears:
        args += [lin.args[1], lin.args[2] if len(lin.args) > 2 else None]
    first = min(linears, key=list(graph.nodes).index)
    with graph.inserting_before(first):
        node = graph.call_function(all_gather_matmul, tuple(args), {
            "dim": kw["dim"], "size": kw["size"], "index": kw["index"], "group": kw["group"], "ranks": ranks})
    node.meta.update({k: v for k, v in gather.meta.items() if k in ("nn_module_stack", STAGE)})
    node.meta[COMM] = gather.meta.get(COMM, [])
    _why(node, "sequence parallel's all-gather overlapped with the column-parallel matmuls, ring by chunks")
    for i, lin in enumerate(linears):
        with graph.inserting_after(node):
            item = graph.call_function(operator.getitem, (node, i))
        _copy_meta(item, lin)
        item.meta[WHY] = "fused kernel output"
        lin.replace_all_uses_with(item)
    _erase(linears)
    _erase([gather])


def mm_rs_anchors(program: Program) -> list[Anchor]:
    if not program.plan.sequence_parallel:
        return []
    return [Anchor(n) for n in program.gm.graph.nodes if n.op == "call_function" and n.target is C.reduce_scatter]


@dataclass
class MatmulScatterMatch:
    scatter: fx.Node  # sequence parallel's reduce-scatter
    linear: fx.Node  # the bias-free row-parallel linear it reduces


def match_mm_rs(program: Program, a: Anchor) -> MatmulScatterMatch | str:
    rs = a.node
    lin = rs.args[0]
    if not is_call(lin, aten.linear.default) or (len(lin.args) > 2 and lin.args[2] is not None):
        return "the reduce-scatter does not follow a bias-free linear"
    if _only_user(lin) is not rs or rs.kwargs["chunks"] != 1:
        return "the partial product is used elsewhere"
    return MatmulScatterMatch(rs, lin)


def rewrite_mm_rs(program: Program, m: MatmulScatterMatch) -> None:
    rs, lin = m.scatter, m.linear
    graph = program.gm.graph
    kw = rs.kwargs
    with graph.inserting_before(rs):
        node = graph.call_function(matmul_reduce_scatter, (lin.args[0], lin.args[1]), {
            "dim": kw["dim"], "size": kw["size"], "index": program.mesh.coord("tp", program.rank),
            "group": kw["group"], "ranks": program.mesh.group_ranks("tp", program.rank)})
    _copy_meta(node, rs)
    node.meta[COMM] = rs.meta.get(COMM, [])
    _why(node, "the row-parallel matmul's reduce-scatter overlapped with it, ring by chunks")
    rs.replace_all_uses_with(node)
    _erase([rs, lin])
