"""The torch.compile door against meshc.compile and against FSDP2 + torch.compile, in one run: median step
time and compile time (the first step, tracing and lowering included).

    python benchmarks/backend_bench.py [--nproc 2] [--steps 10] [--mesh dp] [--zero 3]

Runs: meshc.compile; torch.compile(model, backend=meshc.backend(mesh, plan)) with the per-rank programs run
eagerly and with Plan(inductor=True); FSDP2 (fully_shard per block) + torch.compile (Inductor), only for
--mesh dp. Model and batch as benchmarks/tp_bench.py (reference Transformer, 4 layers, dim 256), fp32,
AdamW, gloo on loopback, one thread per rank.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import arg_parser, launch, lm_loss, median_step, report, run_worker, table  # noqa: E402
from tp_bench import _data, _model  # noqa: E402


def worker(config: dict) -> None:
    import torch
    import torch.distributed as dist

    import meshc

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    mesh = meshc.mesh(timeout_s=600, **({"tp": world} if config["mesh"] == "tp" else {}))
    x, y = (mesh.shard_batch(t) for t in _data())
    plan = dict(zero=config["zero"]) if config["mesh"] == "dp" else {}
    if config["impl"] == "backend+inductor" and plan.get("zero") == 3:
        plan["zero"] = 0
    impl = config["impl"]
    t0 = time.perf_counter()  # compile time: meshc.compile itself, or the first calls through torch.compile
    if impl == "meshc.compile":
        job = meshc.compile(_model(), mesh, example_inputs=(x,), plan=meshc.Plan(**plan))
        opt = job.optimizer(torch.optim.AdamW, lr=1e-3)

        def step():
            job.step(x, y, lm_loss)
            opt.step()
            opt.zero_grad()
    else:
        model = _model()
        if impl == "fsdp2+inductor":
            from torch.distributed.fsdp import fully_shard

            for layer in model.layers:
                fully_shard(layer, mesh=mesh.device_mesh["dp"])
            fully_shard(model, mesh=mesh.device_mesh["dp"])
            backend = "inductor"
        else:
            backend = meshc.backend(mesh, meshc.Plan(inductor=impl == "backend+inductor", **plan))
            # (Inductor with ZeRO-3 is refused by the backend: the driver runs it with zero=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        compiled = torch.compile(model, backend=backend)

        def step():
            lm_loss(compiled(x), y).backward()
            opt.step()
            opt.zero_grad()
    step()  # compiles (and, through the backend, shards the parameters)
    step()  # the backend's second step retraces the regions over the shards (lowering reused)
    compile_s = time.perf_counter() - t0
    seconds = median_step(step, warmup=1, steps=config["steps"], barrier=dist.barrier)
    report({"impl": impl, "step_s": seconds, "first_two_steps_s": compile_s})
    dist.barrier()


def main() -> None:
    p = arg_parser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--mesh", choices=["dp", "tp"], default="dp")
    p.add_argument("--zero", type=int, default=3, choices=[0, 3])
    p.add_argument("--only", default=None, help="run just this one (e.g. backend+inductor)")
    args = p.parse_args()
    if run_worker(args, worker):
        return
    impls = ["meshc.compile", "backend (eager regions)", "backend+inductor"]  # Inductor: zero=0 (see worker)
    if args.mesh == "dp" and args.zero == 3:
        impls.append("fsdp2+inductor")
    impls = [i for i in impls if args.only in (None, i)]
    rows = []
    for impl in impls:
        result = launch(os.path.abspath(__file__), args.nproc,
                        {"impl": impl, "mesh": args.mesh, "zero": args.zero, "steps": args.steps}, timeout=1800)
        name = f"{impl} (zero=0)" if impl == "backend+inductor" and args.mesh == "dp" and args.zero == 3 else impl
        rows.append({"run": name, "step (s)": result["step_s"], "compile + first two steps (s)": result["first_two_steps_s"]})
        print(impl, json.dumps(result), flush=True)
    base = rows[0]["step (s)"]  # meshc.compile, unless --only
    for r in rows:
        r["vs meshc.compile"] = r["step (s)"] / base
    print()
    print(f"mesh {args.mesh}={args.nproc}" + (f", ZeRO-{args.zero}" if args.mesh == "dp" else ""))
    print(table(rows, ["run", "step (s)", "vs meshc.compile", "compile + first two steps (s)"]))


if __name__ == "__main__":
    main()
