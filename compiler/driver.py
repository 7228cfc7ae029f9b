"""The pass driver: runs the passes a Plan calls for, in order, and records what each one did.

Each pass is `fn(program) -> program`, pure (it edits a copy), and leaves compiler/verify's invariants
true. The driver builds the list from the Plan (DESIGN.md §3), can switch a pass off by name
(`Plan(disable=(...))`), logs every pass with its time and the nodes it added or removed, checks the
invariants after each pass when asked (`Plan(verify=True)`, as tests do), and in debug mode
(`Plan(debug_dir=...)`) writes each graph before and after its pass. Before the first pass it makes the
choices the Plan leaves to the cost model (fusion, collective matmul, gradient buckets: Program.decisions).

No bare exception escapes a pass (DESIGN.md §5.6): a MeshcError passes through as it is; anything else
(an IndexError, a KeyError, torch's own errors) becomes a MeshcInternalError naming the pass, the node it
was processing (found in the failing frames' locals: the innermost meshc frame holding an fx.Node named
`node` or `n`, else torch.fx's own) with its op and the model's source line, and the original error (chained,
and kept as `.original`). `reporting(name)` gives other compiler steps (stage extraction) the same.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch.fx as fx

from meshc.compiler.ir.errors import MeshcError, MeshcInternalError, MeshcValueError, meshc_folders
from meshc.compiler.ir.fx_ops import model_source, op_label
from meshc.compiler.ir.program import Program

log = logging.getLogger("meshc.driver")

PassFn = Callable[[Program], Program]

# Every pass meshc knows, in the order build_passes runs them. DESIGN.md §3 also places context (cp) between
# experts and tensor_parallel; it is not built, so it is not here.
PASS_NAMES = ("head_norms", "shapes", "masks", "tp_placement", "experts", "context", "tensor_parallel", "gqa", "pipeline_split", "zero",
              "grad_sync", "fuse_comm", "remat")


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
    from meshc.passes.context import context_pass
    from meshc.passes.experts import experts_pass
    from meshc.passes.fuse_comm import fuse_comm_pass
    from meshc.passes.attention.gqa import gqa_pass
    from meshc.passes.attention.head_norms import head_norms_pass
    from meshc.passes.grad_sync import grad_sync_pass
    from meshc.passes.attention.masks import masks_pass
    from meshc.passes.pipeline_split import pipeline_split_pass
    from meshc.passes.tp_placement import tp_placement_pass
    from meshc.passes.remat import remat_pass
    from meshc.passes.shapes import shapes_pass
    from meshc.passes.tensor_parallel import tensor_parallel_pass
    from meshc.passes.zero import zero_pass

    plan = program.plan
    unknown = [n for n in plan.disable if n not in PASS_NAMES]
    if unknown:
        raise MeshcValueError(f"Plan.disable: unknown pass {unknown[0]!r}: expected names among "
                              f"{', '.join(PASS_NAMES)}")
    wanted = [("head_norms", head_norms_pass), ("shapes", shapes_pass), ("masks", masks_pass), ("tp_placement", tp_placement_pass), ("experts", experts_pass),
              ("context", context_pass),
              ("tensor_parallel", tensor_parallel_pass), ("gqa", gqa_pass),
              ("pipeline_split", pipeline_split_pass), ("zero", zero_pass), ("grad_sync", grad_sync_pass),
              ("fuse_comm", fuse_comm_pass), ("remat", remat_pass)]
    return [(name, fn) for name, fn in wanted if name not in plan.disable]


def run_passes(program: Program, passes: list[tuple[str, PassFn]] | None = None) -> Program:
    """Run `passes` (default: `build_passes(program)`) and return the final program with its pass log."""
    from meshc.compiler.ir.show import format_graph
    from meshc.compiler.verify import verify

    passes = build_passes(program) if passes is None else passes
    if not program.decisions:
        program = with_decisions(program)
    debug_dir = program.plan.debug_dir
    if program.plan.verify:
        verify(program)
    for index, (name, fn) in enumerate(passes):
        before = _census(program)
        notes_before = len(program.notes)
        if debug_dir:
            _dump(debug_dir, f"{index:02d}_{name}_before.txt", format_graph(program.gm, program))
        t0 = time.perf_counter()
        with reporting(f"pass {name!r}", hint=_HINTS.get(name, "")):
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


def with_decisions(program: Program) -> Program:
    """The program with the choices its Plan leaves to the cost model made (compiler/cost/fusion.py,
    compiler/cost/buckets.py, compiler/cost/inductor.py, compiler/cost/vocab.py) for its hardware profile (Program.hardware; None: the profile of the mesh's
    device, hardware.for_device)."""
    from meshc.compiler.cost.buckets import decide_buckets
    from meshc.compiler.cost.fusion import decide
    from meshc.compiler.cost.hardware import for_device
    from meshc.compiler.cost.inductor import decide_inductor, yield_to_inductor
    from meshc.compiler.cost.vocab import decide_vocab_parallel

    hw = program.hardware or for_device(program.mesh.device_type)
    decisions = {**decide(program, hw), "bucket_mb": decide_buckets(program, hw),
                 "vocab_parallel": decide_vocab_parallel(program, hw)}
    decisions = yield_to_inductor(program, decisions)
    decisions["inductor"] = decide_inductor(program, hw)
    return program.replace(hardware=hw, decisions=decisions)


# What a user can do about a failing pass while the bug is fixed, where there is something.
_HINTS = {
    "tp_placement": "keep the module replicated on tp (Plan(tp={'<module glob>': 'replicate'}))",
    "tensor_parallel": "keep the module replicated on tp (Plan(tp={'<module glob>': 'replicate'}))",
    "fuse_comm": "switch the pass off (Plan(disable=('fuse_comm',)))",
    "remat": "switch activation checkpointing off (Plan(remat='none'))",
}


@contextlib.contextmanager
def reporting(step: str, hint: str = "") -> Iterator[None]:
    """Run a compiler step; an exception from it that is not a MeshcError becomes a MeshcInternalError naming
    `step`, the graph node being processed (if a frame of the traceback holds one) and the original error."""
    try:
        yield
    except MeshcError:
        raise
    except Exception as error:
        node = _failing_node(error.__traceback__)
        where, module = "", ""
        if node is not None:
            op = op_label(node.target) if node.op == "call_function" else node.op
            stack = node.meta.get("nn_module_stack") or {}
            module = list(stack.values())[-1][0] if stack else ""
            where = f" at node {node.format_node()} (op {op}" + (f" in module {module}" if module else "")
            where += f"; model source: {model_source(node)})" if model_source(node) else ")"
        todo = f"; until it is fixed, {hint.replace('<module glob>', module or '<module glob>')}" if hint else ""
        internal = MeshcInternalError(f"{step}: expected to compile this graph, got {type(error).__name__}: {error}"
                                      f"{where}. This is a bug in meshc: please report it with this message{todo}")
        internal.step, internal.node, internal.original = step, node, error
        raise internal from error


def _failing_node(tb) -> fx.Node | None:
    """The fx.Node the failing code was processing: from the innermost frame of meshc's own packages that
    holds one in a local named `node` (or `n`), else from the innermost frame holding one named `node`."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    ours = meshc_folders()
    for frame in reversed(frames):
        if os.path.abspath(frame.f_code.co_filename).startswith(ours):
            for name in ("node", "n"):
                if isinstance(frame.f_locals.get(name), fx.Node):
                    return frame.f_locals[name]
    for frame in reversed(frames):
        if isinstance(frame.f_locals.get("node"), fx.Node):
            return frame.f_locals["node"]
    return None


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
