"""tp_placement: decide every parameter's placement on the tp axis (the decision; tensor_parallel is the mechanism).

Purpose: the automatic Megatron-LM plan, found from the graph rather than from module names: linear layers
(aten.linear, or a matmul/mm/bmm by a transposed weight such as Falcon's `x @ weight.T`) that read the same
activation (q/k/v, MLP up/gate) are tried column-parallel together; their sharded
outputs are followed op by op (with the same rules the tensor_parallel pass uses) and must reach linear
layers that can consume them row-parallel (attention output, MLP down) without any communication in
between. Members whose flow cannot stay sharded are dropped and the rest tried again: a k/v projection
with fewer heads than tp is replicated (as for MQA), others that do not divide tp are an error. Explicit
styles by module glob (Plan.tp) override the automatic ones; Plan.vocab_parallel shards the token
embedding and the LM head over the vocabulary.

Requires: "meshc.shape" on every value (shapes pass).
Ensures: ParamSpec.placements["tp"] set for every parameter (R unless a style shards it); notes say which
    modules became column/row-parallel and why others stayed replicated. With tp = 1, no change.
Terms: colwise = output features split (weight S(out dim), bias S(0)); rowwise = input features split
    (weight S(in dim), bias kept whole and added after the reduction); chunks = blocks of a fused
    projection (GPT-2's c_attn holds q, k and v: each is split on its own), found from the split, chunk or
    slices that cut its output; blocks of unequal sizes (Phi-3's q|k|v under GQA) are kept as their sizes.
    Coverage: the share of the blocks' weight bytes sharded (compiler/ir/coverage.py); every replicated block
    module gets a reason in Program.tp_why; below one half compile warns, below Plan.min_tp_coverage it fails.

Before: p_layers_0_attention_wq_weight  tp:R          After: tp:S(0)
"""
from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from meshc.compiler.ir.coverage import block_weights, coverage
from meshc.compiler.ir.errors import MeshcValueError, MeshcWarning, warn
from meshc.compiler.ir.logits import logits_end
from meshc.compiler.ir.fx_ops import get_arg, is_grouped_mm, is_model_input, op_name, written_in_place
from meshc.compiler.ir.placement import Owned, Partial, Replicate, Shard, Whole, as_chunks, in_parts, owned_elsewhere
from meshc.compiler.ir.plan import Decision
from meshc.compiler.ir.program import FQN, ROLE, TP_FACTORY, Program
from meshc.compiler.ir.sizes import bounded_sizes

from meshc.passes.blocks import block_of
from meshc.passes.sharding.whole_graph import Option, choose, score
from meshc.passes.shapes import shard_divides
from meshc.passes.sharding.branches import branch_groups
from meshc.passes.sharding.buffers import written_factory
from meshc.passes.sharding.loops import Loop, loop_of
from meshc.passes.tp_parts import bias_piece, chunks_of, linear_of_index, param_sources, weight_pieces
from meshc.passes.tp_rules import RuleCtx
from meshc.passes.tp_table import infer

AXIS = "tp"
aten = torch.ops.aten


@dataclass
class Weight:
    fqn: str
    module: str
    # "linear" (out, in) | "conv1d" (in, out) | "embedding" (rows, dim) | "experts" (E, out, in) read transposed by a
    # grouped matmul, or one linear per index (`F.linear(rows, weight[i])`: JetMoE's loop, the others in `also`) |
    # "experts_io" (E, in, out) read as it is by a grouped matmul or a bmm (GPT-OSS, Llama 4)
    kind: str
    node: fx.Node  # the op that uses it
    act: fx.Node | None  # the activation it multiplies
    bias: str | None
    chunks: int | tuple[int, ...]
    key: str = ""  # the weights' and styles' key: the FQN, or "fqn[i]" for piece i of a weight cut before its linears
    rows: int = 0  # a piece's rows of the weight (0: not a piece)
    also: tuple[fx.Node, ...] = ()  # the other layers of a stack read by index (weight[i]): placed, tried, paired alike

    def __post_init__(self) -> None:
        self.key = self.key or self.fqn

    @property
    def out_dim(self) -> int:
        return {"conv1d": 1, "experts": 1, "experts_io": 2}.get(self.kind, 0)

    @property
    def in_dim(self) -> int:
        return {"conv1d": 0, "experts": 2}.get(self.kind, 1)


def tp_placement_pass(program: Program) -> Program:
    n = program.mesh.size(AXIS)
    if n == 1:
        return program.unchanged("tp = 1: every parameter replicated on tp")
    program = program.copy()
    fixed = program.fixed_placements or {}
    if fixed and all(f in fixed for f in program.params):  # another program of the same job decided already
        for fqn, spec in program.params.items():
            spec.placements = dict(fixed[fqn])
        _mark_held(program)
        program.notes.append("placements taken from the job's first program")
        return program
    weights = _weights(program)
    styles: dict[str, str] = {}
    vocab = program.decisions.get("vocab_parallel")  # the plan's, or the cost model's where it left it open
    if program.plan.vocab_parallel or (program.plan.vocab_parallel is None and vocab is not None and vocab.value):
        styles.update(_vocab_styles(program, weights))
    auto, companions, owned = _megatron(program, weights, n)
    styles.update({k: v for k, v in auto.items() if k not in styles})
    for glob, style in (program.plan.tp or {}).items():
        matched = [w for w in weights.values() if fnmatch.fnmatchcase(w.module, glob) or fnmatch.fnmatchcase(w.fqn, glob)]
        if not matched:
            sample = ", ".join(sorted({w.module for w in weights.values()})[:6])
            raise MeshcValueError(f"Plan.tp[{glob!r}]: expected the glob to match a module with a weight, got no "
                                  f"match; modules look like: {sample}")
        for w in matched:
            styles[w.key] = style
    for key, style in styles.items():
        if not weights[key].rows:
            _apply(program, weights[key], style)
        if style == "replicate":
            program.tp_why[weights[key].module] = "Plan.tp asks for it"
    _apply_pieces(program, weights, styles)
    for fqn, (placement, keys) in companions.items():  # sharded with their column group, where it stays sharded
        if isinstance(fqn, fx.Node):  # a buffer the group's writes fill (passes/sharding/buffers.py)
            if all(styles.get(k) == "colwise" for k in keys):
                fqn.meta[TP_FACTORY] = placement
        elif all(styles.get(k) == "colwise" for k in keys) and fqn not in styles:
            program.params[fqn].placements[AXIS] = placement
    for fqn, coord in owned.items():  # whole heads on each rank, unless Plan.tp styled them
        if not any(w.fqn == fqn and w.key in styles for w in weights.values()):
            program.params[fqn].placements[AXIS] = Owned(coord)
    for fqn, placements in fixed.items():  # decided by an earlier graph (torch.compile's graph breaks)
        if fqn in program.params:
            program.params[fqn].placements = dict(placements)
    _mark_held(program)
    _untried_reasons(program, weights)
    _row_reasons(program, weights)
    col = sorted({weights[f].module for f, s in styles.items() if s == "colwise"})
    row = sorted({weights[f].module for f, s in styles.items() if s == "rowwise"})
    program.notes.append(f"tp={n}: {len(col)} column-parallel, {len(row)} row-parallel modules, "
                         f"{sum(s == 'vocab' for s in styles.values())} vocab-parallel")
    _check_coverage(program, n)
    return program


def _untried_reasons(program: Program, weights: dict[str, Weight]) -> None:
    """A reason for every block weight the Megatron trials never took up."""
    nodes = program.param_nodes()
    used = {w.fqn for w in weights.values()}
    bias_of = {w.bias: w for w in weights.values() if w.bias}
    for spec in block_weights(program.params):
        module = spec.fqn.rsplit(".", 1)[0]
        if module in program.tp_why or spec.fqn not in nodes or isinstance(spec.placements.get(AXIS), (Shard, Owned)):
            continue
        uses = sorted({op_name(u.target) for u in nodes[spec.fqn].users})
        if spec.fqn in bias_of:  # a per-expert bias (2-D) of a row-parallel layer
            why = (f"{spec.fqn.rsplit('.', 1)[1]}: the bias of row-parallel {bias_of[spec.fqn].fqn.rsplit('.', 1)[1]}, "
                   f"added whole after the reduction as Megatron does")
        elif spec.fqn not in used:
            why = f"not the weight of a linear, matmul or embedding (used by {', '.join(uses) or 'nothing'})"
        elif not spec.requires_grad:
            why = "frozen (requires_grad=False)"
        elif len(nodes[spec.fqn].users) > 1:
            why = f"used by {len(nodes[spec.fqn].users)} ops ({', '.join(uses)})"
        else:
            why = "no row-parallel layer consumes its output"
        program.tp_why[module] = why


NORMS = (aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default)


def _row_reasons(program: Program, weights: dict[str, Weight]) -> None:
    """A replicated layer fed (within its block, past no norm) by another replicated layer could only have been
    its row-parallel consumer: say so, rather than why it failed as a column-parallel layer itself."""
    by_node = {w.node: w for w in weights.values() if w.kind != "embedding"}
    whole = lambda w: not isinstance(program.params[w.fqn].placements.get(AXIS), (Shard, Owned))
    for w in by_node.values():
        if not whole(w) or not isinstance(w.act, fx.Node):
            continue
        block, frontier, seen = block_of(w.node), [w.act], set()
        while frontier:
            cur = frontier.pop()
            if cur in seen or cur.op != "call_function" or cur.target in NORMS or block_of(cur) != block:
                continue
            seen.add(cur)
            src = by_node.get(cur)
            if src is not None and src.module != w.module:
                if whole(src):
                    name = src.module[len(block) + 1:] if src.module.startswith(block + ".") else src.module
                    program.tp_why[w.module] = f"its input comes from {name}, which stays replicated"
                break
            frontier.extend(a for a in cur.all_input_nodes if _floating(a))  # not routing ids nor counts


def _floating(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _check_coverage(program: Program, n: int) -> None:
    """Warn when tp shards less than half of the blocks' weight bytes; Plan.min_tp_coverage makes a floor an error."""
    cov = coverage(program.params, {AXIS: n}, program.tp_why)
    frac = cov.fractions.get(AXIS, 1.0)
    program.notes.append(f"tp coverage: {frac:.2f} of the blocks' weight bytes sharded")
    floor = program.plan.min_tp_coverage
    listing = "; ".join(f"{m}: {r}" for m, r in cov.replicated[:12])
    more = f"; and {len(cov.replicated) - 12} more" if len(cov.replicated) > 12 else ""
    if floor is not None and frac < floor:
        raise MeshcValueError(f"Plan.min_tp_coverage: expected at least {floor:.2f} of the blocks' weight bytes "
                              f"sharded on tp={n}, got {frac:.2f}; replicated: {listing}{more}. Shard those modules "
                              "with Plan(tp={'<module glob>': 'colwise'|'rowwise'}), use a smaller tp, or lower "
                              "min_tp_coverage")
    if frac < 0.5 and cov.total_bytes:
        text = (f"tp={n} shards {frac:.2f} of the blocks' weight bytes (every tp rank holds and computes the rest): "
                f"{listing}{more}")
        program.warnings.append(text)
        warn(text, MeshcWarning)


def _apply(program: Program, w: Weight, style: str) -> None:
    spec = program.params[w.fqn]
    ndim = len(spec.shape)
    if style == "replicate":
        placement, bias = Replicate(), Replicate()
    elif w.kind == "embedding":
        placement = Shard(1) if style == "colwise" else Shard(0)
        bias = Replicate()
    elif style in ("colwise", "vocab"):  # a bias (out,), or per expert (E, out)
        placement, bias = Shard(w.out_dim, w.chunks), Shard(1 if w.kind.startswith("experts") else 0, w.chunks)
    else:
        placement, bias = Shard(w.in_dim if ndim >= 2 else 0), Replicate()
    spec.placements[AXIS] = placement
    if w.bias:
        program.params[w.bias].placements[AXIS] = bias


def _apply_pieces(program: Program, weights: dict[str, Weight], styles: dict[str, str]) -> None:
    """A weight cut into pieces before its linears: one placement for the whole, each column-parallel piece's
    blocks sharded and every other piece held whole by every rank (Whole blocks); its bias, cut alike, the same."""
    by_fqn: dict[str, list[Weight]] = {}
    for w in weights.values():
        if w.rows:
            by_fqn.setdefault(w.fqn, []).append(w)
    for fqn, pieces in by_fqn.items():
        program.params[fqn].placements[AXIS] = _pieces_placement([(w.rows, w) for w in pieces], styles)
    _apply_bias_pieces(program, weights, styles)


def _pieces_placement(pieces: list[tuple[int, Weight]], styles: dict[str, str]):
    """S(0) over the blocks of (rows, the Weight whose output they make) pieces in order: a column-parallel
    Weight's chunks, a Whole block where it is replicated; R where every piece is."""
    blocks: list = []
    for rows, w in pieces:
        if styles.get(w.key) == "colwise":
            blocks += list(w.chunks) if isinstance(w.chunks, tuple) else [rows // w.chunks] * w.chunks
        else:
            blocks.append(Whole(rows))
    return Replicate() if all(isinstance(b, Whole) for b in blocks) else Shard(0, as_chunks(blocks))


def _apply_bias_pieces(program: Program, weights: dict[str, Weight], styles: dict[str, str]) -> None:
    """A bias parameter cut into pieces, each added by one linear (nn.MultiheadAttention's in_proj_bias beside
    separate q/k/v weights, or beside a weight cut alike): each piece's blocks as its linear's output is sharded,
    held whole where that linear is replicated."""
    parts: dict[str, dict[int, tuple[int, Weight]]] = {}
    for w in weights.values():
        found = bias_piece(w.node) if w.kind == "linear" else None
        if found:
            parts.setdefault(found[0], {})[found[1]] = (found[2], w)
    nodes = program.param_nodes()
    for fqn, by_index in parts.items():
        uses = nodes[fqn].users
        if sorted(by_index) != list(range(len(by_index))) or len(uses) != 1 or \
                len(next(iter(uses)).users) != len(by_index):
            continue  # a piece read by anything but one linear: left as the rules place it
        program.params[fqn].placements[AXIS] = _pieces_placement([by_index[i] for i in sorted(by_index)], styles)


# ---------------------------------------------------------------------------------------- weights
def _weights(program: Program) -> dict[str, Weight]:
    """Every 2-D trainable parameter used as a matmul weight or embedding table, and every stack of experts'
    weights (E, out, in) used by a grouped matmul, by FQN."""
    out: dict[str, Weight] = {}
    n = program.mesh.size(AXIS)
    for fqn, node in program.param_nodes().items():
        spec = program.params[fqn]
        if len(spec.shape) != 2 and not (len(spec.shape) == 3 and any(_expert_use(u, node) or linear_of_index(u, node)
                                                                       for u in node.users)):
            continue
        pieces = weight_pieces(node) if len(spec.shape) == 2 else None
        for i, (rows, linear) in enumerate(pieces or ()):  # cut before its linears: one Weight per piece
            w = Weight(fqn, fqn.rsplit(".", 1)[0], "linear", linear, linear.args[0], None, chunks_of(linear, n),
                       key=f"{fqn}[{i}]", rows=rows)
            out[w.key] = w
        for use in node.users:
            w = _as_weight(program, fqn, node, use)
            if w and fqn not in out:
                out[fqn] = w
    return out


def _as_weight(program, fqn, node, use) -> Weight | None:
    module, n = fqn.rsplit(".", 1)[0], program.mesh.size(AXIS)
    bias_of = lambda b: b.meta.get("meshc.fqn") if isinstance(b, fx.Node) and b.op == "placeholder" else None
    if use.target == aten.linear.default and use.args[1] is node:
        bias = bias_of(use.args[2]) if len(use.args) > 2 else None
        return Weight(fqn, module, "linear", use, use.args[0], bias, chunks_of(use, n))
    if use.target == aten.addmm.default and use.args[2] is node:
        return Weight(fqn, module, "conv1d", use, use.args[1], bias_of(use.args[0]), chunks_of(use, n))
    if use.target in (aten.mm.default, aten.matmul.default) and use.args[1] is node:
        return Weight(fqn, module, "conv1d", use, use.args[0], None, chunks_of(use, n))
    if _swaps_2d(use) and len(use.users) == 1:  # x @ weight.T: a linear layer written by hand (Falcon)
        (mm,) = use.users
        if mm.target in MATMULS and mm.args[1] is use and len(mm.args) == 2:
            return Weight(fqn, module, "linear", mm, mm.args[0], None, chunks_of(mm, n))
    if use.target == aten.embedding.default and use.args[0] is node:
        return Weight(fqn, module, "embedding", use, use.args[1], None, 1)
    stacked = linear_of_index(use, node)
    if stacked:  # one linear layer per index of a stack (E, out, in), read as weight[i] (JetMoE's experts)
        others = tuple(x for x in (linear_of_index(u, node) for u in node.users) if x is not None and x is not stacked)
        return Weight(fqn, module, "experts", stacked, stacked.args[0], None, chunks_of(stacked, n), also=others)
    kind = _expert_use(use, node)
    if kind:  # experts: a linear layer each, (E, out, in) read as (E, in, out) through a transpose, or (E, in, out)
        mm = use if kind == "experts_io" else next(iter(use.users))
        return Weight(fqn, module, kind, mm, mm.args[0], _expert_bias(mm), chunks_of(mm, n))
    return None


def _expert_use(use: fx.Node, weight: fx.Node) -> str | None:
    """How `use` reads a 3-D weight as the experts of a grouped matmul or a bmm (every expert over its own rows):
    "experts" through a transpose of its last two dims, "experts_io" as it is; None otherwise."""
    if use.op != "call_function" or len(weight.meta.get("meshc.shape") or ()) != 3:
        return None
    if (is_grouped_mm(use) or use.target == aten.bmm.default) and use.args[1] is weight and use.args[0] is not weight:
        return "experts_io"
    if use.target != aten.transpose.int or {d % 3 for d in use.args[1:3]} != {1, 2} or len(use.users) != 1:
        return None
    (mm,) = use.users
    return "experts" if is_grouped_mm(mm) and mm.args[1] is use else None


def _expert_bias(mm: fx.Node) -> str | None:
    """The per-expert bias (E, out) a grouped matmul's output is added to, gathered per row by the rows' expert ids
    (`out + bias[ids]`: GPT-OSS), if any."""
    for add in mm.users:
        if add.target not in (aten.add.Tensor, aten.add_.Tensor) or len(add.args) != 2 or mm not in add.args:
            continue
        other = add.args[1] if add.args[0] is mm else add.args[0]
        if isinstance(other, fx.Node) and other.target == aten.index.Tensor and len(other.users) == 1:
            table = other.args[0]
            if table.op == "placeholder" and len(table.meta.get("meshc.shape") or ()) == 2 and \
                    len(other.args[1]) == 1:
                return table.meta.get("meshc.fqn")
    return None


MATMULS = (aten.mm.default, aten.matmul.default, aten.bmm.default)


def _swaps_2d(node: fx.Node) -> bool:
    """Is `node` the transpose of a 2-D tensor: t, numpy_T (`.T`), mT, adjoint, transpose(0, 1), permute([1, 0])?"""
    if node.op != "call_function" or len(node.meta.get("meshc.shape") or ()) != 2:
        return False
    if node.target in (aten.t.default, aten.numpy_T.default, aten.mT.default, aten.adjoint.default):
        return True
    if node.target == aten.transpose.int:
        return {d % 2 for d in node.args[1:3]} == {0, 1}
    return node.target == aten.permute.default and [d % 2 for d in node.args[1]] == [1, 0]


def _vocab_styles(program: Program, weights: dict[str, Weight]) -> dict[str, str]:
    """The token embedding (indexed by a model input) and every matmul weight with that many output rows."""
    tokens = _token_embeddings(weights)
    if not tokens:
        raise MeshcValueError("Plan.vocab_parallel: expected a token embedding indexed by a model input, got none")
    return {**{w.key: "vocab" for w in tokens},
            **{key: "vocab" for key in _lm_heads(program, weights) if logits_end(weights[key].node)}}


def _token_embeddings(weights: dict[str, Weight]) -> list[Weight]:
    return [w for w in weights.values() if w.kind == "embedding" and is_model_input(w.act)]


def _lm_heads(program: Program, weights: dict[str, Weight]) -> set[str]:
    """The LM heads: matmul weights with as many output rows as the token embedding has (the first one indexed by a
    model input), whose logits go to the output or a loss through views and pointwise ops (a scale, a softcap);
    none without a token embedding."""
    tokens = _token_embeddings(weights)
    if not tokens:
        return set()
    vocab = program.params[tokens[0].fqn].shape[0]
    return {w.key for w in weights.values() if w.kind != "embedding" and not w.rows and
            program.params[w.fqn].shape[w.out_dim] == vocab and logits_end(w.node, pointwise=True)}


# ---------------------------------------------------------------------------------------- Megatron
def _megatron(program: Program, weights: dict[str, Weight], n: int):
    """(styles by weight key, {FQN: (placement, its group's keys)} of the other parameters a column group's flow
    reads sharded: a depthwise conv's filters, per-head vectors)."""
    param_at = program.param_nodes()
    candidates = [w for w in weights.values() if w.kind != "embedding" and program.params[w.fqn].requires_grad
                  and (len(param_at[w.fqn].users) == 1 or _applied_alike(program, w, param_at[w.fqn]))]
    groups: dict[object, list[Weight]] = {}
    order = _order(program)
    for w in sorted(candidates, key=lambda w: order[w.node]):  # a weight's pieces tried together, whatever they read
        groups.setdefault(w.fqn if w.rows else w.act, []).append(w)
    styles: dict[str, str] = {}
    companions: dict[str, tuple[Shard, tuple[str, ...]]] = {}
    greedy: list[Option] = []
    # row layers: whole weights, none an LM head (its logits' traffic is the vocabulary decision's to weigh: a row-
    # parallel head all-reduces the logits, more than the vocabulary-parallel head moves to save the same bytes)
    heads = _lm_heads(program, weights)
    by_node = {w.node: w for w in weights.values() if w.kind != "embedding" and not w.rows and w.key not in heads}
    by_node.update({x: replace(w, node=x, act=x.args[0]) for w in list(by_node.values()) for x in w.also})
    nodes = list(program.gm.graph.nodes)
    candidate_keys = {w.key for w in candidates}  # a partner is one: trainable, its uses all one kind of layer
    partners = {x: weights[w.key] for x, w in by_node.items() if w.key in candidate_keys}  # a stack's layer: the stack
    walk = (nodes, order, by_node, loop_of(program.gm.graph), partners)
    for members in groups.values():
        found = _pairing(walk, [m for m in members if m.key not in styles], styles, n,
                         lambda result, tried: _explain_failure(program, result, tried, n))
        if found:
            members, result = found
            before = set(styles)  # a partner taken earlier (RWKV's key, with value) is scored once
            _take(program, weights, found, styles, companions)
            program.notes.append(f"auto: {_names(members)} column-parallel -> {_names(result.rows)} row-parallel")
            greedy.append(_option(program, [m for m in members if m.key not in before],
                                  [r for r in result.rows if r.key not in before], n))
    styles, companions = _whole_graph(program, weights, list(groups.values()), walk, n, (styles, companions), greedy)
    return styles, companions, _owned_branches(program, walk, styles, n)


def _owned_branches(program: Program, walk: tuple, styles: dict[str, str], n: int) -> dict[str, int]:
    """{FQN: the tp coordinate holding it whole} for the parameters of branches over their own parameters
    (passes/sharding/branches.py: a ModuleList of per-head modules), each rank its share of whole heads, where the
    branches' cat reaches row-parallel layers (the attention's output projection), as a column layer's output
    would; those become row-parallel (`styles`). None of a group's parameters may be sharded otherwise."""
    out: dict[str, int] = {}
    joins = {lp.join for lp in walk[3].values()}
    for group in branch_groups(program.gm.graph):
        params = [p.meta[FQN] for ps in group.own for p in ps if p.meta.get(ROLE) == "param"]
        modules = sorted({f.rsplit(".", 1)[0] for f in params})
        where = f"{len(params)} parameters of the {group.count} branches joined at %{group.join.name}"
        if group.join in joins or any(w.split("[")[0] in params for w in styles) or \
                not all(program.params[f].requires_grad for f in params):
            continue
        written = sorted(p.meta[FQN] for ps in group.own for p in ps if p.meta.get(ROLE) == "buffer" and
                         (p.meta[FQN] in program.mutated_buffers or written_in_place(p) is not None))
        if group.count % n or group.dim != len(group.join.meta["meshc.shape"]) - 1 or written:
            why = f"{group.count} branches do not divide over tp={n}" if group.count % n else \
                f"joined on dim {group.dim}, not the features" if not written else \
                f"the branches update buffers of their own ({written[0]}, ...), which every rank must hold alike"
            program.notes.append(f"auto: {where} replicated: {why}")
            continue
        seed = Weight("", modules[0], "linear", group.join, None, None, 1, key=f"branches:{group.join.name}")
        result = _trial(*walk[:4], [seed], styles, n)
        if not result.rows:
            program.notes.append(f"auto: {where} replicated: {result.reason}")
            continue
        styles.update({r.key: "rowwise" for r in result.rows})
        k = group.count // n
        for g, ps in enumerate(group.own):
            out.update({p.meta[FQN]: g // k for p in ps if p.meta.get(ROLE) == "param"})
        named = [m.rsplit(".", 1)[0] for m in modules] + [r.module for r in result.rows]
        stale = re.compile("|".join(rf"(?<![\w.]){re.escape(m)}(?!\w)" for m in named))
        program.notes = [t for t in program.notes if not (t.startswith("auto: ") and stale.search(t))]  # failed
        for m in modules:  # as column layers, before
            program.tp_why.pop(m, None)
        program.notes.append(f"auto: {where} held whole by their tp rank, {k} branches each -> "
                             f"{_names(result.rows)} row-parallel")
    return out


def _mark_held(program: Program) -> None:
    """Which parameters this program's rank holds: all but those another tp rank owns."""
    coord = program.mesh.coord(AXIS, program.rank)
    for spec in program.params.values():
        spec.held = not owned_elsewhere(spec.placements.get(AXIS), coord)


def _applied_alike(program: Program, w: Weight, node: fx.Node) -> bool:
    """Is every use of `w`'s parameter the same kind of layer as the one tried (a block applied several times with
    one set of weights: ALBERT's shared layer, a looped block)? The trial pairs its first use; the tensor_parallel
    pass then places every other use by the same rules, each column use's output sharded alike."""
    if w.rows:
        return False
    uses = [_as_weight(program, w.fqn, node, use) for use in node.users]
    return all(u is not None and u.kind == w.kind and u.bias == w.bias for u in uses)


_PARTNER_SEARCH = 64  # nodes looked at upstream of a failed meeting: a layer's output a few views and ops away (a
# buffer made like it, a select of it), not a search through earlier blocks


def _pairing(walk: tuple, members: list[Weight], styles: dict[str, str], n: int, failed=None):
    """(members, the trial that found their row layers) for the first trial that does, the members its failures
    blamed dropped one trial after another; None where none does. `failed(result, members)` hears each failure."""
    joined: set[str] = set()  # partners tried: each once
    while members:
        result = _trial(*walk[:4], members, styles, n)
        found = _with_buffers(walk, members, styles, n, result)
        if found:
            return found
        if result.rows:
            return members, result
        if result.rechunk and all(m.chunks == 1 for m in members):  # a chunk of the heads into c groups (DiffLlama's
            found = _in_blocks(walk, members, result.rechunk, styles, n, failed)  # head pairs): the members sharded
            if found:                                                               # in c blocks instead
                return found
        partner = _partner(walk[4], members, styles, result)
        if partner is not None and partner.key not in joined:  # tried once with it; else the failure stands
            joined.add(partner.key)
            merged = _trial(*walk[:4], [*members, partner], styles, n)
            if merged.rows:
                return [*members, partner], merged
        if result.indivisible and n % result.indivisible[1]:  # an error only where the layers would shard otherwise:
            whole = _trial(*walk[:4], members, styles, 1)  # an LM head whose vocabulary tp does not divide, read by no
            if not whole.rows:  # row layer, is replicated for that, as before any size was looked at
                result = whole
        if failed is not None:
            failed(result, members)
        if not result.blamed:
            return None
        members = [m for m in members if m.key not in result.blamed]
    return None


_BUFFERS = 8  # buffers seeded sharded in one pairing, at most (a scan's states, normalizers, maxima, ...)


def _with_buffers(walk: tuple, members: list[Weight], styles: dict[str, str], n: int, result: _Trial):
    """(members, trial) where a trial that failed at a write into a buffer made from sizes alone (written_factory)
    finds its row layers with such buffers seeded sharded, one more each time a write into another needs it; None
    where it does not (the first failure then stands)."""
    buffers: dict = {}
    while not result.rows and result.factory is not None and result.factory[0] not in buffers and \
            len(buffers) < _BUFFERS:
        buffers = {**buffers, result.factory[0]: result.factory[1]}
        result = _trial(*walk[:4], members, styles, n, buffers)
    return (members, result) if result.rows and buffers else None


def _in_blocks(walk: tuple, members: list[Weight], c: int, styles: dict[str, str], n: int, failed):
    """_pairing of `members` sharded in c blocks (S(0)xc: each rank its share of each of c groups of heads), where a
    plain shard failed because a chunk cut it into c: what is found, its failures told to `failed` only then (an
    indivisible size that is an artifact of the blocks is not an error); None where nothing is."""
    told: list = []
    found = _pairing(walk, [replace(m, chunks=c) for m in members], styles, n, lambda r, t: told.append((r, t)))
    if found and failed is not None:
        for result, tried in told:
            if not result.indivisible or n % result.indivisible[1] == 0:
                failed(result, tried)
    return found


def _partner(partners: dict, members: list[Weight], styles: dict[str, str], result: _Trial) -> Weight | None:
    """The column candidate, not a member, whose output a failed trial's flow met whole where it needed the two to
    match (RWKV's time mixing: the value projection's flow writes into a buffer made like the key projection's
    output, `out = zeros_like(k); out[:, t] = ...`); tried together, both flows are sharded and meet shard to
    shard. Found upstream of the meeting op's inputs that the flow did not reach, stopping at every candidate's
    output; `partners` maps each candidate's output node to it."""
    if result.met is None:
        return None
    keys = {m.key for m in members}
    frontier = [a for a in result.met.all_input_nodes if a not in result.placed]
    seen: set[fx.Node] = set()
    while frontier and len(seen) < _PARTNER_SEARCH:
        x = frontier.pop(0)
        if x in seen or x in result.placed:
            continue
        seen.add(x)
        w = partners.get(x)
        if w is not None:
            if w.key not in keys and styles.get(w.key) != "rowwise":
                return w
            continue
        if x.op == "call_function":
            frontier += x.all_input_nodes
    return None


def _take(program: Program, weights: dict[str, Weight], found: tuple, styles: dict, companions: dict) -> None:
    """Record a pairing (members, trial): its members column-, its row layers row-parallel, and the other
    parameters its flow reads sharded as the members' companions."""
    members, result = found
    weights.update({m.key: m for m in members if m.chunks != weights[m.key].chunks})  # sharded in blocks: _pairing's
    styles.update({m.key: "colwise" for m in members})
    styles.update({r.key: "rowwise" for r in result.rows})
    companions.update({f: (p, tuple(m.key for m in members)) for f, p in (result.params or {}).items()
                       if f in program.params and f not in weights})
    companions.update({x: (p, tuple(m.key for m in members)) for x, p in (result.factories or {}).items()})


def _whole_graph(program: Program, weights: dict[str, Weight], groups: list, walk: tuple, n: int, taken: tuple,
                 greedy: list[Option]):
    """Every group's pairing found on its own (no other group's choice in the way), a conflict-free set of them
    chosen over the whole graph (passes/sharding/whole_graph.py); returned in place of the greedy `taken`
    (styles, companions) only where it scores strictly better: more weight bytes sharded, or as many with less
    predicted communication."""
    found = [pair for pair in (_pairing(walk, members, {}, n) for members in groups) if pair]
    options = [_option(program, members, result.rows, n) for members, result in found]
    picked = choose(options)
    chosen = [options[i] for i in picked]
    if score(chosen) <= score(greedy):
        return taken
    styles: dict[str, str] = {}
    companions: dict[str, tuple[Shard, tuple[str, ...]]] = {}
    for i in picked:
        _take(program, weights, found[i], styles, companions)
    pairs = "; ".join(f"{_names(found[i][0])} -> {_names(found[i][1].rows)}" for i in picked)
    mine, theirs = sum(o.comm_bytes for o in chosen), sum(o.comm_bytes for o in greedy)
    why = (f"{score(chosen)[0]} vs {score(greedy)[0]} weight bytes sharded, predicted {mine} vs {theirs} bytes of tp "
           f"collectives a step, against Megatron's pairing taken in graph order")
    program.notes.append(f"tp: whole-graph choice: {pairs} ({why})")
    program.decisions["tp_plan"] = Decision("whole-graph", why)
    by_key = {w.key: w for members, result in found for w in [*members, *result.rows]}
    for key in taken[0]:
        if key not in styles and key in by_key:  # named beside the chosen pairing that took its partner
            lost = next((o.keys for o in greedy if key in o.keys), frozenset())
            rival = next((i for i in picked if options[i].keys & lost), None)
            instead = f"{_names(found[rival][0])} -> {_names(found[rival][1].rows)}" if rival is not None else pairs
            program.tp_why[by_key[key].module] = (f"left replicated: the whole-graph choice pairs {instead}, "
                                                  f"sharding more bytes or moving fewer")
    for key in styles:
        program.tp_why.pop(by_key[key].module, None)
    return styles, companions


def _option(program: Program, members: list[Weight], rows: list[Weight], n: int) -> Option:
    """A group's pairing as whole_graph scores it: the weight bytes it shards; the forward all-reduce of every row
    layer's output and the backward all-reduce of the gradient of every input its column layers read, timed by
    the program's hardware profile (bytes where it has none)."""
    rows = list({r.key: r for r in rows}.values())  # a stack's layers, each paired: one weight
    sharded, payloads = 0, [_nbytes(x) for r in rows for x in (r.node, *r.also)]
    for w in [*members, *rows]:
        spec = program.params[w.fqn]
        whole = math.prod(int(d) for d in spec.shape) * spec.dtype.itemsize
        sharded += whole * w.rows // int(spec.shape[0]) if w.rows else whole
    payloads += [_nbytes(a) for a in dict.fromkeys(m.act for m in members) if isinstance(a, fx.Node)]
    hw = program.hardware
    time = sum(hw.link(1, n).time("all_reduce", n, b) if hw is not None else float(b) for b in payloads)
    keys = frozenset(w.key for w in [*members, *rows])
    return Option(keys, sharded, time, sum(payloads), (tuple(sorted(re.sub(r"\.\d+\.", ".*.", k, count=1)
                                                                     for k in keys)), sharded, sum(payloads)))


def _nbytes(node: fx.Node) -> int:
    """The bytes of `node`'s value; a dim known only at run time (rows routed to an expert) at the largest size
    its trace allows (all the rows it picks from), 1 where unbounded."""
    return math.prod(bounded_sizes(node)) * node.meta["val"].dtype.itemsize


@dataclass
class _Trial:
    rows: list[Weight]
    blamed: set[str]
    reason: str = ""
    indivisible: tuple[str, int] | None = None
    params: dict[str, Shard] | None = None  # parameters the flow reads sharded (none a Weight's): FQN -> placement
    met: fx.Node | None = None  # where the flow needed an input whole (a whole buffer it writes into, RWKV's)
    placed: frozenset = frozenset()  # with `met`: the nodes the flow had reached (sharded) by then
    rechunk: int = 0  # the equal parts a split or chunk cut a plain shard into, where that was the failure
    factory: tuple | None = None  # (node, placement): a buffer made from sizes whose whole value a write needed
    factories: dict | None = None  # the buffers seeded sharded in a trial that found its row layers


def _trial(nodes, order, by_node, loops, members: list[Weight], styles: dict[str, str], n: int,
           buffers: dict | None = None) -> _Trial:
    """Follow the members' outputs, column-parallel, until row-parallel consumers; any needed
    communication on the way fails the trial and blames the members whose flow needed it. `buffers`: factory nodes
    seeded sharded beside the members (written_factory)."""
    placements: dict[fx.Node, object] = {}
    blame: dict[fx.Node, set[str]] = {}
    pending: set[fx.Node] = set()  # users of sharded values not visited yet: the walk ends when none is left
    seeds = [(m, x) for m in members for x in (m.node, *m.also)]
    for m, x in seeds:
        placements[x] = Shard(len(x.meta["meshc.shape"]) - 1, m.chunks)
        blame[x] = {m.key}
        pending.update(x.users)
    for x, p in (buffers or {}).items():
        placements[x] = p
        blame[x] = {m.key for m in members}
        pending.update(x.users)
    ctx = RuleCtx(n, placements)
    rows: list[Weight] = []
    params: dict[str, Shard] = {}
    stats: set[fx.Node] = set()  # partial statistics (a norm's mean or sum of squares over the sharded features)
    start = min(order[x] for x in [*(x for _, x in seeds), *(buffers or {})])
    for node in nodes[start + 1:]:
        if not pending:
            break
        pending.discard(node)
        inputs = [a for a in node.all_input_nodes if in_parts(placements.get(a))]
        if not inputs or node in placements:
            continue
        origin = set().union(*(blame[a] for a in inputs))
        loop = loops.get(node)
        if loop is not None and node in loop.seeds and node.args[0] in placements:  # a loop over the parts of a
            if loop.join not in placements:  # sharded dim, entered by its sources: each rank runs its parts' iterations
                failed = _trial_loop(loop, placements, blame, params, n)
                if failed:
                    return _Trial([], origin, *failed)
                pending.update(loop.join.users)
            continue
        if node.op == "output":
            return _Trial([], origin, f"reaches the graph output at {node.format_node()}")
        w = by_node.get(node)
        if w is not None and styles.get(w.key, "rowwise") == "rowwise" and w.act in inputs and \
                _row_ok(w, placements[w.act], members):  # free, or the row layer of another column group
            rows.append(w)
            continue
        dec = infer(node, ctx)
        if dec.indivisible:
            return _Trial([], origin, dec.indivisible[0], dec.indivisible)
        if dec.out is None:  # no tensor output (an assertion): nothing to follow
            continue
        reduced = False
        for path, req in dec.inputs.items():
            src = get_arg(node, path)
            if in_parts(placements.get(src)) and placements[src] != req:
                if src in stats and isinstance(req, Replicate):  # a small all-reduce of a statistic is fine
                    reduced = True
                    continue
                return _Trial([], blame[src], _in_loop(node, loops, dec.note or f"{node.format_node()} needs it {req}"),
                              met=node if isinstance(req, Replicate) else None, placed=frozenset(placements),
                              rechunk=_equal_parts(node, placements[src]),
                              factory=written_factory(node, placements[src], n) if path == (1,) else None)
            found = param_sources(src, req.dim, node) if isinstance(req, Shard) and src not in placements else None
            for fqn, dim in (found or {}).items():
                params[fqn] = Shard(dim, req.chunks)
        if reduced and isinstance(dec.out, Replicate):  # the statistic, whole: nothing sharded to follow
            continue
        if isinstance(dec.out, Replicate) and not dec.inputs:  # made whole locally (a part held whole, a replicated
            continue  # part of a tuple, sizes only): nothing sharded to follow
        if isinstance(dec.out, Partial) and node.target in (aten.mean.dim, aten.sum.dim_IntList):
            stats.add(node)
        elif not _all_shard(dec.out):
            return _Trial([], origin, f"{node.format_node()} would hold a partial sum")
        size = _indivisible(node, dec.out, n) if node not in stats else None
        if size:
            return _Trial([], origin, f"{node.format_node()} has a dim of size {size}",
                          (f"size {size} not divisible by tp", size))
        placements[node] = dec.out
        blame[node] = origin
        pending.update(node.users)
    return _Trial(rows, set(), "" if rows else "no row-parallel layer consumes it", params=params,
                  factories=dict(buffers or {}))


def _equal_parts(node: fx.Node, p) -> int:
    """How many equal parts a split or chunk of `node` cuts its input's plain shard into, on the sharded dim; else 0."""
    if node.target not in (aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default):
        return 0
    shapes = node.meta.get("meshc.shape") or ()
    dim = node.args[2] if len(node.args) > 2 else 0
    if not isinstance(p, Shard) or p.chunks != 1 or len(shapes) < 2 or dim % len(shapes[0]) != p.dim:
        return 0
    return len(shapes) if len({str(s[p.dim]) for s in shapes}) == 1 else 0


def _in_loop(node: fx.Node, loops: dict[fx.Node, Loop], reason: str) -> str:
    """`reason`, said of the loop over parts whose iteration or join `node` is: a layer inside one iteration, its
    output split as Megatron splits it, no longer joins the other iterations' (a matrix every head reads)."""
    loop = loops.get(node) or next((lp for lp in loops.values() if lp.join is node), None)
    if loop is None:
        return reason
    return (f"inside each iteration of the loop over the {loop.count} parts of "
            f"{', '.join('%' + s.name for s in loop.sources)} ({reason}): read whole by every iteration")


def _trial_loop(loop: Loop, placements: dict, blame: dict, params: dict, n: int):
    """Place a loop over the parts of a dim as one op: its sources sharded on that dim (a parameter, or values made
    of parameters alone, sharded with them; others sliced), nothing else it reads sharded, its join sharded on the
    join's dim. (reason, indivisible) where it cannot be, else None."""
    what = f"the loop over the {loop.count} parts of {', '.join(s.name for s in loop.sources)}"
    if loop.count % n:
        return f"{what} does not divide over tp={n}", (f"{loop.count} parts", loop.count)
    body = loop.nodes()
    inside = next((x for b in loop.bodies for x in b if x in placements), None)
    if inside is not None:  # a member's layer inside the iterations: its shard would not be the loop's parts
        return f"{what}: %{inside.name} inside its iterations is already {placements[inside]}", None
    for x in {a for b in body for a in b.all_input_nodes} - body - set(loop.sources):
        if in_parts(placements.get(x)):
            return f"{what} reads %{x.name} ({placements[x]}) in each iteration", None
    for src, dim in loop.sources.items():
        p = placements.get(src)
        if p is None:
            fqn = src.meta.get("meshc.fqn") if src.op == "placeholder" else None
            seed = next(u for u in src.users if u in loop.seeds)
            found = {fqn: dim} if fqn and set(src.users) <= loop.seeds else param_sources(src, dim, seed)
            for fqn, d in (found or {}).items():
                params[fqn] = Shard(d)
        elif p != Shard(dim):
            return f"{what}: %{src.name} is {p}, not split on dim {dim} alone", None
    placements[loop.join] = Shard(loop.dim)
    blame[loop.join] = set().union(*(blame.get(s, set()) for s in loop.sources))
    return None


def _row_ok(w: Weight, act_placement, members) -> bool:
    return (isinstance(act_placement, Shard) and w not in members
            and act_placement.dim == len(w.act.meta["meshc.shape"]) - 1 and act_placement.chunks == 1)


def _explain_failure(program: Program, result: _Trial, members: list[Weight], n: int) -> None:
    blamed = [m for m in members if m.key in result.blamed]
    if result.indivisible:
        what, size = result.indivisible
        if n % size == 0:  # fewer heads than ranks (MQA/GQA): replicate them, as Megatron does for kv
            program.warnings.append(f"tp: {_names(blamed)} replicated: {what} < tp={n}")
            for m in blamed:
                program.tp_why[m.module] = f"{what}: {size} < tp={n}, replicated as Megatron does for kv heads"
            return
        raise MeshcValueError(f"tp sharding: {_names(blamed)} cannot be split over tp={n}: {what}={n}. "
                              f"Choose tp dividing {size}, or keep those modules replicated "
                              f"(Plan(tp={{'{blamed[0].module}': 'replicate'}})).")
    if blamed and len(blamed) < len(members):
        program.notes.append(f"auto: {_names(blamed)} left replicated: {result.reason}")
    elif members:
        program.notes.append(f"auto: {_names(members)} replicated: {result.reason}")
    for m in blamed or members:
        program.tp_why[m.module] = result.reason


def _indivisible(node: fx.Node, out, n: int) -> int | None:
    outs = out if isinstance(out, tuple) else (out,)
    shapes = node.meta["meshc.shape"] if isinstance(out, tuple) else (node.meta["meshc.shape"],)
    for p, shape in zip(outs, shapes):
        if isinstance(p, Shard) and shape is not None and not shard_divides(shape[p.dim], p, n):
            return int(shape[p.dim])
    return None


def _all_shard(p) -> bool:
    """Every output sharded (a tuple may hold replicated parts beside shards: a user Function's generator
    state), none partial."""
    xs = p if isinstance(p, tuple) else (p,)
    return all(isinstance(x, (Shard, Replicate)) for x in xs) and any(isinstance(x, Shard) for x in xs)


def _order(program: Program) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(program.gm.graph.nodes)}


def _names(ws: list[Weight]) -> str:
    mods = list(dict.fromkeys(w.module for w in ws))
    if len(mods) > 1:
        prefix = mods[0].rsplit(".", 1)[0]
        if all(m.rsplit(".", 1)[0] == prefix for m in mods):
            return f"{prefix}.{{{','.join(m.rsplit('.', 1)[1] for m in mods)}}}"
    return ", ".join(mods)

