"""The choices a Plan leaves to the cost model (fields at None), decided for the device at hand: which of
fuse_comm's kernels to insert, and whether sequence parallelism's collectives become collective matmuls.
The driver calls `decide` before the passes; fuse_comm reads Program.decisions; explain() prints them.

Fusion, kernel by kernel: fused where the kernel is predicted faster than the chain it replaces,
    speedup = chain time / kernel time, forward and backward together, fused iff speedup > 1:
    measured   hardware.fused_speedup[kernel], written by `meshc calibrate` on this device, when present;
    predicted  otherwise, from each kernel's traffic (TRAFFIC): with A the bytes of one activation,
               time = passes·A/mem_bandwidth + ops·op_overhead, for the chain and for the kernel as this device
               runs it: Triton on CUDA (one pass over what it reads and writes, two launches); pure torch on
               CPU (the chain's own passes, plus the custom op's dispatch forward and backward), never faster.
Collective matmul (one decision for both rings, as Plan.collective_matmul is one field), for one
all-gather + matmul and one matmul + reduce-scatter of a chunk of C bytes (this rank's sequence shard)
over the n ranks of tp, with M the seconds of the matmuls next to them:
    plain = T(all_gather, n, C) + T(reduce_scatter, n, n·C) + 2·M
    ring  = 2·(M + (n−1)·(T(send, C) + 2·op_overhead) − overlap·min(M·(n−1)/n, (n−1)·T(send, C)))
    on iff ring < plain (T: hardware.Link's α-β model on the tp group's link). A and C, M come from the
    traced graph's first linear (its input a (batch, sequence, hidden) activation).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from meshc.compiler.cost.hardware import Hardware
from meshc.compiler.ir.plan import Decision
from meshc.compiler.ir.program import Program

# kernel -> ((chain passes, chain ops), (Triton passes, Triton ops)), forward + backward, passes over one activation
# (a read or a write of an activation-sized tensor), counted from the traced chains and the kernels' docstrings.
TRAFFIC = {
    "bias_dropout_add_norm": ((20, 9), (9, 3)),  # bias add, dropout, residual add, norm; their backwards
    "bias_gelu": ((8, 4), (6, 3)),  # bias add, gelu; gelu's backward and the bias gradient's sum
    "bias_swiglu": ((14, 5), (8, 2)),  # silu, mul; the product's two gradients and silu's
    "zero_copy": ((6, 24), (4, 2)),  # a block's ~8 tensors cast, padded and packed, then copied out one by one
    "grad_prologue": ((6, 17), (2, 1)),  # the same tensors flattened, cast, padded, packed and scaled
}
COLLECTIVE_MATMUL = ("all_gather_matmul", "matmul_reduce_scatter")
KERNELS = (*TRAFFIC, *COLLECTIVE_MATMUL)


def fusion_speedup(hw: Hardware, kernel: str, device_type: str, act_bytes: float) -> tuple[float, str]:
    """(chain time / kernel time, how it is known) for `kernel` on this device."""
    measured = dict(hw.fused_speedup)
    if kernel in measured:
        return measured[kernel], "measured (the profile's fused_speedup)"
    (passes, ops), (k_passes, k_ops) = TRAFFIC[kernel]
    if device_type != "cuda":  # the CPU implementation is the chain in torch, behind a custom op
        k_passes, k_ops = passes, ops + 2
    chain = passes * act_bytes / hw.mem_bandwidth + ops * hw.op_overhead
    fused = k_passes * act_bytes / hw.mem_bandwidth + k_ops * hw.op_overhead
    return chain / fused, f"predicted from its traffic ({'Triton' if device_type == 'cuda' else 'pure torch'})"


def first_linear(program: Program) -> tuple[float, float]:
    """(bytes of the first linear's input, its forward FLOPs) in the traced graph; (0, 0) without one."""
    for node in program.gm.graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.aten.linear.default:
            x, w = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in node.args[:2])
            if isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor):
                return float(x.numel() * x.element_size()), 2.0 * x.numel() * w.shape[0]
    return 0.0, 0.0


def ring_times(hw: Hardware, n: int, chunk: float, matmul_s: float, link) -> tuple[float, float]:
    """(plain, ring) seconds of one all-gather + matmul and one matmul + reduce-scatter (module docstring)."""
    plain = link.time("all_gather", n, chunk) + link.time("reduce_scatter", n, n * chunk) + 2 * matmul_s
    send = link.time("send", 2, chunk)
    hidden = hw.overlap * min(matmul_s * (n - 1) / n, (n - 1) * send)
    ring = 2 * (matmul_s + (n - 1) * (send + 2 * hw.op_overhead) - hidden)
    return plain, ring


def _collective_matmul(program: Program, hw: Hardware, act: tuple[float, float]) -> Decision:
    plan, n = program.plan, program.mesh.size("tp")
    if plan.collective_matmul is not None:
        return Decision(plan.collective_matmul, f"Plan.collective_matmul={plan.collective_matmul}")
    if not plan.sequence_parallel:
        return Decision(False, "no sequence parallelism (Plan.sequence_parallel=False): nothing to overlap")
    if plan.fusion is False:
        return Decision(False, "Plan.fusion=False turns the fusion pass off")
    if n == 1 or not act[0]:
        return Decision(False, "tp = 1: no collective to overlap" if n == 1 else "no linear in the graph")
    chunk, matmul_s = act[0] / n, act[1] / n / hw.flops * hw.compute_scale  # this rank's shard; tp-local matmul
    plain, ring = ring_times(hw, n, chunk, matmul_s, hw.link(1, n))
    verdict = f"{plain / ring:.2f}x faster" if ring < plain else f"{ring / plain:.1f}x slower"
    return Decision(ring < plain, f"{hw.name} profile: the rings predicted {verdict} than "
                                  f"collective then matmul ({ring * 1e6:.0f} vs {plain * 1e6:.0f} us per layer, "
                                  f"overlap {hw.overlap:g})")


def decide(program: Program, hw: Hardware) -> dict[str, Decision]:
    """Decision per choice ("fusion.<kernel>", "collective_matmul") for this program on `hw`."""
    plan = program.plan
    act = first_linear(program)
    out = {}
    for kernel in TRAFFIC:
        if plan.require_fusion or plan.fusion is not None:
            value = plan.require_fusion or plan.fusion
            out[f"fusion.{kernel}"] = Decision(value, "Plan.require_fusion=True" if plan.require_fusion
                                               else f"Plan.fusion={plan.fusion}")
            continue
        speedup, how = fusion_speedup(hw, kernel, program.mesh.device_type, act[0] or 2**20)
        ratio = f"{speedup:.2f}x faster" if speedup > 1 else f"{1 / speedup:.1f}x slower"
        out[f"fusion.{kernel}"] = Decision(speedup > 1, f"{hw.name} profile: fused {kernel} {ratio} than the "
                                                        f"chain, {how}")
    out["collective_matmul"] = _collective_matmul(program, hw, act)
    return out

