"""A small training script that checkpoints every few steps and resumes from the newest checkpoint when one
exists: an elastic run under `torchrun --max-restarts N` with meshc. test_failures launches it under torchrun
and kills one rank once (a marker file remembers that it did); `train` is also run directly by the harness
for the uninterrupted reference.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 elastic_train.py \
        --ckpt DIR --steps 6 --every 2 [--kill-at 5 --marker FILE] --out final.pt
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch


def train(ckpt: str, steps: int, every: int, kill_at: int | None = None,
          marker: str | None = None) -> tuple[dict, int | None]:
    """Train `steps` steps over dp=2 with ZeRO-2, saving every `every`; returns (whole parameters, the step
    it resumed from or None)."""
    import meshc
    from meshc.runtime.checkpoint.save_load import latest
    from tests import zoo

    mesh = meshc.mesh(timeout_s=20, dp=2)
    data = zoo.batches(steps, 8)
    job = meshc.compile(zoo.uneven(), mesh, example_inputs=(mesh.shard_batch(data[0][0]),),
                        plan=meshc.Plan(zero=2, trace="non-strict"))
    opt = job.optimizer(torch.optim.AdamW, lr=1e-2)
    start, resumed = 0, None
    newest = latest(ckpt)
    if newest is not None:
        resumed, extra = job.load(newest)
        start = extra["data_position"]
    for i in range(start, steps):
        x, y = data[i]
        job.step(mesh.shard_batch(x), mesh.shard_batch(y), zoo.lm_loss)
        opt.step()
        opt.zero_grad()
        if (i + 1) % every == 0:
            job.save(os.path.join(ckpt, f"step_{i + 1:05d}"), step=i + 1, extra={"data_position": i + 1})
        if kill_at == i + 1 and mesh.rank == 1 and marker and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9, once
    return {k: v.clone() for k, v in job.state_dict().items()}, resumed


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--marker", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    state, resumed = train(args.ckpt, args.steps, args.every, args.kill_at, args.marker)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(state, args.out)
        with open(args.out + ".json", "w") as f:
            json.dump({"resumed_from": resumed}, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
