"""The planner's choice against measuring every candidate, on 2 CPU ranks over gloo.

    python benchmarks/planner_bench.py [--rounds 4] [--steps 3] [--profile PATH]

1. `meshc calibrate` (unless --profile names a profile already written) measures this machine.
2. The planner scores every plan of 2 ranks for torch's reference Transformer (2 layers of width 128,
   batch 8 x 128): dp=2, tp=2 or pp=2; ZeRO 0-3; 1, 2 or 4 micro-batches; each schedule; remat; sequence
   and vocabulary parallelism; on the real graphs of a simulated rank (compiler/planner/compiled.plan_compiled).
3. A 2-rank torchrun job compiles every candidate and times them in interleaved rounds (median).
Prints predicted and measured step time per plan, both rankings, Spearman's rank correlation, and
where the planner's choice lands among the measured.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import interleaved_medians, launch, report, table  # noqa: E402

FIELDS = ("zero", "microbatches", "schedule", "virtual", "remat", "sequence_parallel", "vocab_parallel", "fusion")


def worker(config: dict) -> None:
    import torch
    import torch.distributed as dist

    import meshc
    from tests.compiler import cost_runs

    torch.set_num_threads(1)
    x, y = cost_runs.batch()
    steps = []
    for sizes, fields in config["plans"]:
        plan = meshc.Plan(trace="non-strict", **fields)
        steps.append(cost_runs.compiled_step(sizes, plan, x, y, timeout_s=300)[2])
    report({"seconds": interleaved_medians(steps, config["rounds"], config["steps"], dist.barrier)})
    dist.barrier()


def _spearman(a: list[float], b: list[float]) -> float:
    rank = lambda xs: {i: r for r, i in enumerate(sorted(range(len(xs)), key=xs.__getitem__))}
    ra, rb = rank(a), rank(b)
    n = len(a)
    return 1 - 6 * sum((ra[i] - rb[i]) ** 2 for i in range(n)) / (n * (n * n - 1)) if n > 1 else 1.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--profile", default=None, help="a calibrated profile to use instead of calibrating now")
    p.add_argument("--worker", default=None)
    args = p.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    import meshc
    from meshc import calibrate
    from meshc.compiler.cost.hardware import load
    from meshc.compiler.planner.search import Search
    from meshc.compiler.planner.compiled import plan_compiled
    from tests.compiler import cost_runs

    if args.profile:
        hw = load(args.profile)
    else:
        path = os.path.join("meshc-out", "bench", "cpu-gloo.json")
        hw = calibrate.calibrate(path, nproc=2)
        print(f"calibrated: {path}")
    x, _ = cost_runs.batch()
    # fusion off, as in tests/compiler/cost_runs.SEARCH: on CPU the fused kernels' torch references cost more
    # than the one fused op the cost model charges (a GPU's Triton kernel)
    search = Search(microbatches=(1, 2, 4), base=meshc.Plan(trace="non-strict", fusion=False))
    t0 = time.perf_counter()
    result = plan_compiled(cost_runs.model, lambda dp: (x[: x.shape[0] // dp],), 2, hw, search=search)
    print(f"planner: {len(result.ranked)} plans scored in {time.perf_counter() - t0:.1f} s")
    plans = [(r.candidate.sizes, {f: getattr(r.candidate.plan, f) for f in FIELDS}) for r in result.ranked]
    measured = launch(os.path.abspath(__file__), 2, {"plans": plans, "rounds": args.rounds, "steps": args.steps},
                      timeout=3600)["seconds"]
    predicted = [r.estimate.step_time for r in result.ranked]
    order = sorted(range(len(measured)), key=measured.__getitem__)
    rows = [{"planner rank": r.rank, "measured rank": order.index(i) + 1, "plan": r.candidate.describe(),
             "predicted (ms)": predicted[i] * 1e3, "measured (ms)": measured[i] * 1e3,
             "predicted / measured": predicted[i] / measured[i]} for i, r in enumerate(result.ranked)]
    print(table(rows, ["planner rank", "measured rank", "plan", "predicted (ms)", "measured (ms)",
                       "predicted / measured"]))
    chosen = measured[0]
    print(f"\nSpearman rank correlation predicted vs measured: {_spearman(predicted, measured):.2f}")
    print(f"planner's choice: {result.ranked[0].candidate.describe()}, measured {chosen * 1e3:.1f} ms, rank "
          f"{order.index(0) + 1} of {len(measured)}; fastest measured {min(measured) * 1e3:.1f} ms "
          f"({result.ranked[order[0]].candidate.describe()}), choice / fastest = {chosen / min(measured):.3f}")
    errors = [abs(a / b - 1) for a, b in zip(predicted, measured)]
    print(f"step-time error: median {statistics.median(errors):.0%}, worst {max(errors):.0%}")


if __name__ == "__main__":
    main()
