"""The pass driver: runs the passes a Plan calls for, in order, and records what each one did.

Each pass is `fn(program) -> program`, pure (it edits a copy), and leaves compiler/verify's invariants
true. The driver builds the list from the Plan (DESIGN.md §3), can switch a pass off by name
(`Plan(disable=(...))`), logs every pass with its time and the nodes it added or removed, checks the
invariants after each pass when asked (`Plan(verify=True)`, as tests do), and in debug mode
(`Plan(debug_dir=...)`) writes each graph before and after its pass.
"""
from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from .ir.errors import MeshcValueError
from .ir.fx_ops import op_label
from .ir.program import Program

log = logging.getLogger("meshc.driver")

PassFn = Callable[[Program], Program]

# Every pass meshc knows, in the order build_passes runs them: shapes, plan, tensor_parallel, pipeline_split,
# zero, grad_sync, fuse_comm, remat. DESIGN.md §3 also places experts (ep) and context (cp) between plan and
# tensor_parallel; neither is built, so neither is here.
PASS_NAMES = ("shapes", "plan", "tensor_parallel", "pipeline_split", "zero", "grad_sync", "fuse_comm", "remat")


@dataclass
class PassRecord:
    name: str
    seconds: float
    nodes_before: int
    nodes_after: int
    added: dict[str, int] = field(default_factory=dict)
    removed: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        delta = ", ".join([f"+{n} {t}" for t, n in self.added.items()] + [f"-{n} {t}" for t, n in self.removed.items()])
        text = f"{self.name}: {self.seconds * 1e3:.1f} ms, {self.nodes_before} -> {self.nodes_after} nodes"
        return text + (f" ({delta})" if delta else "") + "".join(f"\n    {n}" for n in self.notes)


def build_passes(program: Program) -> list[tuple[str, PassFn]]:
    """The passes this program's Plan and Mesh call for, in order, minus those the Plan disables."""
    from meshc.passes.fuse_comm import fuse_comm_pass
    from meshc.passes.grad_sync import grad_sync_pass
    from meshc.passes.pipeline_split import pipeline_split_pass
    from meshc.passes.plan import plan_pass
    from meshc.passes.remat import remat_pass
    from meshc.passes.shapes import shapes_pass
    from meshc.passes.tensor_parallel import tensor_parallel_pass
    from meshc.passes.zero import zero_pass

    plan = program.plan
    unknown = [n for n in plan.disable if n not in PASS_NAMES]
    if unknown:
        raise MeshcValueError(f"Plan.disable: unknown pass {unknown[0]!r}: expected names among "
                              f"{', '.join(PASS_NAMES)}")
    wanted = [("shapes", shapes_pass), ("plan", plan_pass), ("tensor_parallel", tensor_parallel_pass),
              ("pipeline_split", pipeline_split_pass), ("zero", zero_pass), ("grad_sync", grad_sync_pass),
              ("fuse_comm", fuse_comm_pass), ("remat", remat_pass)]
    return [(name, fn) for name, fn in wanted if name not in plan.disable]


def run_passes(program: Program, passes: list[tuple[str, PassFn]] | None = None) -> Program:
    """Run `passes` (default: `build_passes(program)`) and return the final program with its pass log."""
    from .show import format_graph
    from .verify import verify

    passes = build_passes(program) if passes is None else passes
    debug_dir = program.plan.debug_dir
    if program.plan.verify:
        verify(program)
    for index, (name, fn) in enumerate(passes):
        before = _census(program)
        notes_before = len(program.notes)
        if debug_dir:
            _dump(debug_dir, f"{index:02d}_{name}_before.txt", format_graph(program.gm, program))
        t0 = time.perf_counter()
        result = fn(program)
        seconds = time.perf_counter() - t0
        after = _census(result)
        record = PassRecord(
            name=name, seconds=seconds,
            nodes_before=sum(before.values()), nodes_after=sum(after.values()),
            added=dict(after - before), removed=dict(before - after), notes=result.notes[notes_before:],
        )
        result.pass_log.append(record)
        log.info("pass %s", record.summary())
        if debug_dir:
            _dump(debug_dir, f"{index:02d}_{name}_after.txt", format_graph(result.gm, result))
        if program.plan.verify:
            verify(result, after_pass=name)
        program = result
    return program


def _census(program: Program) -> Counter:
    """Nodes by kind: the call target's name for calls, the opcode otherwise."""
    out: Counter = Counter()
    for n in program.gm.graph.nodes:
        out[op_label(n.target) if n.op == "call_function" else n.op] += 1
    return out


def _dump(folder: str, filename: str, text: str) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, filename), "w") as f:
        f.write(text)
