"""The chains fuse_comm rewrites: for each kernel, where eligible chains are, how one must look (a match,
or the reason it does not), and its rewrite. See passes/fuse_comm.py for the list and the contract.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from meshc.compiler.ir.placement import Shard
from meshc.compiler.ir.program import Program
from meshc.kernels.bias_act import bias_gelu, bias_swiglu
from meshc.kernels.bias_dropout_add_norm import bias_dropout_add_norm
from meshc.runtime.ops import collectives as C
from meshc.runtime.ops.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from meshc.runtime.ops.zero import zero_gather, zero_reduce

aten = torch.ops.aten
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
REDUCTIONS = (C.all_reduce, C.reduce_scatter)
TO = (aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default)


def _is(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _only_user(node: fx.Node) -> fx.Node | None:
    users = [u for u in node.users if not _is(u, aten._assert_tensor_metadata.default)]
    return users[0] if len(users) == 1 else None


def _drop_asserts(node: fx.Node) -> None:
    for u in list(node.users):
        if _is(u, aten._assert_tensor_metadata.default):
            node.graph.erase_node(u)


def _erase(nodes) -> None:
    for n in nodes:
        if n is not None and n.graph is not None and not n.users:
            _drop_asserts(n)
            n.graph.erase_node(n)


def _copy_meta(dst: fx.Node, src: fx.Node) -> None:
    dst.meta.update({k: v for k, v in src.meta.items() if k in ("val", "meshc.shape", "meshc.placement",
                                                                "nn_module_stack", "meshc.stage")})


def _why(node: fx.Node, text: str) -> None:
    node.meta["meshc.why"] = f"fused kernel: {text}"


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


def _norm_roots(program: Program) -> list[tuple[fx.Node, fx.Node]]:
    """(norm output, its input s) for layer_norm, rms_norm and Hugging Face's written-out RMSNorm."""
    out = []
    for node in program.gm.graph.nodes:
        if _is(node, aten.layer_norm.default, aten.rms_norm.default):
            out.append((node, node.args[0]))
        elif _is(node, aten.rsqrt.default):
            found = _hf_rmsnorm(node)
            if found:
                out.append((found[0], found[1]))
    return out


def _hf_rmsnorm(rsqrt: fx.Node):
    """weight * to(to(s, f32) * rsqrt(mean(to(s, f32)^2, -1) + eps), dtype) -> (output, s, chain, weight, eps)."""
    add_eps = rsqrt.args[0]
    if not _is(add_eps, aten.add.Tensor) or not isinstance(add_eps.args[1], float):
        return None
    mean = add_eps.args[0]
    if not _is(mean, aten.mean.dim) or list(mean.args[1]) not in ([-1],) or not (len(mean.args) > 2 and mean.args[2]):
        return None
    power = mean.args[0]
    if not _is(power, aten.pow.Tensor_Scalar) or power.args[1] != 2:
        return None
    h = power.args[0]
    s = h.args[0] if _is(h, *TO) else h
    scaled = [u for u in rsqrt.users if _is(u, aten.mul.Tensor)]
    if len(scaled) != 1 or h not in scaled[0].args:
        return None
    tail = _only_user(scaled[0])
    cast = tail if _is(tail, *TO) else None
    final = _only_user(cast) if cast is not None else tail
    if not _is(final, aten.mul.Tensor):
        return None
    other = final.args[0] if final.args[1] is (cast or scaled[0]) else final.args[1]
    if not (isinstance(other, fx.Node) and other.meta.get("meshc.role") == "param") and not _param_like(other):
        return None
    chain = [n for n in (h if h is not s else None, power, mean, add_eps, rsqrt, scaled[0], cast, final) if n is not None]
    return final, s, chain, other, add_eps.args[1]


def _param_like(node) -> bool:
    """A parameter, maybe through getitem of a ZeRO/grad bucket."""
    while isinstance(node, fx.Node) and node.target is operator.getitem:
        node = node.args[0]
        if node.target in (zero_gather, zero_reduce) or getattr(node.target, "__name__", "") == "grad_sync":
            return True
    return isinstance(node, fx.Node) and node.meta.get("meshc.role") == "param"


def _from_reduction(node: fx.Node):
    """Walk back from an add operand through dropout / views / a bias add to a tp reduction."""
    between, bias, p = [], None, 0.0
    cur = node
    while True:
        if _is(cur, *REDUCTIONS):
            return cur, bias, list(reversed(between)), p
        if _is(cur, aten.dropout.default) and p == 0.0:
            p = float(cur.args[1])
        elif _is(cur, *VIEWS):
            pass
        elif _is(cur, aten.add.Tensor) and bias is None and _param_like(cur.args[1]):
            bias = cur.args[1]
        else:
            return None
        between.append(cur)
        cur = cur.args[0]


def norm_anchors(program: Program) -> list[fx.Node]:
    found = []
    for out, s in _norm_roots(program):
        if _is(s, aten.add.Tensor) and any(_from_reduction(a) for a in s.args if isinstance(a, fx.Node)):
            found.append(out)
    return found


def match_norm(program: Program, out: fx.Node):
    if _is(out, aten.layer_norm.default, aten.rms_norm.default):
        s = out.args[0]
        kind = "layernorm" if out.target == aten.layer_norm.default else "rmsnorm"
        if len(out.args[1]) != 1:
            return "normalized over more than the last dim"
        weight = out.args[2] if len(out.args) > 2 else None
        norm_bias = out.args[3] if kind == "layernorm" and len(out.args) > 3 else None
        eps = out.args[4 if kind == "layernorm" else 3] if len(out.args) > (4 if kind == "layernorm" else 3) else 1e-5
        chain = [out]
    else:
        _, s, chain, weight, eps = _hf_rmsnorm([n for n in out.graph.nodes if _is(n, aten.rsqrt.default)
                                                and _hf_rmsnorm(n) and _hf_rmsnorm(n)[0] is out][0])
        kind, norm_bias = "rmsnorm", None
    if weight is None:
        return "a norm without a weight"
    if s.meta.get("meshc.stage") != out.meta.get("meshc.stage"):
        return "a pipeline stage boundary lies between the residual add and the norm"
    for side, other in ((s.args[0], s.args[1]), (s.args[1], s.args[0])):
        found = _from_reduction(side) if isinstance(side, fx.Node) else None
        if found:
            x, bias, between, p = found
            if any(_only_user(n) is None for n in [x, *between]):
                return "a value inside the chain is used elsewhere"
            if not isinstance(other, fx.Node) or tuple(other.meta["val"].shape) != tuple(s.meta["val"].shape):
                return "the residual's shape differs from the sum's"
            alias = chain[0] if _is(chain[0], *TO) and chain[0].meta["val"].dtype == s.meta["val"].dtype else None
            inside = set(chain)
            if any(u not in inside and not _is(u, aten._assert_tensor_metadata.default)
                   for n in chain[:-1] if n is not alias for u in n.users):
                return "a value inside the norm is used elsewhere"
            order = {n: i for i, n in enumerate(s.graph.nodes)}
            users = [u for n in (s, alias) if n is not None for u in n.users
                     if u not in chain and not _is(u, aten._assert_tensor_metadata.default)]
            if any(order[u] < order[out] for u in users):
                return "the sum is used before the norm ends"
            return NormMatch(out, chain, s, x, bias, between, other, weight, norm_bias, p, kind, float(eps), alias)
    return "no reduction feeds the residual add"


def rewrite_norm(program: Program, m: NormMatch) -> None:
    graph = program.gm.graph
    _drop_asserts(m.s)
    with graph.inserting_before(m.out):  # where the norm ends: its inputs, weights included, exist by then
        x = m.x
        if any(_is(n, *VIEWS) for n in m.between):
            x = graph.call_function(aten.view.default, (m.x, list(m.s.meta["val"].shape)))
            _copy_meta(x, m.s)
            x.meta["meshc.why"] = "fused kernel: the reduction's output in the residual's shape"
        fused = graph.call_function(bias_dropout_add_norm, (x, m.bias, m.residual, m.weight, m.norm_bias),
                                    {"p": m.p, "norm": m.kind, "eps": m.eps})
        _why(fused, f"bias + dropout + residual add + {m.kind} after the reduction %{m.x.name}")
        y = graph.call_function(operator.getitem, (fused, 0))
        s = graph.call_function(operator.getitem, (fused, 1))
    _copy_meta(fused, m.s)
    _copy_meta(y, m.out)
    _copy_meta(s, m.s)
    y.meta["meshc.why"] = s.meta["meshc.why"] = "fused kernel output"
    m.out.replace_all_uses_with(y)
    m.s.replace_all_uses_with(s, delete_user_cb=lambda u: u not in m.chain)
    if m.alias is not None:  # the no-op cast of s: its other users read the new sum
        m.alias.replace_all_uses_with(s, delete_user_cb=lambda u: u not in m.chain)
    _erase(reversed(m.chain))
    _erase([m.s, *reversed(m.between)])


# ------------------------------------------------------------------------------ bias + activation
def _column_parallel(node: fx.Node):
    """Walk back through views to a matmul whose output is split on its last dim; (matmul, views)."""
    views = []
    while _is(node, *VIEWS):
        views.append(node)
        node = node.args[0]
    if not _is(node, aten.linear.default, aten.addmm.default, aten.mm.default):
        return None
    p = node.meta.get("meshc.placement", {}).get("tp")
    if isinstance(p, Shard) and p.dim == node.meta["val"].dim() - 1:
        return node, list(reversed(views))
    return None


def _gpt2_gelu(tanh: fx.Node):
    """0.5 * v * (1 + tanh(sqrt(2/pi) * (v + 0.044715 * v^3))) written out -> (output, v, chain)."""
    scale = tanh.args[0]
    if not _is(scale, aten.mul.Tensor) or not _close(scale.args[1], math.sqrt(2 / math.pi)):
        return None
    inner = scale.args[0]
    if not _is(inner, aten.add.Tensor):
        return None
    v, cubic = inner.args
    if not (_is(cubic, aten.mul.Tensor) and _close(cubic.args[1], 0.044715) and _is(cubic.args[0], aten.pow.Tensor_Scalar)
            and cubic.args[0].args == (v, 3.0)):
        return None
    one = _only_user(tanh)
    if not (_is(one, aten.add.Tensor) and one.args[1] == 1.0):
        return None
    final = _only_user(one)
    half = final.args[0] if final is not None and final.args[1] is one else None
    if not (_is(final, aten.mul.Tensor) and _is(half, aten.mul.Tensor) and half.args == (v, 0.5)):
        return None
    return final, v, [cubic.args[0], cubic, inner, scale, tanh, one, half, final]


def _close(value, want: float) -> bool:
    return isinstance(value, float) and abs(value - want) < 1e-6


def gelu_anchors(program: Program) -> list[fx.Node]:
    found = []
    for node in program.gm.graph.nodes:
        if _is(node, aten.gelu.default) and _column_parallel(node.args[0]):
            found.append(node)
        elif _is(node, aten.tanh.default):
            g = _gpt2_gelu(node)
            if g and _column_parallel(g[1]):
                found.append(g[0])
    return found


@dataclass
class ActMatch:
    out: fx.Node
    chain: list[fx.Node]
    value: fx.Node
    matmul: fx.Node
    approximate: str


def match_gelu(program: Program, out: fx.Node):
    if _is(out, aten.gelu.default):
        value, chain = out.args[0], [out]
        approximate = out.kwargs.get("approximate", out.args[1] if len(out.args) > 1 else "none")
    else:
        tanh = next(n for n in out.graph.nodes if _is(n, aten.tanh.default) and (_gpt2_gelu(n) or (None,))[0] is out)
        out, value, chain = _gpt2_gelu(tanh)
        approximate = "tanh"
    matmul, views = _column_parallel(value)
    inner = [v for v in chain if v is not out]
    if any(len([u for u in n.users if u not in chain]) for n in inner):
        return "a value inside the activation is used elsewhere"
    if any(_only_user(n) is None for n in [matmul, *views]) and not all(u in chain for u in value.users):
        return "the matmul's output is used elsewhere"
    return ActMatch(out, chain, value, matmul, approximate)


def _split_bias(graph: fx.Graph, matmul: fx.Node):
    """linear(x, W, b) -> linear(x, W); addmm(b, x, W) -> mm(x, W); returns the bias (or None)."""
    if _is(matmul, aten.linear.default) and len(matmul.args) > 2 and matmul.args[2] is not None:
        bias = matmul.args[2]
        matmul.args = matmul.args[:2]
        return bias
    if _is(matmul, aten.addmm.default):
        bias = matmul.args[0]
        matmul.target, matmul.args = aten.mm.default, (matmul.args[1], matmul.args[2])
        return bias
    return None


def rewrite_gelu(program: Program, m: ActMatch) -> None:
    graph = program.gm.graph
    bias = _split_bias(graph, m.matmul)
    with graph.inserting_before(m.out):
        node = graph.call_function(bias_gelu, (m.value, bias), {"approximate": m.approximate})
    _copy_meta(node, m.out)
    _why(node, f"bias + GeLU ({m.approximate}) after the column-parallel %{m.matmul.name}")
    m.out.replace_all_uses_with(node)
    _erase(reversed(m.chain))


def swiglu_anchors(program: Program) -> list[fx.Node]:
    found = []
    for node in program.gm.graph.nodes:
        if _is(node, aten.mul.Tensor) and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args):
            gate, up = node.args
            if _is(gate, aten.silu.default) and _column_parallel(gate.args[0]) and _column_parallel(up):
                found.append(node)
    return found


def match_swiglu(program: Program, out: fx.Node):
    silu, up = out.args
    if _only_user(silu) is None:
        return "silu's output is used elsewhere"
    return (out, silu, silu.args[0], up)


def rewrite_swiglu(program: Program, m) -> None:
    out, silu, gate, up = m
    graph = program.gm.graph
    biases = [_split_bias(graph, _column_parallel(t)[0]) if not _column_parallel(t)[1] else None for t in (gate, up)]
    with graph.inserting_before(out):
        node = graph.call_function(bias_swiglu, (gate, up, biases[0], biases[1]))
    _copy_meta(node, out)
    _why(node, "bias + SwiGLU after the column-parallel gate and up projections")
    out.replace_all_uses_with(node)
    _erase([out, silu])


# ------------------------------------------------------------------------------ ZeRO copies
def zero_gather_anchors(program: Program) -> list[fx.Node]:
    return [n for n in program.gm.graph.nodes if n.op == "call_function" and n.target is zero_gather]


def zero_reduce_anchors(program: Program) -> list[fx.Node]:
    return [n for n in program.gm.graph.nodes if n.op == "call_function" and n.target is zero_reduce]


def match_flag(program: Program, node: fx.Node):
    return node


def set_fused(program: Program, node: fx.Node) -> None:
    node.update_kwarg("fused", True)
    start = node.args[0] if node.target is zero_gather else None
    if isinstance(start, fx.Node):
        start.update_kwarg("fused", True)


# ------------------------------------------------------------------------------ collective matmuls
def ag_matmul_anchors(program: Program) -> list[fx.Node]:
    if not program.plan.collective_matmul:
        return []
    return [n for n in program.gm.graph.nodes if n.op == "call_function" and n.target is C.all_gather_rs]


def match_ag_matmul(program: Program, gather: fx.Node):
    users = list(gather.users)
    if not all(_is(u, aten.linear.default) and u.args[0] is gather for u in users):
        return "the gathered value feeds something other than linears"
    if gather.kwargs["chunks"] != 1:
        return "a gather of several blocks"
    return gather, users


def rewrite_ag_matmul(program: Program, m) -> None:
    gather, linears = m
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
    node.meta.update({k: v for k, v in gather.meta.items() if k in ("nn_module_stack", "meshc.stage")})
    node.meta["meshc.comm"] = gather.meta.get("meshc.comm", [])
    _why(node, "sequence parallel's all-gather overlapped with the column-parallel matmuls, ring by chunks")
    for i, lin in enumerate(linears):
        with graph.inserting_after(node):
            item = graph.call_function(operator.getitem, (node, i))
        _copy_meta(item, lin)
        item.meta["meshc.why"] = "fused kernel output"
        lin.replace_all_uses_with(item)
    _erase(linears)
    _erase([gather])


def mm_rs_anchors(program: Program) -> list[fx.Node]:
    if not program.plan.collective_matmul:
        return []
    return [n for n in program.gm.graph.nodes if n.op == "call_function" and n.target is C.reduce_scatter]


def match_mm_rs(program: Program, rs: fx.Node):
    lin = rs.args[0]
    if not _is(lin, aten.linear.default) or (len(lin.args) > 2 and lin.args[2] is not None):
        return "the reduce-scatter does not follow a bias-free linear"
    if _only_user(lin) is not rs or rs.kwargs["chunks"] != 1:
        return "the partial product is used elsewhere"
    return rs, lin


def rewrite_mm_rs(program: Program, m) -> None:
    rs, lin = m
    graph = program.gm.graph
    kw = rs.kwargs
    with graph.inserting_before(rs):
        node = graph.call_function(matmul_reduce_scatter, (lin.args[0], lin.args[1]), {
            "dim": kw["dim"], "size": kw["size"], "index": program.mesh.coord("tp", program.rank),
            "group": kw["group"], "ranks": program.mesh.group_ranks("tp", program.rank)})
    _copy_meta(node, rs)
    node.meta["meshc.comm"] = rs.meta.get("meshc.comm", [])
    _why(node, "the row-parallel matmul's reduce-scatter overlapped with it, ring by chunks")
    rs.replace_all_uses_with(node)
    _erase([rs, lin])
