"""Checkpoints: meshc's sharded save and resharding load side by side with torch.distributed.checkpoint over
FSDP2 (`fully_shard` + `get_state_dict`) on the same model and ranks, in one run.

    python benchmarks/checkpoint_bench.py [--nproc 4]
    python benchmarks/checkpoint_bench.py --async-save [--nproc 4]   # job.save(async_=True): the time a step is held

Model: torch's reference Transformer (4 layers, dim 256, vocab 1024, tied head; 3.4M parameters) after one
AdamW step, fp32: parameters + exp_avg + exp_avg_sq = 3 x 13.1 MiB. Each row saves under one plan and loads
under another (a fresh job built from other weights), on 4 ranks over gloo, files on local disk. Seconds are
the slowest rank's; "largest file" shows how evenly the ranks share the writing; "bitwise" compares the
loaded job's whole parameters and optimizer states with the saving job's.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import launch, lm_loss, reference_transformer, report, table  # noqa: E402
from tp_bench import DIM, HEADS, LAYERS, SEQ, VOCAB, _data  # noqa: E402

ROWS = [  # (name, save mesh, save plan, load mesh, load plan)
    ("dp2xtp2 -> same", {"dp": 2, "tp": 2}, {}, {"dp": 2, "tp": 2}, {}),
    ("dp2xtp2 -> dp4 ZeRO-3", {"dp": 2, "tp": 2}, {}, {"dp": 4}, {"zero": 3}),
    ("dp2xtp2 -> tp4", {"dp": 2, "tp": 2}, {}, {"tp": 4}, {}),
    ("dp2xtp2 -> pp2xdp2", {"dp": 2, "tp": 2}, {}, {"pp": 2, "dp": 2}, {"microbatches": 2}),
    ("dp4 ZeRO-3 -> dp2xtp2", {"dp": 4}, {"zero": 3}, {"dp": 2, "tp": 2}, {}),
]
ASYNC_ROUNDS = 5  # --async-save: saves of each kind, alternating


def _model(seed: int):
    return reference_transformer(LAYERS, DIM, HEADS, VOCAB, SEQ, seed=seed)


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _meshc_worker(cfg: dict) -> dict:
    import torch

    import meshc
    from meshc.runtime.checkpoint.save_load import full_optimizer_state

    folder = cfg["folder"]
    x, y = _data()
    out = {}
    for role, seed in (("save", 0), ("load", 1)):
        mesh = meshc.mesh(timeout_s=300, **cfg[f"{role}_mesh"])
        job = meshc.compile(_model(seed), mesh, example_inputs=(mesh.shard_batch(x),),
                            plan=meshc.Plan(trace="non-strict", **cfg[f"{role}_plan"]))
        opt = job.optimizer(torch.optim.AdamW, lr=1e-3)
        if role == "save":
            job.step(mesh.shard_batch(x), mesh.shard_batch(y), lm_loss)
            opt.step()
            t0 = time.perf_counter()
            job.save(folder, step=1)
            out["save_s"] = _slowest(time.perf_counter() - t0)
        else:
            t0 = time.perf_counter()
            job.load(folder)
            out["load_s"] = _slowest(time.perf_counter() - t0)
        state = ({k: v.clone() for k, v in job.state_dict().items()}, full_optimizer_state(job, opt))
        out[role] = state
    params_equal = all(torch.equal(out["load"][0][k], v) for k, v in out["save"][0].items())
    states_equal = all(torch.equal(out["load"][1][f][n], v) for f, st in out["save"][1].items() for n, v in st.items()
                       if isinstance(v, torch.Tensor))
    return {"save_s": out["save_s"], "load_s": out["load_s"], "bitwise": params_equal and states_equal,
            **_sizes(folder)}


def _async_worker(cfg: dict) -> dict:
    """A synchronous save against an async one of the same state (dp2 x tp2), ROUNDS times each, alternating: the
    seconds the caller is held (slowest rank, median), and the async save's background write (median)."""
    import statistics

    import torch

    import meshc

    x, y = _data()
    mesh = meshc.mesh(timeout_s=300, dp=2, tp=cfg["nproc"] // 2)
    job = meshc.compile(_model(0), mesh, example_inputs=(mesh.shard_batch(x),),
                        plan=meshc.Plan(trace="non-strict"))
    opt = job.optimizer(torch.optim.AdamW, lr=1e-3)
    job.step(mesh.shard_batch(x), mesh.shard_batch(y), lm_loss)
    opt.step()
    sync, blocked, written = [], [], []
    for i in range(ASYNC_ROUNDS):
        t0 = time.perf_counter()
        job.save(os.path.join(cfg["folder"], f"sync_{i}"), step=i)
        sync.append(_slowest(time.perf_counter() - t0))
        handle = job.save(os.path.join(cfg["folder"], f"async_{i}"), step=i, async_=True)
        blocked.append(_slowest(handle.blocked_s))
        handle.wait()
        written.append(_slowest(handle.write_s))
    return {"sync_save_s": statistics.median(sync), "async_blocked_s": statistics.median(blocked),
            "async_write_s": statistics.median(written), "staged_mib": handle.staged_bytes / 2**20}


def _fsdp_worker(cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    x, y = _data()
    n, rank = dist.get_world_size(), dist.get_rank()
    xs, ys = x.chunk(n)[rank], y.chunk(n)[rank]
    out = {}
    for role, seed in (("save", 0), ("load", 1)):
        model = _model(seed)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        lm_loss(model(xs), ys).backward()
        opt.step()  # states exist on both sides: DCP loads into existing tensors
        msd, osd = get_state_dict(model, opt)
        t0 = time.perf_counter()
        if role == "save":
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=cfg["folder"])
        else:
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=cfg["folder"])
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        out[f"{role}_s"] = _slowest(time.perf_counter() - t0)
    return {**out, **_sizes(cfg["folder"]), "bitwise": "n/a"}


def _sizes(folder: str) -> dict:
    """MiB of the whole checkpoint, and of the largest rank's data file."""
    files = {n: os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)}
    data = [s for n, s in files.items() if n.endswith(".distcp")]
    return {"mib": sum(files.values()) / 2**20, "largest_mib": max(data) / 2**20}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--worker", default=None)
    p.add_argument("--async-save", action="store_true", help="time job.save(async_=True) against a synchronous save")
    args = p.parse_args()
    if args.worker:
        import torch

        torch.set_num_threads(1)
        cfg = json.loads(args.worker)
        workers = {"fsdp": _fsdp_worker, "meshc": _meshc_worker, "async": _async_worker}
        report(workers[cfg["kind"]](cfg))
        return
    if args.async_save:
        with tempfile.TemporaryDirectory() as tmp:
            result = launch(__file__, args.nproc, {"kind": "async", "folder": tmp, "nproc": args.nproc})
        print(table([{"run": f"meshc dp2xtp{args.nproc // 2}, median of {ASYNC_ROUNDS}", **result}],
                    ["run", "sync_save_s", "async_blocked_s", "async_write_s", "staged_mib"]))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "ckpt")
        result = launch(__file__, args.nproc, {"kind": "fsdp", "folder": folder})
        rows.append({"run": f"FSDP2 + DCP, dp{args.nproc} -> same", **result})
        for name, save_mesh, save_plan, load_mesh, load_plan in ROWS:
            shutil.rmtree(folder, ignore_errors=True)
            config = {"kind": "meshc", "folder": folder, "save_mesh": save_mesh, "save_plan": save_plan,
                      "load_mesh": load_mesh, "load_plan": load_plan}
            result = launch(__file__, args.nproc, config)
            rows.append({"run": f"meshc {name}", **result})
    print(table(rows, ["run", "save_s", "load_s", "mib", "largest_mib", "bitwise"]))


if __name__ == "__main__":
    main()
