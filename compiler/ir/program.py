"""Program: the unit every pass takes and returns.

A Program is an ATen-level fx.GraphModule in the *lifted* calling convention

    gm(*parameters, *buffers, *user_inputs) -> (*mutated_buffers, *user_outputs)

plus a ParamSpec for every parameter and buffer (FQN, global shape, dtype, placement per mesh axis),
the MeshSpec, the Plan and the rank it is compiled for. The graph holds no tensors: the runtime feeds each
rank's local shards in the order of `Program.params` then `Program.buffers`.

Node metadata keys meshc writes (always namespaced):
    "meshc.role"       on placeholders: "param", "buffer" or "input"
    "meshc.fqn"        on param/buffer placeholders: the canonical FQN
    "meshc.placement"  dict axis -> Placement of the value a node produces
    "meshc.why"        on every node a pass inserts: the rule and the tensor that made it necessary
    "meshc.comm"       on collective nodes: list of CommRecord (forward and backward traffic)
    "meshc.shape"      on tensor values: the global shape as a tuple of sympy expressions (shapes pass)
    "meshc.stage"      on activations when pipelined: the pipeline stage that computes it (pipeline_split)
    "meshc.bucket"     on ZeRO gather waits and grad_sync nodes: the FQNs of the parameters in the bucket
    "meshc.elementwise" on a user autograd.Function's op the trace found elementwise (True)
    "meshc.opaque"     on one it did not: why (compiler/trace/elementwise_functions.py)
    "meshc.grad_region" on the detach of a torch.no_grad() region's result, once inlined (True; trace/grad_regions.py)
    "meshc.tp_factory" on a buffer made from sizes alone that sharded writes fill: its placement on tp, decided by
                       tp_placement (passes/sharding/buffers.py), made so by the tensor_parallel pass's factory rule
The constants below spell them once: ROLE ... OPAQUE, META_KEYS (all of them: compiler/verify.py fails a
"meshc.*" key outside it) and VALUE_META (what a node that stands for another's value copies from it).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from meshc.compiler.ir.plan import DEFAULT_BUCKET_MB
from meshc.compiler.ir.placement import FlatShard, Owned, Placement, Replicate, Shard, data_axis, local_length

if TYPE_CHECKING:
    from meshc.compiler.ir.mesh_spec import MeshSpec
    from meshc.compiler.ir.plan import Plan

ROLE, FQN, PLACEMENT, WHY, COMM = "meshc.role", "meshc.fqn", "meshc.placement", "meshc.why", "meshc.comm"
SHAPE, STAGE, BUCKET = "meshc.shape", "meshc.stage", "meshc.bucket"
ELEMENTWISE, OPAQUE, GRAD_REGION = "meshc.elementwise", "meshc.opaque", "meshc.grad_region"
TP_FACTORY = "meshc.tp_factory"
META_KEYS = frozenset({ROLE, FQN, PLACEMENT, WHY, COMM, SHAPE, STAGE, BUCKET, ELEMENTWISE, OPAQUE, GRAD_REGION,
                       TP_FACTORY})
VALUE_META = ("val", SHAPE, PLACEMENT)  # copied by a node standing for another's value (a bucket's getitem)


@dataclass
class ParamSpec:
    """One parameter or buffer: its global facts and its placement on every mesh axis."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    placements: dict[str, Placement]
    kind: str = "param"  # "param" | "buffer" | "constant"
    requires_grad: bool = True
    aliases: tuple[str, ...] = ()  # other FQNs of the same tensor (tied weights)
    grad_partial: tuple[str, ...] = ()  # axes over which the local gradient is a partial sum
    zero: int = 0  # ZeRO stage managing this parameter on dp (0: none)
    held: bool = True  # False where an Owned placement gives it to another rank: this program's rank holds none of it

    def local_shape(self, mesh_sizes: dict[str, int], axes=None) -> tuple[int, ...]:
        """The shape this program's rank holds, given the size of every mesh axis (only `axes`, if given).

        Dim shards apply first; a flat (ZeRO) shard then flattens what they leave and pads it. A parameter another
        rank owns (Owned, `held` False) has 0 rows here.
        """
        shape = list(self.shape)
        for axis, p in self.placements.items():
            if isinstance(p, Shard) and (axes is None or axis in axes):
                shape[p.dim] = local_length(p, shape[p.dim], mesh_sizes[axis])
            if isinstance(p, Owned) and not self.held and (axes is None or axis in axes) and shape:
                shape[0] = 0
        for axis, p in self.placements.items():
            if isinstance(p, FlatShard) and (axes is None or axis in axes):
                shape = [-(-math.prod(shape) // mesh_sizes[axis])]
        return tuple(shape)

    def unflat_shape(self, mesh_sizes: dict[str, int]) -> tuple[int, ...]:
        """The shape before any flat shard: the tensor a ZeRO gather rebuilds on each rank."""
        return self.local_shape(mesh_sizes, [a for a, p in self.placements.items() if isinstance(p, (Shard, Owned))])

    def local_bytes(self, mesh_sizes: dict[str, int]) -> int:
        return math.prod(self.local_shape(mesh_sizes)) * self.dtype.itemsize


@dataclass(frozen=True)
class CommRecord:
    """One collective a graph node causes per step: what, over which axis, how many bytes, and why."""

    kind: str  # "all_reduce" | "all_gather" | "reduce_scatter" | ...
    axis: str
    bytes: int  # payload of one call: the tensor each rank contributes
    phase: str  # "forward" | "backward"
    why: str
    count: int = 1
    tensors: int = 0  # a ZeRO bucket's tensors, packed into or unpacked out of the call's flat buffer (their copies)


@dataclass
class Program:
    gm: fx.GraphModule
    params: dict[str, ParamSpec]  # in placeholder order
    buffers: dict[str, ParamSpec]  # in placeholder order, after the params
    input_names: list[str]
    in_spec: Any  # pytree spec of (args, kwargs)
    out_spec: Any  # pytree spec of the user outputs
    mutated_buffers: list[str]  # FQNs of buffers written by forward: the first graph outputs
    mesh: "MeshSpec"  # topology only: no process group
    plan: "Plan"
    rank: int
    trace_mode: str = "strict"
    local_axes: frozenset = frozenset()  # axes whose sharding the graph already runs on (local shapes)
    fixed_placements: dict | None = None  # FQN -> placements decided earlier (a job's other programs)
    step_comms: list = field(default_factory=list)  # CommRecords of the optimizer step (ZeRO-1/2)
    stage_info: list = field(default_factory=list)  # pipeline_split's description of the stages
    stage_rates: Any = None  # roofline.Rates pipeline_split balances stages by (the hardware profile's); None: FLOPs only
    step_loss: bool = False  # a job's step puts the loss inside its own program (meshc.compile, one stage): the
    #                          logits this graph returns are read there, not gathered (the vocabulary decision)
    fusion: dict = field(default_factory=dict)  # fuse_comm: kernel -> FusionResult (fused, eligible, left)
    hardware: Any = None  # compiler/cost/hardware.Hardware the decisions are made for; None: this device's
    decisions: dict = field(default_factory=dict)  # plan.Decision per choice left to the cost model (driver)
    notes: list[str] = field(default_factory=list)  # what passes changed, in words
    warnings: list[str] = field(default_factory=list)  # what a user should look at
    tp_why: dict[str, str] = field(default_factory=dict)  # tp_placement pass: module -> why it stays replicated on tp
    experts: list = field(default_factory=list)  # experts pass: passes/experts.ExpertRegion per MoE layer found
    pass_log: list[Any] = field(default_factory=list)  # driver.PassRecord per pass run

    def bucket_mb(self) -> float:
        """MiB per data-parallel gradient bucket: Plan.bucket_mb, else the cost model's decision (the driver's,
        compiler/cost/buckets.py), else plan.DEFAULT_BUCKET_MB."""
        if self.plan.bucket_mb is not None:
            return float(self.plan.bucket_mb)
        decision = self.decisions.get("bucket_mb")
        return float(decision.value) if decision is not None else DEFAULT_BUCKET_MB

    def zero_step_params(self, axis: str) -> list[str]:
        """FQNs of the trainable ZeRO-sharded parameters whose shards lie on `axis` (dp, or edp for experts'):
        what the ZeRO-1/2 optimizer step reduces and gathers over that axis."""
        return [f for f, s in self.params.items() if s.requires_grad and s.zero and data_axis(s.placements) == axis]

    def step_records(self, fqns: set[str] | None = None) -> list[CommRecord]:
        """step_comms (the ZeRO-1/2 optimizer step's collectives, over every parameter of the model) as a rank
        holding only the parameters `fqns` runs them (None: all): a pp rank's step reduces and gathers its own
        stages' (runtime/zero/param_store.py keeps no others), so each record keeps their share of its bytes and count."""
        if fqns is None:
            return list(self.step_comms)
        out = []
        for record in self.step_comms:
            elems = {f: self.params[f].local_shape(self.mesh.sizes)[0] for f in self.zero_step_params(record.axis)}
            mine = [f for f in elems if f in fqns]
            if mine:
                share = sum(elems[f] for f in mine) / max(sum(elems.values()), 1)
                out.append(dataclasses.replace(record, bytes=int(record.bytes * share), tensors=len(mine)))
        return out

    def replace(self, **changes: Any) -> "Program":
        return dataclasses.replace(self, **changes)

    def unchanged(self, note: str) -> "Program":
        """This program with `note` added and its graph shared: what a pass with nothing to do returns, instead of
        a copy (a graph copy and a code generation: ~50 ms for a 2-layer model, eleven times per compile)."""
        return self.replace(notes=[*self.notes, note], warnings=list(self.warnings), pass_log=list(self.pass_log))

    def copy(self) -> "Program":
        """A program with its own graph (node meta copied shallowly) and its own lists, for a pass to edit."""
        graph = fx.Graph()
        out = graph.graph_copy(self.gm.graph, {})
        graph.output(out)
        gm = fx.GraphModule(self.gm, graph)
        return self.replace(
            gm=gm,
            params={k: dataclasses.replace(v, placements=dict(v.placements)) for k, v in self.params.items()},
            buffers={k: dataclasses.replace(v, placements=dict(v.placements)) for k, v in self.buffers.items()},
            notes=list(self.notes),
            warnings=list(self.warnings),
            tp_why=dict(self.tp_why),
            pass_log=list(self.pass_log),
        )

    def placeholders(self, role: str | None = None) -> list[fx.Node]:
        nodes = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        return [n for n in nodes if role is None or n.meta.get("meshc.role") == role]

    def param_nodes(self) -> dict[str, fx.Node]:
        return {n.meta["meshc.fqn"]: n for n in self.placeholders("param")}

    def comm_records(self) -> list[tuple[fx.Node | None, CommRecord]]:
        """Every collective per step: graph nodes' (forward and backward), then the optimizer step's."""
        records = [(n, r) for n in self.gm.graph.nodes for r in n.meta.get("meshc.comm", ())]
        return records + [(None, r) for r in self.step_comms]


def replicated(mesh_axes: tuple[str, ...]) -> dict[str, Placement]:
    return {axis: Replicate() for axis in mesh_axes}
