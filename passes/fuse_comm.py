"""fuse_comm: rewrite the memory-bound chains next to collectives into meshc's fused kernels.

Purpose: after the sharding passes, the ops on either side of each collective read and write whole
activations several times; each pattern below finds such a chain next to a collective the earlier
passes inserted and replaces it with one kernel (kernels/). Patterns are data (PATTERNS): what anchors
a chain, how it must look, and how it is rewritten. A chain that is eligible but does not match is left
as it is, with the reason in Program.fusion (explain() prints "fused k of n eligible" per kernel);
Plan(require_fusion=True) turns any leftover into an error, Plan(fusion=False) turns the pass off.
Which kernels run is Program.decisions' (made by the driver from the cost model, compiler/cost/fusion.py,
where Plan.fusion / Plan.collective_matmul are None; the user's value otherwise): a kernel turned off
counts its eligible chains and says why it is off, and leaves them as they are.

  bias_dropout_add_norm  reduction (all-reduce / reduce-scatter) -> [+ bias] -> [dropout] -> + residual -> norm
  bias_gelu              column-parallel matmul [+ bias] -> GeLU (exact, tanh, or GPT-2's tanh written out)
  bias_swiglu            column-parallel gate and up matmuls -> silu(gate) * up
  zero_copy              ZeRO-3 gathers: cast + pack before, copy-out after (pack_cast / unpack kernels)
  grad_prologue          ZeRO-2/3 reduce-scatters: flatten + cast + scale + pad (pack_cast kernel)
  all_gather_matmul      sequence parallel's all-gather -> column-parallel linears   (collective_matmul)
  matmul_reduce_scatter  row-parallel linear -> sequence parallel's reduce-scatter   (collective_matmul)

Requires: tensor_parallel/zero have run ("meshc.placement" on values; their collective nodes).
Ensures: matched chains replaced (placements and values kept on the new nodes); Program.fusion maps each
    kernel to (fused, eligible, reasons left); values' "val" refreshed. With tp = 1 and no ZeRO, nothing
    is eligible.
Terms: eligible = a chain next to a collective that one of the kernels covers.

Before:  %all_reduce = all_reduce(%linear_3); %dropout_1 = aten.dropout(%all_reduce, 0.0, True)
         %add_1 = aten.add.Tensor(%dropout, %dropout_1); %layer_norm_1 = aten.layer_norm(%add_1, [32], %w, %b)
After:   %fused = bias_dropout_add_norm(%all_reduce, None, %dropout, %w, %b, p=0.0, norm='layernorm', eps=1e-05)
         %getitem = getitem(%fused, 0)        (was %layer_norm_1)     %getitem_1 = getitem(%fused, 1)  (was %add_1)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.program import Program

from meshc.passes import fuse_patterns as fp


@dataclass(frozen=True)
class Pattern:
    kernel: str
    anchors: Callable[[Program], list[fp.Anchor]]  # the eligible chains, each with the structure found
    match: Callable[[Program, Any], Any]  # (program, anchor) -> a typed match to rewrite, or a str saying why not
    rewrite: Callable[[Program, Any], None]


PATTERNS = (
    Pattern("bias_dropout_add_norm", fp.norm_anchors, fp.match_norm, fp.rewrite_norm),
    Pattern("bias_gelu", fp.gelu_anchors, fp.match_gelu, fp.rewrite_gelu),
    Pattern("bias_swiglu", fp.swiglu_anchors, fp.match_swiglu, fp.rewrite_swiglu),
    Pattern("zero_copy", fp.zero_gather_anchors, fp.match_flag, fp.set_fused),
    Pattern("grad_prologue", fp.zero_reduce_anchors, fp.match_flag, fp.set_fused),
    Pattern("all_gather_matmul", fp.ag_matmul_anchors, fp.match_ag_matmul, fp.rewrite_ag_matmul),
    Pattern("matmul_reduce_scatter", fp.mm_rs_anchors, fp.match_mm_rs, fp.rewrite_mm_rs),
)


@dataclass
class FusionResult:
    fused: int = 0
    eligible: int = 0
    left: list[str] = field(default_factory=list)
    off: str = ""  # why the kernel is not used at all ("" where it is)


def wanted(program: Program, kernel: str) -> tuple[bool, str]:
    """Whether `kernel` is used, and why: Program.decisions, else the Plan's explicit value."""
    key = "collective_matmul" if kernel in ("all_gather_matmul", "matmul_reduce_scatter") else f"fusion.{kernel}"
    decision = program.decisions.get(key)
    if decision is not None:
        return bool(decision.value), decision.why
    value = program.plan.collective_matmul if key == "collective_matmul" else program.plan.fusion
    if value is None:
        return False, "left to the cost model, which the driver consults (this program has no decisions)"
    return bool(value), f"Plan.{key.split('.')[0]}={value}"


def fuse_comm_pass(program: Program) -> Program:
    program = program.copy()
    if program.plan.fusion is False:
        program.notes.append("fusion off (Plan.fusion=False)")
        return program
    results: dict[str, FusionResult] = {}
    for pattern in PATTERNS:
        result = results.setdefault(pattern.kernel, FusionResult())
        on, why = wanted(program, pattern.kernel)
        for anchor in pattern.anchors(program):
            result.eligible += 1
            if not on:
                result.off = why
                continue
            found = pattern.match(program, anchor)
            if isinstance(found, str):
                result.left.append(f"%{anchor.node.name}: {found}")
                continue
            pattern.rewrite(program, found)
            result.fused += 1
    program.fusion = {k: v for k, v in results.items() if v.eligible}
    left = [f"{k}: {reason}" for k, v in program.fusion.items() for reason in v.left]
    if left and program.plan.require_fusion:
        raise MeshcValueError("Plan.require_fusion: expected every eligible chain fused, got "
                              f"{len(left)} left:\n  " + "\n  ".join(left))
    program.gm.graph.lint()
    program.gm.recompile()
    if any(r.fused for r in program.fusion.values()):
        from meshc.passes.layout import refresh_vals

        refresh_vals(program)
    for kernel, r in program.fusion.items():
        program.notes.append(f"{kernel}: not fused, {r.eligible} eligible ({r.off})" if r.off else
                             f"{kernel}: fused {r.fused} of {r.eligible} eligible"
                             + "".join(f"\n      left {reason}" for reason in r.left))
    return program

