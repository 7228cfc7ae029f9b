"""Plan.bucket_mb left to the cost model (None): the size of data parallelism's gradient buckets for the device
at hand. The driver decides it before the passes (Program.decisions["bucket_mb"]); grad_sync groups the gradients
by it (Program.bucket_mb), explain() prints it, the pre-flight check compares it across ranks.

With G bytes of gradients all-reduced over n ranks in buckets of b bytes (k = ceil(G / b) all-reduces, T the
alpha-beta time of one on the group's link, hardware.Link) and H = overlap x the backward's compute, the time
backward can hide them behind (hardware.overlap: 1 on GPUs, 0 on gloo on CPUs):

    total(b)   = (k - 1) T(b) + T(G - (k - 1) b)
    exposed(b) = max(T(min(b, G)), total(b) - H)      the last bucket is only ready when backward ends

Few large buckets pay the latency α fewer times; small ones leave less for after backward. The candidates
are 1, 2, 4, ..., 1024 MiB, and the choice is the smallest whose exposed time is within 5% of the least:
buckets hold 2 b bytes of buffers (compiled._buffers), so no larger than what pays.

Before the passes, G is the trainable parameters' bytes (in Plan.reduce_dtype where set) over tp x pp (what one
rank's grad_sync reduces; ZeRO-2/3 reduce theirs in their own buckets, Plan.zero_bucket_mb) and the backward 2/3
of the traced graph's compute (compiled.graph_cost) over tp x pp: one micro-batch's, the least a bucket can
hide behind.
"""
from __future__ import annotations

import math

from meshc.compiler.cost.hardware import Hardware, Link
from meshc.compiler.ir.plan import DEFAULT_BUCKET_MB as DEFAULT_MB, Decision
from meshc.compiler.ir.program import Program

CANDIDATES_MB = tuple(float(2**i) for i in range(11))
SLACK = 1.05


def exposed(link: Link, n: int, grads: float, bucket: float, hidden: float) -> float:
    """Seconds of gradient all-reduce left after backward (module docstring)."""
    k = max(1, math.ceil(grads / bucket))
    total = (k - 1) * link.time("all_reduce", n, bucket) + link.time("all_reduce", n, grads - (k - 1) * bucket)
    return max(link.time("all_reduce", n, min(bucket, grads)), total - hidden)


def choose_bucket_mb(hw: Hardware, link: Link, n: int, grads: float, backward_s: float) -> Decision:
    """Decision(bucket MiB, why) for `grads` bytes over `n` ranks on `link` behind `backward_s` of compute."""
    hidden = hw.overlap * backward_s
    times = {mb: exposed(link, n, grads, mb * 2**20, hidden) for mb in CANDIDATES_MB}
    least = min(times.values())
    mb = min(mb for mb, t in times.items() if t <= SLACK * least)
    lat, bw = link.alpha_beta("all_reduce")
    whole = "one bucket holds them all" if mb * 2**20 >= grads else \
        f"one bucket would leave {exposed(link, n, grads, grads, hidden) * 1e3:.2f} ms"
    return Decision(mb, f"{hw.name} profile: {grads / 2**20:.2f} MiB of gradients all-reduced over {n} ranks, "
                        f"{times[mb] * 1e3:.2f} ms predicted exposed after backward, the smallest size within 5% "
                        f"of the least ({whole}; all-reduce latency {lat * 1e6:.0f} us, {bw / 1e9:.2f} GB/s; "
                        f"overlap {hw.overlap:g} of {backward_s * 1e3:.1f} ms of backward)")


def decide_buckets(program: Program, hw: Hardware) -> Decision:
    """Decision for Program.decisions["bucket_mb"]: the Plan's value, else the cost model's for `hw`."""
    plan, sizes = program.plan, program.mesh.sizes
    if plan.bucket_mb is not None:
        return Decision(float(plan.bucket_mb), f"Plan.bucket_mb={plan.bucket_mb:g}")
    dp, tp, pp = sizes.get("dp", 1), sizes.get("tp", 1), sizes.get("pp", 1)
    if dp == 1 or plan.zero in (2, 3):
        why = "dp = 1" if dp == 1 else f"ZeRO-{plan.zero} reduces the gradients in its own buckets (Plan.zero_bucket_mb)"
        return Decision(DEFAULT_MB, f"{why}: no data-parallel all-reduce to size, {DEFAULT_MB:g} MiB for the rest")
    trainable = [s for s in program.params.values() if s.requires_grad]
    grads = sum(math.prod(s.shape) * (plan.reduce_dtype or s.dtype).itemsize for s in trainable) / (tp * pp)
    if grads <= 0:
        return Decision(DEFAULT_MB, f"no trainable parameter: {DEFAULT_MB:g} MiB")
    backward = 0.0
    if hw.overlap > 0:  # what the buckets can hide behind; nothing to hide behind without overlap
        from meshc.compiler.cost.compiled import graph_cost

        backward = 2 / 3 * graph_cost(program.gm).time(hw)[0] / (tp * pp)
    return choose_bucket_mb(hw, hw.link(tp, dp), dp, grads, backward)
