"""Stage extraction: the mechanism that turns pipeline_split's decision into one GraphModule per stage.

    stage_graphs(program) -> [Stage, ...]

Each stage graph takes, in order: the parameters it uses, the buffers it uses, the model inputs it uses
(tokens on the first stage, targets on the last), and the activations the previous stage sends; it
returns the activations the next stage needs (pass-through ones included), or the loss on the last
stage. Values that depend only on parameters (ZeRO gathers, gradient buckets, parameter slices) or only
on inputs and buffers (masks, positions, rotary tables) are computed by every stage that needs them, so
they are never sent. A parameter used by two stages is an input of both; the runtime sums its gradient
between the ranks that hold it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from meshc.compiler.ir.errors import MeshcInternalError, MeshcValueError
from meshc.compiler.ir.fx_ops import op_name, written_in_place
from meshc.compiler.ir.program import VALUE_META, Program

MARKER = "pippy::_pipe_split"


@dataclass
class Boundary:
    """One activation crossing between stages: its local shape and dtype, and whether it has a gradient."""

    name: str
    shape: tuple
    dtype: torch.dtype
    grad: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Stage:
    index: int
    gm: fx.GraphModule
    params: list[str]
    buffers: list[str]
    inputs: list[int]  # positions among the program's flat user inputs
    recv: list[Boundary] = field(default_factory=list)
    send: list[Boundary] = field(default_factory=list)
    last: bool = False

    @property
    def sent_bytes(self) -> int:
        """Bytes of the activations this stage sends forward, per micro-batch."""
        return sum(b.nbytes for b in self.send)

    @property
    def grad_bytes(self) -> int:
        """Bytes of the input gradients this stage sends back, per micro-batch (received values with a gradient)."""
        return sum(b.nbytes for b in self.recv if b.grad)


def stage_graphs(program: Program, count: int) -> list[Stage]:
    graph = program.gm.graph
    stage_of = {n: n.meta["meshc.stage"] for n in graph.nodes if "meshc.stage" in n.meta}
    if program.mutated_buffers:
        raise MeshcValueError(f"pipeline: expected a model that does not update buffers in forward, got updates to "
                              f"{program.mutated_buffers[:3]}; pipeline stages cannot share them")
    for n in graph.nodes:
        if n.op in ("call_function", "call_module") and n not in stage_of and any(a in stage_of for a in n.all_input_nodes):
            raise MeshcInternalError(f"stages: activation without a stage: {n.format_node()}")
    order = {n: i for i, n in enumerate(graph.nodes)}
    crossing = [_crossing(stage_of, k, order) for k in range(count - 1)]
    inputs = program.placeholders("input")
    return [_build(program, k, count, stage_of, crossing, inputs, order) for k in range(count)]


def _crossing(stage_of: dict, k: int, order: dict) -> list[fx.Node]:
    """Activations computed at or before stage k and used by a later stage, in graph order."""
    out = [n for n, s in stage_of.items() if s <= k and any(stage_of.get(u, -1) > k for u in n.users)]
    return sorted(out, key=order.__getitem__)


def _build(program, k, count, stage_of, crossing, inputs, order) -> Stage:
    graph = program.gm.graph
    own = [n for n in graph.nodes if stage_of.get(n) == k]
    needed = _closure(own, stage_of)
    recv = crossing[k - 1] if k > 0 else []
    send = crossing[k] if k < count - 1 else []
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    params = [n for n in program.placeholders("param") if n in needed]
    buffers = [n for n in program.placeholders("buffer") if n in needed]
    used_inputs = [n for n in inputs if n in needed]
    for n in params + buffers + used_inputs:
        env[n] = new.placeholder(n.name)
        env[n].meta.update(n.meta)
    for i, n in enumerate(recv):
        env[n] = new.placeholder(f"recv_{i}_{n.name}")
        env[n].meta.update({key: v for key, v in n.meta.items() if key in VALUE_META})
    copied = ("call_function", "call_module", "get_attr")  # get_attr: a higher-order op's body (submod_5)
    for n in graph.nodes:
        if n.op not in copied or n in env or not (n in needed or stage_of.get(n) == k):
            continue
        if op_name(n.target) == MARKER:
            continue
        env[n] = new.node_copy(n, lambda a: env[a])
    for n in recv:
        if written_in_place(env[n]) is not None:
            _own_copy(new, env[n])
    if k == count - 1:
        out = [a for a in graph.nodes if a.op == "output"][0]
        new.output(fx.node.map_arg(out.args[0], lambda a: env[a]))
    else:
        new.output(tuple(env[n] for n in send))
    new.lint()
    gm = fx.GraphModule(program.gm, new)
    return Stage(
        index=k, gm=gm,
        params=[n.meta["meshc.fqn"] for n in params], buffers=[n.meta["meshc.fqn"] for n in buffers],
        inputs=[inputs.index(n) for n in used_inputs],
        recv=[_boundary(n) for n in recv], send=[_boundary(n) for n in send], last=k == count - 1,
    )


def _own_copy(graph: fx.Graph, received: fx.Node) -> None:
    """Read a received activation through a clone where the stage writes into it in place (Gemma 4's
    `hidden_states *= layer_scalar` at a layer's end, the cut just before it): the received tensor is a leaf of
    autograd on this stage, which may not be written into; every later read, a send onward included, reads the copy,
    as every later read of the written value did in the whole graph."""
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        copy = graph.call_function(torch.ops.aten.clone.default, (received,))
    copy.meta.update(received.meta)
    received.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy)


def _closure(own: list[fx.Node], stage_of: dict) -> set[fx.Node]:
    """The stage's own nodes, plus every non-activation value and placeholder they need."""
    needed: set[fx.Node] = set()
    stack = list(own)
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a in needed or a in stage_of:
                continue
            needed.add(a)
            stack.append(a)
    return needed | set(own)


def _boundary(node: fx.Node) -> Boundary:
    val = node.meta["val"]
    if not isinstance(val, torch.Tensor):
        raise MeshcValueError(f"pipeline: expected tensors to cross between stages, got {type(val).__name__} from "
                              f"{node.format_node()}; move the cut (Plan.split_points)")
    return Boundary(node.name, tuple(val.shape), val.dtype, val.is_floating_point())
