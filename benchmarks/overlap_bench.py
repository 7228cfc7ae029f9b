"""Overlap in both directions, and the cost model's default against the plans it chooses among.

    python benchmarks/overlap_bench.py [--tp 2] [--steps 10] [--only rings|plans]

Rings (runtime/ops/collective_matmul.py), on tp ranks over gloo, one thread each, activation (8, 128, 256) fp32
sharded on the sequence, weight 1024 x 256: for each of the four rings (all-gather + matmul forward, its
backward's reduce-scatter ring, matmul + reduce-scatter forward, its backward's all-gather ring), the median
time of the ring; of its matmuls alone (the same code with every transfer a local copy); of its transfers alone
(the same ring with nothing computed); and of the unfused pair (functional collective, then the matmul).
    overlap = (matmuls + transfers − ring) / min(matmuls, transfers)   1: fully hidden, 0: one after the other,
              below 0: the ring slower than both one after the other (on 2 shared cores, gloo's threads and the
              matmuls take turns on the same cores); "exposed in the ring" = ring − matmuls alone.

Plans: torch's reference Transformer (tp_bench's: 4 layers, width 256, batch 8, seq 128) at tp ranks, median
step (forward + backward + AdamW) with Plan.fusion True / False / None (the cost model's choice) and with
sequence parallelism, collective_matmul True / False / None; the plans of a group are compiled in one launch
and their steps interleaved, so that they share the machine's drifting load. Exposed communication per step: the time the
rank's thread spends inside functional collectives and their waits (a dispatch mode times them; the
collective matmul's point-to-point waits are not functional collectives, so its rows count only what else
communicates), one step after the timed ones.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import arg_parser, launch, lm_loss, reference_transformer, report, run_worker, table, \
    token_batch  # noqa: E402

B, T, H, F_OUT = 8, 128, 256, 1024
LAYERS, VOCAB = 4, 1024


def _timer(fn, before=None, reps: int = 15) -> float:
    import statistics
    import time

    import torch.distributed as dist

    times = []
    for i in range(reps + 2):
        if before:
            before()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rings(tp: int) -> list[dict]:
    from unittest import mock

    import torch
    import torch.nn.functional as F

    import meshc
    from meshc.runtime.ops import collective_matmul as cm
    from meshc.runtime.ops.collectives import all_gather_rs, reduce_scatter

    mesh = meshc.mesh(tp=tp, timeout_s=300)
    n, index, group, ranks = tp, mesh.coord("tp"), mesh.group_name("tp"), tuple(mesh.group_ranks("tp"))
    kw = {"dim": 1, "size": n, "index": index, "group": group}
    torch.manual_seed(0)
    x = torch.randn(B, T // n, H, requires_grad=True)  # this rank's sequence shard
    x_full = torch.randn(B, T, H, requires_grad=True)  # the row-parallel matmul's input (its features sharded)
    w1, w2 = torch.randn(F_OUT, H, requires_grad=True), torch.randn(H, H, requires_grad=True)
    # matmuls alone: the ring's code with each transfer replaced by a local copy (realistic values, no wait)
    no_transfer = lambda: mock.patch.object(cm, "_exchange", lambda send, recv, *a: [recv.copy_(send)] and [])  # noqa: E731
    held = {}

    def ag_fwd():
        held["y"] = cm.all_gather_matmul(x, w1, None, **kw, ranks=ranks)[0]

    def rs_fwd():
        held["y"] = cm.matmul_reduce_scatter(x_full, w2, **kw, ranks=ranks)

    def backward():
        held["y"].backward(torch.ones_like(held["y"]))
    chunk = torch.randn(B, T // n, H)
    partials = [torch.randn(B, T // n, H) for _ in range(n)]
    rings = {
        "all-gather + matmul (forward)": (ag_fwd, None, lambda: cm.gather_ring(chunk, n, index, group, ranks,
                                                                                lambda c, j: None),
                                          lambda: F.linear(all_gather_rs(x, chunks=1, **kw), w1)),
        "  its backward: reduce-scatter ring": (backward, ag_fwd, lambda: cm.scatter_ring(
            lambda j: partials[j].clone(), n, index, group, ranks), None),
        "matmul + reduce-scatter (forward)": (rs_fwd, None, lambda: cm.scatter_ring(
            lambda j: partials[j].clone(), n, index, group, ranks),
            lambda: reduce_scatter(F.linear(x_full, w2), dim=1, chunks=1, size=n, group=group)),
        "  its backward: all-gather ring": (backward, rs_fwd, lambda: cm.gather_ring(chunk, n, index, group, ranks,
                                                                                      lambda c, j: None), None),
    }
    rows = []
    for name, (run, before, transfers, plain) in rings.items():
        ring = _timer(run, before)
        with no_transfer():
            matmuls = _timer(run, before)
        comm = _timer(transfers)
        row = {"ring": name, "ring (ms)": ring * 1e3, "matmuls alone (ms)": matmuls * 1e3,
               "transfers alone (ms)": comm * 1e3, "exposed in the ring (ms)": (ring - matmuls) * 1e3,
               "overlap": (matmuls + comm - ring) / min(matmuls, comm)}
        if plain is not None:
            row["collective + matmul (ms)"] = _timer(plain) * 1e3
        rows.append(row)
    return rows


def worker(config: dict) -> None:
    import torch

    torch.set_num_threads(1)
    if config["what"] == "rings":
        report({"rows": _rings(config["tp"])})
        return
    report({"rows": _plan_steps(config)})


def _plan_steps(config: dict) -> list[dict]:
    """Every plan of the group compiled in this launch, their steps interleaved round by round (the machine's
    load drifts: plans timed in turn see the same drift)."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    import meshc
    from meshc.compiler.ir import torch_compat as compat

    mesh = meshc.mesh(tp=config["tp"], timeout_s=300)
    x, y = token_batch(B, T, VOCAB)
    steps = []
    for _, fields in config["plans"]:
        job = meshc.compile(reference_transformer(LAYERS, H, 8, VOCAB, T), mesh, example_inputs=(x,),
                            plan=meshc.Plan(trace="non-strict", **fields))
        opt = job.optimizer(torch.optim.AdamW, lr=1e-3)

        def step(job=job, opt=opt):
            job.step(x, y, lm_loss)
            opt.step()
            opt.zero_grad()
        steps.append((job, step))
    times = [[] for _ in steps]
    for i in range(config["steps"] + 2):
        for k, (_, step) in enumerate(steps):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            if i >= 2:
                times[k].append(time.perf_counter() - t0)

    class Blocked(compat.dispatch_mode_base()):
        total = 0.0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            if "_c10d_functional" in str(func):
                Blocked.total += time.perf_counter() - t0
            return out
    rows = []
    for (name, _), (job, step), ts in zip(config["plans"], steps, times):
        exposed = []
        for _ in range(3):
            Blocked.total = 0.0
            dist.barrier()
            with Blocked():
                step()
            exposed.append(Blocked.total)
        decisions = job.compiled.program.decisions
        fused = [k.split(".")[1] for k, d in decisions.items() if k.startswith("fusion.") and d.value]
        rows.append({"plan": name, "step (ms)": statistics.median(ts) * 1e3,
                     "exposed comm (ms)": statistics.median(exposed) * 1e3,
                     "fused": ", ".join(fused) or "none",
                     "collective matmul": "on" if decisions["collective_matmul"].value else "off",
                     "why": [d.line(k) for k, d in decisions.items()]})
    return rows


GROUPS = [[("tp, fusion on", {"fusion": True}), ("tp, fusion off", {"fusion": False}),
           ("tp, default (cost model)", {})],
          [("tp+sp, fusion on", {"sequence_parallel": True, "fusion": True, "collective_matmul": False}),
           ("tp+sp, fusion off", {"sequence_parallel": True, "fusion": False}),
           ("tp+sp, collective matmul on", {"sequence_parallel": True, "collective_matmul": True}),
           ("tp+sp, default (cost model)", {"sequence_parallel": True})]]


def main() -> None:
    p = arg_parser()
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--only", choices=("rings", "plans"), default=None)
    args = p.parse_args()
    if run_worker(args, worker):
        return
    script = os.path.abspath(__file__)
    if args.only in (None, "rings"):
        rows = launch(script, args.tp, {"what": "rings", "tp": args.tp})["rows"]
        print(table(rows, ["ring", "ring (ms)", "matmuls alone (ms)", "transfers alone (ms)",
                           "exposed in the ring (ms)", "overlap", "collective + matmul (ms)"]), flush=True)
    if args.only in (None, "plans"):
        rows = []
        for plans in GROUPS:
            rows += launch(script, args.tp, {"what": "plans", "tp": args.tp, "plans": plans,
                                             "steps": args.steps})["rows"]
        print(table(rows, ["plan", "step (ms)", "exposed comm (ms)", "fused", "collective matmul"]))
        for row in rows:
            if "default" in row["plan"]:
                print(f"\n{row['plan']}:\n  " + "\n  ".join(row["why"]))

if __name__ == "__main__":
    main()
