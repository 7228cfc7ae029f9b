"""`meshc demo`: train a small GPT on the sonnets shipped with meshc, over N local CPU processes.

Launched from a plain shell it starts torchrun itself (N processes on this machine, gloo on
127.0.0.1); under torchrun it is one rank. Rank 0 prints the plan, then a progress bar with step, loss
and tokens/s; every rank writes its transformed graph into the output folder.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from importlib import resources

import torch

import meshc
from meshc import models
from meshc.compiler.show import format_graph
from meshc.runtime.mesh import parse_sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=2, help="processes to launch when not under torchrun (default 2)")
    p.add_argument("--mesh", default="", help="mesh sizes such as dp=2 (default: every rank on dp)")
    p.add_argument("--model", default="gpt-tiny", help=f"built-in model: {', '.join(models.CONFIGS)}")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step over all dp ranks)")
    p.add_argument("--seq", type=int, default=64, help="sequence length in characters")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    p.add_argument("--dim", type=int, default=None, help="override the model's width")
    p.add_argument("--out", default="meshc-out/demo", help="folder for the transformed graphs")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any collective may wait")


def run(args: argparse.Namespace) -> int:
    if "RANK" not in os.environ and args.nproc > 1:
        return _launch(args)
    mesh = meshc.mesh(timeout_s=args.timeout, **parse_sizes(args.mesh))
    lead = mesh.rank == 0
    text = resources.files("meshc").joinpath("data/sonnets.txt").read_text(encoding="utf-8")
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    overrides = {k: v for k, v in (("layers", args.layers), ("dim", args.dim)) if v is not None}
    torch.manual_seed(0)  # every rank builds the same weights
    model = models.build(args.model, vocab_size=len(chars), seq_len=args.seq, **overrides)
    batches = _batches(data, args.batch, args.seq, seed=1234)
    x, y = next(batches)
    t0 = time.perf_counter()
    job = meshc.compile(model, mesh, example_inputs=(mesh.shard_batch(x),))
    compile_s = time.perf_counter() - t0
    folder = _write_graphs(job, mesh, args.out)
    if lead:
        n = sum(p.numel() for p in model.parameters())
        print(f"meshc demo: {args.model} ({n / 1e6:.2f}M parameters, {len(chars)}-character vocabulary) on "
              f"{mesh.describe()}, compiled in {compile_s:.1f} s\n")
        print(job.explain(), "\n", flush=True)
    opt = job.optimizer(torch.optim.AdamW, lr=args.lr)
    bar = _Progress(args.steps, enabled=lead)
    tokens = args.batch * args.seq
    losses = []
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        loss = job.step(mesh.shard_batch(x), mesh.shard_batch(y), models.lm_loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        bar.update(step, losses[-1], tokens / (time.perf_counter() - t))
        x, y = next(batches)
    if lead:
        bar.close()
        k = max(1, args.steps // 10)  # single batches are noisy: compare the first and last tenths
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        print(f"mean loss of the first {k} steps {first:.3f} -> of the last {k} steps {last:.3f}; "
              f"transformed graphs in {folder}/", flush=True)
    return 0


def _batches(data: torch.Tensor, batch: int, seq: int, seed: int):
    """Random windows of the text, the same global batch on every rank (each then takes its dp slice)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        window = torch.stack([data[s: s + seq + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def _write_graphs(job, mesh, out: str) -> str:
    folder = os.path.abspath(os.path.join(out, "graphs"))
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, f"rank{mesh.rank}_stage0")
    with open(base + ".txt", "w") as f:
        f.write(format_graph(job.graph(), job.program))
    with open(base + ".py", "w") as f:
        f.write(job.graph().code)
    return folder


class _Progress:
    """`step 40/300 [######--------------] loss 2.871  12,345 tok/s`, in place on a terminal."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.tty = sys.stdout.isatty()
        self.every = max(1, total // 20)
        self.rates: list[float] = []

    def update(self, step: int, loss: float, rate: float) -> None:
        if not self.enabled:
            return
        self.rates = (self.rates + [rate])[-20:]
        width = 24
        done = width * step // self.total
        line = (f"step {step:>{len(str(self.total))}}/{self.total} [{'#' * done}{'-' * (width - done)}] "
                f"loss {loss:.3f}  {sorted(self.rates)[len(self.rates) // 2]:,.0f} tok/s")
        if self.tty:
            print("\r" + line, end="", flush=True)
        elif step % self.every == 0 or step in (1, self.total):
            print(line, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            print()


def _launch(args: argparse.Namespace) -> int:
    """Run this same command under torchrun with `--nproc` local processes."""
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo on loopback
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "meshc", "demo", *_forward(args)]
    return subprocess.call(cmd, env=env)


def _forward(args: argparse.Namespace) -> list[str]:
    out = []
    for key, value in vars(args).items():
        if key in ("command", "nproc") or value is None:  # torchrun would take --nproc as its own
            continue
        out += [f"--{key}", str(value)]
    return out
