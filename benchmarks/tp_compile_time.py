"""Compile time of GPT-2 (transformers, GPT-2 small widths) with tensor parallelism, against layer count.

    python benchmarks/tp_compile_time.py [--tp 2] [--layers 2 4 8 12 24] [--trace non-strict]

One rank is compiled in this process on torch's fake process group, with fake tensors (no weight
memory): trace (torch.export) and the passes, each timed. Goal: linear in the number of layers.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import table  # noqa: E402


def compile_once(layers: int, tp: int, trace: str) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    import meshc
    from meshc.compiler.ir import torch_compat as compat
    from meshc.runtime.mesh import simulated_mesh

    mesh = simulated_mesh(tp=tp)
    try:
        with compat.fake_tensor_mode():
            model = GPT2LMHeadModel(GPT2Config(n_layer=layers, use_cache=False))
            x = torch.zeros(4, 128, dtype=torch.long)
            t0 = time.perf_counter()
            job = meshc.compile(model, mesh, example_inputs=(x,), plan=meshc.Plan(trace=trace))
            total = time.perf_counter() - t0
        passes = {r.name: r.seconds for r in job.program.pass_log}
        return {"layers": layers, "nodes": len(job.program.gm.graph.nodes), "total (s)": total,
                "passes (s)": sum(passes.values()), "trace (s)": total - sum(passes.values()),
                "tensor_parallel (s)": passes["tensor_parallel"], "plan (s)": passes["plan"]}
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 12, 24])
    p.add_argument("--trace", default="non-strict")
    args = p.parse_args()
    compile_once(1, args.tp, args.trace)  # warm up imports and torch.export's caches
    rows = []
    for layers in args.layers:
        row = compile_once(layers, args.tp, args.trace)
        row["per layer (s)"] = row["total (s)"] / layers
        rows.append(row)
        print(row, flush=True)
    print()
    print(table(rows, ["layers", "nodes", "trace (s)", "plan (s)", "tensor_parallel (s)", "passes (s)", "total (s)",
                       "per layer (s)"]))


if __name__ == "__main__":
    main()
