"""Resident memory of a ZeRO-3 run under meshc's default allocator settings, with `meshc.mesh(host_malloc=True)`
(runtime/host_malloc.py: large blocks kept on the heap) and under FSDP2, in one run, with glibc's own defaults
(no MALLOC_* variables: what a user's process has).

    python benchmarks/host_memory.py [--nproc 4] [--layers 8] [--steps 4]

Model: meshc's built-in GPT at gpt2-medium's width (dim 1024, 16 heads, GPT-2's vocabulary) with `--layers`
blocks (8: 152M parameters, 610 MB in fp32), built on the meta device and initialized sharded; ZeRO-3 (FSDP2:
fully_shard per block and root), AdamW, one sequence of 128 tokens per rank per step, gloo, one thread per rank.
Per rank, minus the RSS before the model is built: peak (VmHWM at the end), steady (RSS after the last step,
model and optimizer alive); and the median step time of the steps after the first.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import arg_parser, launch, report, rss_mib, run_worker, table  # noqa: E402
from meta_memory import _batch, _build, _loss, fsdp2_model  # noqa: E402


def _meshc_step(cfg: dict):
    import torch

    import meshc

    mesh = meshc.mesh(host_malloc=True) if cfg["host_malloc"] else meshc.mesh()
    x, y = _batch(50257, mesh.rank)
    job = meshc.compile(_build(cfg["layers"], meta=True), mesh, example_inputs=(x,),
                        plan=meshc.Plan(zero=3, trace="non-strict"))
    job.init_weights(seed=0)
    opt = job.optimizer(torch.optim.AdamW, lr=1e-4)

    def step():
        job.step(x, y, _loss)
        opt.step()
        opt.zero_grad()
    return step, mesh.rank


def _fsdp2_step(cfg: dict):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = fsdp2_model(cfg["layers"])
    x, y = _batch(50257, dist.get_rank())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        _loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return step, dist.get_rank()


def worker(cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    base = rss_mib()
    step, _rank = (_fsdp2_step if cfg["impl"] == "fsdp2" else _meshc_step)(cfg)
    times = []
    for _ in range(cfg["steps"]):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    mine = {"peak": rss_mib("VmHWM") - base, "steady": rss_mib() - base}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    report({"ranks": everyone, "step_s": statistics.median(times[1:] or times)})
    dist.destroy_process_group()


def main() -> None:
    p = arg_parser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    if run_worker(args, worker):
        return
    script = os.path.abspath(__file__)
    rows = []
    for name, cfg in [("meshc ZeRO-3 (default)", {"impl": "meshc", "host_malloc": False}),
                      ("meshc ZeRO-3, host_malloc=True", {"impl": "meshc", "host_malloc": True}),
                      ("FSDP2", {"impl": "fsdp2"})]:
        out = launch(script, args.nproc, {**cfg, "layers": args.layers, "steps": args.steps}, timeout=1800)
        peaks, steadies = [r["peak"] for r in out["ranks"]], [r["steady"] for r in out["ranks"]]
        rows.append({"run": name, "peak RSS MiB per rank": f"{min(peaks):,.0f}-{max(peaks):,.0f}",
                     "steady RSS MiB per rank": f"{min(steadies):,.0f}-{max(steadies):,.0f}",
                     "step (s)": out["step_s"], "max peak": max(peaks)})
        print(name, out, flush=True)
    fsdp = next(r["max peak"] for r in rows if r["run"] == "FSDP2")
    for r in rows:
        r["peak vs FSDP2"] = r["max peak"] / fsdp
    print()
    print(table(rows, ["run", "peak RSS MiB per rank", "peak vs FSDP2", "steady RSS MiB per rank", "step (s)"]))


if __name__ == "__main__":
    main()
