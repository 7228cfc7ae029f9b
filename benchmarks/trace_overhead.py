"""What `job.trace(path)` costs per step: the same steps timed with and without tracing, on 2 gloo ranks.

    python benchmarks/trace_overhead.py [--steps 8]

Model: torch's reference Transformer, 4 layers, dim 256, 8 heads, vocab 1024, batch 8 x 128 tokens, fp32,
AdamW, one thread per rank. Per mesh: `--steps` steps untraced, then `--steps` steps inside one
`job.trace(...)`, in three alternating rounds; the fastest step of each kind (on a shared 2-core machine the
minimum is what load does not inflate), the events recorded per step, and the seconds of the exit (gathering
every rank's events to rank 0 and writing the file).
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import arg_parser, launch, lm_loss, reference_transformer, report, run_worker, table, token_batch  # noqa: E402

MESHES = [("dp=2", {"dp": 2}, 1), ("tp=2", {"tp": 2}, 1), ("pp=2, 4 micro-batches", {"pp": 2}, 4)]


def worker(config: dict) -> None:
    import torch
    import torch.distributed as dist

    import meshc

    torch.set_num_threads(1)
    mesh = meshc.mesh(timeout_s=300, **config["mesh"])
    x, y = token_batch(8, 128, 1024)
    job = meshc.compile(reference_transformer(4, 256, 8, 1024, 128), mesh, example_inputs=(mesh.shard_batch(x),),
                        plan=meshc.Plan(microbatches=config["microbatches"]))
    opt = job.optimizer(torch.optim.AdamW, lr=1e-3)
    xs, ys = mesh.shard_batch(x), mesh.shard_batch(y)

    def steps(n: int) -> list[float]:
        out = []
        for _ in range(n):
            dist.barrier()
            t0 = time.perf_counter()
            job.step(xs, ys, lm_loss)
            opt.step()
            opt.zero_grad()
            out.append(time.perf_counter() - t0)
        return out
    steps(3)
    plain, traced, exits, events = [], [], [], 0
    folder = tempfile.mkdtemp()
    for r in range(3):
        plain += steps(config["steps"])
        path = os.path.join(folder, f"trace{r}.json")
        with job.trace(path) as trace:
            traced += steps(config["steps"])
            t0 = time.perf_counter()
        exits.append(time.perf_counter() - t0)
        events = len(trace.events) / config["steps"]
    base, with_trace = min(plain), min(traced)
    report({"step_ms": base * 1e3, "traced_ms": with_trace * 1e3, "overhead_ms": (with_trace - base) * 1e3,
            "overhead": with_trace / base - 1, "events_per_step": events, "exit_s": max(exits)})
    mesh.close()


def main() -> None:
    p = arg_parser(description=__doc__)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    if run_worker(args, worker):
        return
    rows = []
    for name, sizes, m in MESHES:
        r = launch(__file__, 2, {"mesh": sizes, "microbatches": m, "steps": args.steps})
        rows.append({"mesh": name, "step (ms)": r["step_ms"], "traced step (ms)": r["traced_ms"],
                     "overhead (ms)": r["overhead_ms"], "overhead": f"{100 * r['overhead']:.1f}%",
                     "events per step per rank": r["events_per_step"], "gather + write (s)": r["exit_s"]})
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
