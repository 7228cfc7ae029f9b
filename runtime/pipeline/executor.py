"""Pipeline execution: one rank runs its stages' micro-batches in the order its schedule gives.

The schedule (compiler/ir/schedule.py) is data, proven before anything runs (compiler/ir/schedule_sim.py):
every receive has its send, each kind of message between two ranks is awaited in the order it is sent, and
nothing deadlocks under blocking receives and buffered sends, which is exactly how this executor runs each rank's
program:

    RECV  irecv + wait       the activations (F) or gradients (B, I) a compute action needs
    F     forward of a stage on a micro-batch; the last stage's output is the micro-batch's loss
    B     backward of that micro-batch through the stage (loss scaled by 1/m: gradients accumulate
          to those of the whole batch)
    I, W  zero-bubble halves of B (runtime/pipeline/backward_split.py): gradients of the stage's inputs first (what
          the previous stage waits for), keeping the gradients that reach each op with a parameter operand;
          W later computes only the parameters' gradients from those. I + W computes what B does, once.
    SEND  isend, waited at the end of the step

Point-to-point messages go over the pp group between ranks with the same dp and tp coordinates, so
every tp rank of a stage exchanges its own (tp-local) activations with its peer. Activations and gradients travel
on two groups over those ranks (Mesh.pipeline_group): NCCL ignores tags and pairs a rank pair's messages in order,
and under a V schedule a pair's activations and gradients interleave differently on the two ends, each kind alone
in the same order on both (schedule_sim's fifo check).
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.pipeline.stages import Stage

from meshc.compiler.ir.schedule import P2P, Action, Schedule
from meshc.runtime.monitor import trace as tracing
from meshc.runtime.pipeline.backward_split import WeightWork, backward_input, backward_weight
from meshc.runtime.zero.context import ZeroContext

KINDS = {"F": 0, "B": 1}


class PipelineRun:
    """One step: `run(micro)` (each micro-batch's flat model inputs) returns the mean micro-batch loss,
    on every pp rank. The last stage computes the model's outputs; `loss_of(outputs, mb)` runs the
    user's loss on them (eagerly, as torch.distributed.pipelining does)."""

    def __init__(self, stages: dict[int, Stage], schedule: Schedule, mesh, values: Callable[[Stage], list],
                 loss_of: Callable[[tuple, int], torch.Tensor], zero_context: Callable[[], ZeroContext] | None,
                 runnable: Callable[[Stage], Callable] | None = None):
        self.stages, self.schedule, self.mesh = stages, schedule, mesh
        # what runs a stage's program: Inductor's code (runtime/inductor.py) or the FX graph, with module marks
        # while job.trace records
        self.runnable = runnable or (lambda stage: tracing.marked(stage.gm))
        self.values, self.loss_of, self.zero_context = values, loss_of, zero_context
        self.rank = mesh.coord("pp")
        self.m = schedule.microbatches

    def run(self, micro: list[list[Any]]) -> torch.Tensor:
        self.micro = micro
        self.inputs: dict[tuple[int, int], list[torch.Tensor]] = {}  # received activations (leaves)
        self.outputs: dict[tuple[int, int], tuple] = {}
        self.grads_in: dict[tuple[int, int], list] = {}  # gradients of a stage's outputs
        self.grads_out: dict[tuple[int, int], list] = {}  # gradients of a stage's inputs
        self.weight_work: dict[tuple[int, int], WeightWork] = {}  # what I kept for W
        self.contexts: dict[tuple[int, int], ZeroContext] = {}  # each forward's ZeRO context, until its W
        self.losses: list[torch.Tensor] = []
        self.sends: list[Any] = []
        self.busy = 0.0  # seconds of compute actions: the rest of the step is bubble or communication
        self.actions: list[tuple[Action, float]] = []  # each compute action and its seconds, in run order
        start = time.perf_counter()
        for op in self.schedule.program(self.rank):
            if isinstance(op, P2P):
                nbytes = self._p2p_bytes(op) if tracing.active() else 0
                with tracing.region(str(op), "p2p", bytes=nbytes, peer=op.peer):
                    self._message(op)
            else:
                t0 = time.perf_counter()
                with tracing.region(str(op), "compute", stage=op.stage, microbatch=op.microbatch):
                    self._compute(op)
                seconds = time.perf_counter() - t0
                self.busy += seconds
                self.actions.append((op, seconds))
        with tracing.region("wait sends", "wait"):
            for work in self.sends:
                work.wait()
        self.elapsed = time.perf_counter() - start
        return self._loss()

    # ------------------------------------------------------------------------------ compute
    def _compute(self, a: Action) -> None:
        key = (a.stage, a.microbatch)
        stage = self.stages[a.stage]
        if a.kind == "F":
            self._forward(stage, a.microbatch)
            return
        if a.kind == "W":  # the parameters' gradients, from what I kept: no activation gradient again
            context = self.contexts.get(key)
            with context.holding() if context is not None else contextlib.nullcontext():
                backward_weight(self.weight_work.pop(key))
            self._release(key)
            return
        outs, grads = self._backward_terms(stage, key)
        if a.kind == "B":
            torch.autograd.backward(outs, grads)
            self.grads_out[key] = [t.grad for t in self.inputs[key]]
            self._release(key)
        else:  # I: the stage inputs' gradients now (the previous stage waits for them), keeping what W needs
            self.grads_out[key], self.weight_work[key] = backward_input(outs, grads, self.inputs[key])
        self._hand_over_grads(a)

    def _forward(self, stage: Stage, mb: int) -> None:
        key = (stage.index, mb)
        if stage.index > 0 and key not in self.inputs:  # the previous stage ran here: hand over locally
            prev = self.outputs[(stage.index - 1, mb)]
            self.inputs[key] = [_leaf(t, b.grad) for t, b in zip(prev, stage.recv)]
        recv = self.inputs.setdefault(key, [])
        args = self.values(stage) + [self.micro[mb][i] for i in stage.inputs] + recv
        gm = self.runnable(stage)
        if self.zero_context is not None:
            with self.zero_context() as context:
                outs = gm(*args)
            self.contexts[key] = context  # a W holds the buckets it gathers again (ZeroContext.holding)
        else:
            outs = gm(*args)
        outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
        if stage.last:  # the model's outputs: the user's loss function turns them into the loss
            outs = (self.loss_of(outs, mb),)
            self.losses.append(outs[0].detach())
        self.outputs[key] = outs

    def _backward_terms(self, stage: Stage, key) -> tuple[list, list]:
        """What backward starts from: the loss / m on the last stage, else the outputs and their gradients."""
        outs = self.outputs[key]
        if stage.last:
            return [outs[0] / self.m], [None]
        grads = self.grads_in.pop(key)
        pairs = [(o, g) for o, g, b in zip(outs, grads, stage.send) if b.grad and o.requires_grad]
        return [o for o, _ in pairs], [g if g is not None else torch.zeros_like(o) for o, g in pairs]

    def _hand_over_grads(self, a: Action) -> None:
        prev = a.stage - 1
        if a.kind in ("B", "I") and prev in self.stages:  # the previous stage runs here too
            self.grads_in[(prev, a.microbatch)] = self.grads_out.pop((a.stage, a.microbatch))

    def _release(self, key) -> None:
        self.outputs.pop(key, None)
        self.inputs.pop(key, None)
        self.contexts.pop(key, None)

    # ------------------------------------------------------------------------------ messages
    def _p2p_bytes(self, op: P2P) -> int:
        """Bytes a message carries (the tensors of the stage boundary it crosses)."""
        stage = self.stages[op.stage]
        metas = stage.send if (op.op == "send") == (op.kind == "F") else stage.recv
        return sum(math.prod(b.shape) * _wire_dtype(b.dtype).itemsize for b in metas)

    def _message(self, op: P2P) -> None:
        key = (op.stage, op.microbatch)
        stage = self.stages[op.stage]
        peer = self.mesh.group_ranks("pp")[op.peer]
        group = self.mesh.pipeline_group(op.kind)
        tag = (op.microbatch * 2 + KINDS[op.kind if op.kind in KINDS else "B"]) * 4096 + min(op.stage, op.peer_stage)
        if op.op == "send":
            tensors = self.outputs[key] if op.kind == "F" else self.grads_out.pop(key)
            metas = stage.send if op.kind == "F" else stage.recv
            for i, (t, b) in enumerate(zip(tensors, metas)):
                t = torch.zeros(b.shape, dtype=b.dtype, device=self.mesh.device) if t is None else t.detach()
                self.sends.append(dist.isend(_wire(t).contiguous(), peer, group=group, tag=tag * 64 + i))
            return
        metas = stage.recv if op.kind == "F" else stage.send
        bufs = [torch.empty(b.shape, dtype=_wire_dtype(b.dtype), device=self.mesh.device) for b in metas]
        for work in [dist.irecv(t, peer, group=group, tag=tag * 64 + i) for i, t in enumerate(bufs)]:
            work.wait()
        if op.kind == "F":
            self.inputs[key] = [_leaf(_unwire(t, b.dtype), b.grad) for t, b in zip(bufs, metas)]
        else:
            self.grads_in[key] = [_unwire(t, b.dtype) if b.grad else None for t, b in zip(bufs, metas)]

    def _loss(self) -> torch.Tensor:
        local = torch.stack(self.losses).mean() if self.losses else torch.zeros((), device=self.mesh.device)
        if self.mesh.size("pp") > 1:  # the last stage's rank has it: every pp rank returns it
            local = compat.all_reduce_sum(local.float().clone(), self.mesh.group_name("pp"))
        return local


def _leaf(t: torch.Tensor, grad: bool) -> torch.Tensor:
    t = t.detach()
    return t.requires_grad_(True) if grad else t


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.bool else dtype  # gloo sends no bool


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.uint8) if t.dtype == torch.bool else t


def _unwire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.dtype != dtype else t
