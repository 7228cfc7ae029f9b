"""Time and memory of a simulated compile (`meshc explain`'s path: one rank of Llama-3-70B's widths under
fake tensors and torch's fake process group) against layer count and rank count.

    python benchmarks/simulate_scale.py [--layers 8,16,32,64,128] [--ranks 8,64,512,1024,4096,8192]

Each point runs in a fresh process (its peak RSS is its own): the model built from its config, traced by
torch.export (non-strict), every pass, the pipeline stages, the report and both estimates. Goal: linear in
layers, flat in ranks. A last table times pipeline_split's per-node FlopCounterMode against the cost
model's shape-only FLOP count (compiler/cost/compiled.node_flops) on the same graph.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import table  # noqa: E402

MESHES = {8: (1, 8, 1), 64: (8, 8, 1), 512: (16, 8, 4), 1024: (32, 8, 4), 4096: (128, 8, 4), 8192: (256, 8, 4)}


def worker(config: dict) -> None:
    import meshc
    from meshc.explain_cli import simulate

    dp, tp, pp = config["mesh"]
    plan = meshc.Plan(trace="non-strict")  # the default passes, fuse_comm included
    sim = simulate("llama-70b", {"dp": dp, "tp": tp, "pp": pp}, rank=dp * tp * pp - 1, seq=4096, plan=plan,
                   layers=config["layers"])
    program = sim.rank_program.program
    trace = next((float(n.split(" in ")[1].split(" s")[0]) for n in program.notes if n.startswith("trace:")), 0.0)
    passes = sum(r.seconds for r in program.pass_log)
    out = {"seconds": sim.seconds, "trace_s": trace, "passes_s": passes, "peak_mib": sim.peak_rss / 2**20,
           "nodes": len(program.gm.graph.nodes)}
    if config.get("flops"):
        out.update(_flop_counting(program))
    print(json.dumps(out))


def _flop_counting(program) -> dict:
    """Seconds to count the forward FLOPs of every activation: FlopCounterMode per node vs shapes only."""
    import time

    from meshc.compiler.cost.compiled import node_flops
    from meshc.passes import pipeline_split

    order = [n for n in program.gm.graph.nodes if n in pipeline_split.activations(program)]
    t0 = time.perf_counter()
    counted = pipeline_split._flops(order)
    t1 = time.perf_counter()
    fast = [node_flops(n) for n in order]
    t2 = time.perf_counter()
    return {"flopcounter_s": t1 - t0, "node_flops_s": t2 - t1, "flopcounter_gflop": sum(counted) / 1e9,
            "node_flops_gflop": sum(fast) / 1e9}


def run(layers: int, ranks: int, flops: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker",
           json.dumps({"layers": layers, "mesh": MESHES[ranks], "flops": flops})]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"layers={layers} ranks={ranks} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", default="8,16,32,64,128")
    p.add_argument("--ranks", default="8,64,512,1024,4096,8192")
    p.add_argument("--worker", default=None)
    args = p.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    columns = ["layers", "ranks", "mesh", "nodes", "total (s)", "trace (s)", "passes (s)", "other (s)", "peak MiB"]
    rows = []
    for layers in map(int, args.layers.split(",")):
        rows.append(_row(layers, 1024, run(layers, 1024, flops=layers == 80)))
        print(json.dumps(rows[-1]), flush=True)
    print("\nagainst layers (1,024 ranks, dp=32 x tp=8 x pp=4, Llama-3-70B widths):\n" + table(rows, columns))
    rows = []
    for ranks in map(int, args.ranks.split(",")):
        rows.append(_row(16, ranks, run(16, ranks)))
        print(json.dumps(rows[-1]), flush=True)
    print("\nagainst ranks (16 layers of Llama-3-70B):\n" + table(rows, columns))
    result = run(80, 1024, flops=True)
    print("\nFLOP counting on the 80-layer graph (pipeline_split's FlopCounterMode per node vs node_flops):")
    print(table([{"FlopCounterMode (s)": result["flopcounter_s"], "node_flops (s)": result["node_flops_s"],
                  "FlopCounterMode GFLOP": result["flopcounter_gflop"], "node_flops GFLOP": result["node_flops_gflop"],
                  "total compile (s)": result["seconds"]}],
                ["FlopCounterMode (s)", "node_flops (s)", "FlopCounterMode GFLOP", "node_flops GFLOP",
                 "total compile (s)"]))


def _row(layers: int, ranks: int, r: dict) -> dict:
    dp, tp, pp = MESHES[ranks]
    return {"layers": layers, "ranks": ranks, "mesh": f"{dp}x{tp}x{pp}", "nodes": r["nodes"], "total (s)": r["seconds"],
            "trace (s)": r["trace_s"], "passes (s)": r["passes_s"],
            "other (s)": r["seconds"] - r["trace_s"] - r["passes_s"], "peak MiB": r["peak_mib"]}


if __name__ == "__main__":
    main()
