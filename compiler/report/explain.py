"""explain(): the printable report of a compiled job for one rank.

It says what the compiler decided and what that costs: the mesh and plan, what each pass did, the
bytes this rank holds in parameters, gradients and optimizer states, every collective per step (kind,
mesh axis, bytes, count, and why it exists), and every parameter's placement.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from meshc.compiler.ir.coverage import coverage
from meshc.compiler.ir.fx_ops import op_label
from meshc.compiler.ir.placement import format_placements
from meshc.compiler.ir.program import CommRecord, Program
from meshc.compiler.ir.show import human_bytes


@dataclass
class Collective:
    kind: str
    axis: str
    bytes: int
    count: int
    phase: str
    why: str
    node: str


@dataclass
class Report:
    header: str
    plan: str
    passes: list[str]
    memory: dict[str, int]  # params / grads / optimizer bytes this rank holds
    optimizer_note: str
    collectives: list[Collective]
    params: list[tuple[str, tuple, tuple, str]]  # fqn, global shape, local shape, placements
    warnings: list[str] = field(default_factory=list)
    pipeline: list[str] = field(default_factory=list)  # stages, schedule grid, predicted bubble
    fusion: list[str] = field(default_factory=list)  # per kernel: fused k of n eligible, and why not
    decisions: list[str] = field(default_factory=list)  # the choices left to the cost model: what, and why
    coverage: list[str] = field(default_factory=list)  # share of block weight bytes sharded per axis; replicated modules
    materialization: str = ""  # predicted peak while init_weights / load_pretrained fill this rank's shards
    offload: list[str] = field(default_factory=list)  # where Plan.offload keeps what (the job says, from its store)
    experts: list[str] = field(default_factory=list)  # expert layers found; rows per local expert in the last step
    compiled: list[str] = field(default_factory=list)  # what Inductor compiled for the job so far (graphs, seconds)

    def bytes_per_step(self) -> dict[str, int]:
        """Collective payload bytes per step, summed by mesh axis."""
        out: dict[str, int] = defaultdict(int)
        for c in self.collectives:
            out[c.axis] += c.bytes * c.count
        return dict(out)

    def __str__(self) -> str:
        lines = [self.header, f"plan: {self.plan}", "", "passes:"]
        lines += [f"  {p}" for p in self.passes] or ["  (none)"]
        m = self.memory
        lines += ["", "memory held by this rank:",
                  f"  parameters        {human_bytes(m['params']):>12}",
                  f"  gradients         {human_bytes(m['grads']):>12}",
                  f"  optimizer states  {human_bytes(m['optimizer']):>12}  ({self.optimizer_note})",
                  f"  total             {human_bytes(sum(m.values())):>12}"]
        if self.materialization:
            lines.append(f"  {self.materialization}")
        lines += [f"  {line}" for line in self.offload]
        if self.coverage:
            lines += ["", "coverage:"] + [f"  {line}" for line in self.coverage]
        lines += ["", "collectives per step:"]
        if self.collectives:
            lines.append(f"  {'kind':<15}{'axis':<6}{'bytes':>11}{'count':>7}  {'phase':<9} why")
            for c in self.collectives:
                lines.append(f"  {c.kind:<15}{c.axis:<6}{human_bytes(c.bytes):>11}{c.count:>7}  {c.phase:<9} {c.why}")
            totals = ", ".join(f"{axis}: {human_bytes(b)}" for axis, b in self.bytes_per_step().items())
            lines.append(f"  total payload per step: {totals}")
        else:
            lines.append("  (none)")
        if self.experts:
            lines += ["", "experts:"] + [f"  {line}" for line in self.experts]
        if self.pipeline:
            lines += ["", "pipeline:"] + [f"  {line}" for line in self.pipeline]
        if self.decisions:
            lines += ["", "decisions (the user's Plan values, else the cost model's for this device):"]
            lines += [f"  {line}" for line in self.decisions]
        lines += [f"  inductor: {line}" for line in self.compiled]
        if self.fusion:
            lines += ["", "fusion:"] + [f"  {line}" for line in self.fusion]
        lines += ["", f"parameters ({len(self.params)}):",
                  f"  {'fqn':<44}{'global shape':<18}{'local shape':<18}placement"]
        for fqn, g, local, p in self.params:
            lines.append(f"  {fqn:<44}{str(tuple(g)):<18}{str(tuple(local)):<18}{p}")
        if self.warnings:
            lines += ["", "warnings:"] + [f"  {w}" for w in self.warnings]
        return "\n".join(lines)


def explain(program: Program, optimizers: list[torch.optim.Optimizer] = (), pipeline=None, *,
            offload: list[str] = (), resident=None, routing: list[str] = (), compiled: list[str] = ()) -> Report:
    """The report for `program`; live optimizers, if given, give measured optimizer-state bytes; a
    pipelined job adds its stages, schedule grid and predicted bubble (and holds only its stages' params).
    `offload`: the job's lines on where Plan.offload keeps states; `resident(t)`: whether a state tensor is in
    this process's memory (offloaded ones are counted there, not above); `routing`: the job's lines on the rows
    its experts received in the last step; `compiled`: the job's lines on what Inductor compiled."""
    mesh = program.mesh
    sizes = mesh.sizes
    held = [s for s in program.params.values() if pipeline is None or s.fqn in pipeline.params]
    trainable = [s for s in held if s.requires_grad]
    params_bytes = sum(s.local_bytes(sizes) for s in held)
    grads_bytes = sum(s.local_bytes(sizes) for s in trainable)
    opt_bytes, note = _optimizer_bytes(optimizers, grads_bytes, resident, program.plan)
    records = program.comm_records() if pipeline is None else _stage_records(program, pipeline)
    collectives = [
        Collective(r.kind, r.axis, r.bytes, r.count, r.phase, r.why, node.name if node is not None else "step")
        for node, r in records
    ]
    params = [(s.fqn, s.shape, s.local_shape(sizes), format_placements(s.placements)) for s in held]
    n_nodes = len(program.gm.graph.nodes)
    header = (f"meshc job: rank {program.rank} of {mesh.world_size}, mesh {mesh.describe()}\n"
              f"graph: {n_nodes} nodes, traced by torch.export ({program.trace_mode})")
    return Report(
        header=header, plan=program.plan.describe(),
        passes=[r.summary() for r in program.pass_log],
        memory={"params": params_bytes, "grads": grads_bytes, "optimizer": opt_bytes},
        optimizer_note=note, collectives=collectives, params=params, warnings=list(program.warnings),
        pipeline=_pipeline_lines(program, pipeline) if pipeline is not None else [],
        fusion=[f"{kernel}: not fused, {r.eligible} eligible (off)" if r.off else
                f"{kernel}: fused {r.fused} of {r.eligible} eligible" + "".join(f"; left {x}" for x in r.left)
                for kernel, r in program.fusion.items()],
        decisions=[d.line(key) for key, d in program.decisions.items()],
        coverage=coverage(program.params, sizes, program.tp_why).lines(),
        materialization=_materialization(held, sizes, params_bytes),
        offload=list(offload),
        experts=_expert_lines(program) + list(routing),
        compiled=list(compiled),
    )


def _expert_lines(program: Program) -> list[str]:
    """What the experts pass recognised (and why), or what stopped it."""
    out = []
    for region in program.experts:
        params = ", ".join(region.params) or "(no parameter)"
        ops = sorted({op_label(m.target) for m in region.matmuls})
        shared = "sharing one offsets tensor" if region.ids is None else "gathered by one expert-id tensor"
        found = f"{params}: {region.experts} experts, the weights of {len(region.matmuls)} matmul(s) " \
                f"({', '.join(ops)}) {shared}"
        if region.stopped:
            out.append(f"{found}; replicated: {region.stopped[0]}")
        else:
            ep = program.mesh.size("ep")
            out.append(f"{found}; " + (f"E/ep = {region.experts // ep} per rank" if ep > 1 else "replicated (ep = 1)"))
    return out


def _materialization(held: list, sizes: dict, params_bytes: int) -> str:
    """Predicted peak of filling this rank's shards: init_weights builds one whole tensor at a time (the largest
    it holds part of), load_pretrained reads only slices (the largest local one)."""
    if not held:
        return ""
    largest = max(held, key=lambda s: math.prod(s.shape) * s.dtype.itemsize)
    whole = math.prod(largest.shape) * largest.dtype.itemsize
    part = max(s.local_bytes(sizes) for s in held)
    return (f"materializing   init_weights {human_bytes(params_bytes + whole):>10} peak (shards + whole {largest.fqn}); "
            f"load_pretrained {human_bytes(params_bytes + part)}")


def _stage_records(program: Program, pipeline) -> list:
    """A pipelined rank's collectives: its own stages' (once per micro-batch) and the step's."""
    m = pipeline.schedule.microbatches
    out = []
    for stage in pipeline.local.values():
        for node in stage.gm.graph.nodes:
            for r in node.meta.get("meshc.comm", ()):
                out.append((node, dataclasses.replace(r, count=r.count * m)))
    for stage in pipeline.local.values():
        sent, grads = pipeline.messages(stage)  # none to a neighbour stage on this rank
        if sent:
            out.append((None, CommRecord("send", "pp", sent, "forward", f"stage {stage.index}'s activations to "
                                         f"stage {stage.index + 1}, per micro-batch", count=m)))
        if grads:
            out.append((None, CommRecord("send", "pp", grads, "backward", f"stage {stage.index}'s input gradients "
                                         f"to stage {stage.index - 1}, per micro-batch", count=m)))
    if pipeline.tied:
        nbytes = sum(program.params[f].local_bytes(program.mesh.sizes) for f in pipeline.tied)
        out.append((None, CommRecord("all_reduce", "pp", nbytes, "step",
                                     f"gradients of parameters held on several pp ranks: {', '.join(pipeline.tied)}")))
    return out + [(None, r) for r in program.step_records(pipeline.params)]


def _pipeline_lines(program: Program, pipeline) -> list[str]:
    from meshc.compiler.ir.schedule_sim import grid

    lines = []
    for s in program.stage_info:
        where = f"pp rank {pipeline.schedule.rank_of(s.stage)}"
        lines.append(f"stage {s.stage} ({where}): {', '.join(s.blocks) or '-'}; {s.flops / 1e9:.3f} GFLOP forward per "
                     f"micro-batch, {s.param_bytes / 2**20:.2f} MiB parameters, {s.boundary_bytes / 2**10:.1f} KiB "
                     f"sent to the next stage, {s.memory / 2**20:.1f} MiB predicted held (states, in-flight "
                     "activations)")
    sched = pipeline.schedule
    lines.append(f"schedule {sched.name}: {sched.microbatches} micro-batches, predicted bubble "
                 f"{pipeline.simulated.bubble:.1%} of compute (stage costs from their FLOPs; B = 2F)")
    if pipeline.tied:
        lines.append(f"parameters on several pp ranks, gradients summed after each step: {', '.join(pipeline.tied)}")
    lines.append("grid (uniform stage costs, F = 1, B = 2):")
    lines += grid(sched).splitlines()
    return lines


def _optimizer_bytes(optimizers, grads_bytes: int, resident=None, plan=None) -> tuple[int, str]:
    measured, seen = 0, False
    for opt in optimizers:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    seen = True
                    if resident is None or resident(v):
                        measured += v.numel() * v.element_size()
    if seen:
        return measured, "measured on the live optimizer" + (", in memory" if resident is not None else "")
    if plan is not None and plan.offload == "nvme":
        return 0, "offloaded: see below"
    return 2 * grads_bytes, "estimate for Adam: 2 states per trainable element, before its first step"


def comm_summary(records: list[CommRecord]) -> dict[tuple[str, str, str], int]:
    """(kind, axis, phase) -> payload bytes per step."""
    out: dict[tuple[str, str, str], int] = defaultdict(int)
    for r in records:
        out[(r.kind, r.axis, r.phase)] += r.bytes * r.count
    return dict(out)
