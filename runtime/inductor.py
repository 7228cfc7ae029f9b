"""Per-rank programs lowered by Inductor (Program.decisions["inductor"] on).

    programs = InductorPrograms()
    run = programs.runner(program.gm)     # a callable with the graph's calling convention
    outs = run(*params, *buffers, *inputs)

Each graph is compiled on its first call, from that call's tensors (their shapes, dtypes and whether they
require gradients: AOTAutograd traces the joint forward-backward graph where some do, partitions it, and
Inductor compiles the forward at once and the backward at the first backward). The collectives in the graph
are functional collectives (`_c10d_functional.*` + `wait_tensor`), which Inductor keeps as calls in the
generated code and schedules for overlap (OVERLAP below); meshc's autograd-aware collectives
(runtime/ops/collectives.py) are traced through, their backward's collectives landing in the compiled backward
graph.

A call whose tensors differ from the compiled ones in shape, dtype, requires_grad or grad mode compiles again
(generated code is specialized to what it was compiled for); each compilation is counted with its seconds.
Inductor's FX-graph and AOTAutograd caches are torch's own (TORCHINDUCTOR_CACHE_DIR): identical programs on
several ranks, or in a second run, are compiled once.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.ir.errors import MeshcRuntimeError


# Communication overlap by scheduling: Inductor's passes move each collective up to where its inputs are ready
# (raise_comms), each wait down to its first consumer (sink_waits) and independent compute between the two
# (reorder_compute_for_overlap). Measured on 2 gloo ranks, benchmarks/compiled_ranks.py, 2026-12-04: compiled dp step
# 164.1 -> 151.4 ms, tp 194.6 -> 184.6 ms (docs/benchmarks.md#compiled-per-rank-programs).
OVERLAP = {"reorder_for_compute_comm_overlap": True,
           "reorder_for_compute_comm_overlap_passes": ["sink_waits", "raise_comms", "reorder_compute_for_overlap"]}


@dataclass
class CompileStats:
    """What Inductor compiled for a job: graphs by kind and the seconds spent in Inductor on them."""

    forward: int = 0
    backward: int = 0
    seconds: float = 0.0
    programs: int = 0  # graph + input signature pairs compiled (each gives one forward, and one backward once run)
    collectives: list = field(default_factory=list)  # per graph compiled: "forward"/"backward", its collectives in order

    def line(self) -> str:
        return (f"{self.programs} program(s) compiled: {self.forward} forward and {self.backward} backward graph(s), "
                f"{self.seconds:.1f} s in Inductor")


@dataclass
class InductorPrograms:
    stats: CompileStats = field(default_factory=CompileStats)
    _compiled: dict = field(default_factory=dict)

    def runner(self, gm: fx.GraphModule, name: str = "program") -> Callable[..., Any]:
        """`gm`'s calling convention, each distinct input signature compiled by Inductor on first use."""
        def run(*args: Any) -> Any:
            key = (id(gm), torch.is_grad_enabled(), tuple(_signature(a) for a in args))
            fn = self._compiled.get(key)
            if fn is None:
                fn = self._compiled[key] = self._compile(gm, list(args), name)
            return fn(*args)
        return run

    def _compile(self, gm: fx.GraphModule, args: list, name: str) -> Callable[..., Any]:
        def on_graph(graph: fx.GraphModule, is_backward: bool, seconds: float) -> None:
            if is_backward:
                self.stats.backward += 1
            else:
                self.stats.forward += 1
            self.stats.seconds += seconds
            self.stats.collectives.append(("backward" if is_backward else "forward", _collectives(graph)))
        try:
            # compile_fx may rewrite the graph it is handed; the program's own graph stays as the passes left it
            fn = compat.inductor_compile(copy.deepcopy(gm), args, on_graph=on_graph, config_patches=OVERLAP)
        except Exception as error:  # noqa: BLE001 - re-raised with what to do; the cause chained
            raise MeshcRuntimeError(f"inductor: expected Inductor to compile the {name} of this rank, got "
                                    f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}; "
                                    "run it as FX code with Plan(inductor=False) and report the failure") from error
        self.stats.programs += 1
        return fn


def _collectives(graph: fx.GraphModule) -> list[str]:
    """The functional collectives a graph handed to Inductor calls, in order, as "op(group)"."""
    out = []
    for node in graph.graph.nodes:
        target = node.target
        if node.op == "call_function" and getattr(target, "namespace", None) == "_c10d_functional" \
                and compat.op_name(target) != "wait_tensor":
            group = next((a for a in node.args if isinstance(a, str) and a not in ("sum", "avg", "max", "min")), "")
            out.append(f"{compat.op_name(target)}({group})")
    return out


def _signature(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return (tuple(a.shape), a.dtype, a.device.type, a.requires_grad)
    return repr(a)
