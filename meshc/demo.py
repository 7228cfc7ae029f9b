"""`meshc demo`: train a small GPT on the sonnets shipped with meshc, over N local CPU processes.

Launched from a plain shell it starts torchrun itself (N processes on this machine, gloo on
127.0.0.1); under torchrun it is one rank. Rank 0 prints the plan, then a progress bar with step, loss
and tokens/s; every rank writes its transformed graph into the output folder.

Checkpoints: every `--save-every` steps and at the end, into `--ckpt-dir` (default OUT/ckpt) as
step_NNNNNN folders written by job.save (model, AdamW states, RNG states, step, data position). A fresh
run removes the step_* checkpoints an earlier run left there. `--resume` continues from the newest
complete checkpoint up to `--steps` in all, with the same losses an uninterrupted run has; with no
checkpoint to resume from, or one saved with another model, batch, sequence length or lr, it refuses
(exit status 2) and says why. Rank 0 writes OUT/losses.txt, `step<TAB>loss` for every step of the curve
(a resumed run keeps the lines up to its checkpoint's step and appends its own).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import re
import shutil
import subprocess
import sys
import time
from importlib import resources

import torch

import meshc
from meshc import models
from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.show import format_graph
from meshc.compiler.ir.mesh_spec import parse_sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=2, help="processes to launch when not under torchrun (default 2)")
    p.add_argument("--mesh", default="", help="mesh sizes such as dp=2 (default: every rank on dp)")
    p.add_argument("--model", default="gpt-tiny", help=f"built-in model: {', '.join(models.CONFIGS)}")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step over all dp ranks)")
    p.add_argument("--seq", type=int, default=64, help="sequence length in characters")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--init", choices=("cpu", "meta"), default="cpu",
                   help="cpu: every rank builds the whole model, then shards it; meta: the model is built on the meta "
                        "device and each rank initializes only its shards (job.init_weights), for models bigger than "
                        "one process")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage over dp (default 0)")
    p.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    p.add_argument("--dim", type=int, default=None, help="override the model's width")
    p.add_argument("--out", default="meshc-out/demo", help="folder for the transformed graphs")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any collective may wait")
    p.add_argument("--save-every", type=int, default=100,
                   help="save a checkpoint every N steps, and always at the end (0: only at the end)")
    p.add_argument("--ckpt-dir", default=None, help="folder for the checkpoints (default: OUT/ckpt)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --ckpt-dir up to --steps in all")
    p.add_argument("--trace", action="store_true",
                   help="record every step on every rank into OUT/trace.json (Chrome trace; use a few --steps)")


# what a checkpoint must agree on with the command that resumes it (the model and the data it reads)
_SAME = ("model", "layers", "dim", "batch", "seq", "lr")


def run(args: argparse.Namespace) -> int:
    args.ckpt_dir = os.path.abspath(args.ckpt_dir or os.path.join(args.out, "ckpt"))
    resume = _resume_point(args) if args.resume else None  # refused here, before any process starts
    if "RANK" not in os.environ and args.nproc > 1:
        return _launch(args)
    mesh = meshc.mesh(timeout_s=args.timeout, **parse_sizes(args.mesh))
    lead = mesh.rank == 0
    if resume is None and lead:
        _clear_old_checkpoints(args.ckpt_dir)
    text = resources.files("meshc").joinpath("data/sonnets.txt").read_text(encoding="utf-8")
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    overrides = {k: v for k, v in (("layers", args.layers), ("dim", args.dim)) if v is not None}
    torch.manual_seed(0)  # every rank builds the same weights
    with torch.device("meta") if args.init == "meta" else contextlib.nullcontext():
        model = models.build(args.model, vocab_size=len(chars), seq_len=args.seq, **overrides)
    start = resume[1] if resume else 0
    batches = _batches(data, args.batch, args.seq, seed=1234, skip=start)  # the data position: batches drawn
    x, y = next(batches)
    t0 = time.perf_counter()
    job = meshc.compile(model, mesh, example_inputs=(mesh.shard_batch(x),), plan=meshc.Plan(zero=args.zero))
    if args.init == "meta" and not resume:
        job.init_weights(seed=0)  # each rank its own shards, one whole tensor at a time
    compile_s = time.perf_counter() - t0
    folder = _write_graphs(job, mesh, args.out)
    if lead:
        n = sum(p.numel() for p in model.parameters())
        print(f"meshc demo: {args.model} ({n / 1e6:.2f}M parameters, {len(chars)}-character vocabulary) on "
              f"{mesh.describe()}, compiled in {compile_s:.1f} s\n")
        print(job.explain(), "\n", flush=True)
    opt = job.optimizer(torch.optim.AdamW, lr=args.lr)
    if resume:
        loaded, _ = job.load(resume[0])  # parameters, AdamW states, RNG states: as they were after that step
        assert loaded == start, (loaded, start)
        if lead:
            print(f"resumed from step {start} (checkpoint {resume[0]}); training steps {start + 1}..{args.steps}\n",
                  flush=True)
    log = _loss_log(args.out, start) if lead else None
    config = {k: getattr(args, k) for k in _SAME}
    bar = _Progress(args.steps, enabled=lead, start=start)
    tokens = args.batch * args.seq
    losses = []
    saved = None
    traced = contextlib.ExitStack()  # job.trace on every rank when --trace; rank 0 writes the file at its close
    if args.trace:
        traced.enter_context(job.trace(os.path.join(os.path.abspath(args.out), "trace.json")))
    for step in range(start + 1, args.steps + 1):
        t = time.perf_counter()
        loss = job.step(mesh.shard_batch(x), mesh.shard_batch(y), models.lm_loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        bar.update(step, losses[-1], tokens / (time.perf_counter() - t))
        if log is not None:
            log.write(f"{step}\t{losses[-1]!r}\n")
            log.flush()
        x, y = next(batches)
        if step == args.steps or (args.save_every > 0 and step % args.save_every == 0):
            bar.pause()
            t = time.perf_counter()
            saved = job.save(os.path.join(args.ckpt_dir, f"step_{step:06d}"), step=step,
                             extra={"data_position": step, "config": config})
            bar.note(f"saved checkpoint {saved} (step {step}, {time.perf_counter() - t:.1f} s)")
    traced.close()
    if lead:
        bar.close()
        log.close()
        if args.trace:
            print(f"trace of every step in {os.path.join(os.path.abspath(args.out), 'trace.json')} (open it in "
                  "ui.perfetto.dev or chrome://tracing)", flush=True)
        trace = os.path.join(os.path.abspath(args.out), "trace.json") if args.trace else None
        print(f"plan report in {job.report(os.path.join(os.path.abspath(args.out), 'plan.html'), trace=trace)}",
              flush=True)
        if losses:
            k = max(1, len(losses) // 10)  # single batches are noisy: compare the first and last tenths
            first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
            print(f"mean loss of the first {k} steps {first:.3f} -> of the last {k} steps {last:.3f}; "
                  f"transformed graphs in {folder}/", flush=True)
        else:
            print(f"nothing to train: the checkpoint is at step {start}, --steps is {args.steps}", flush=True)
        print(f"losses in {os.path.abspath(os.path.join(args.out, 'losses.txt'))}; "
              + (f"last checkpoint {saved} (resume with --resume)" if saved else "no checkpoint saved"), flush=True)
    del job, opt  # nothing that holds tensors or hooks of the step outlives the groups it used
    gc.collect()
    mesh.close()  # every rank: heartbeat stopped, process groups destroyed, before the interpreter exits
    return 0


def _resume_point(args: argparse.Namespace) -> tuple[str, int]:
    """(folder, step) of the newest complete checkpoint in --ckpt-dir; a ValueError (exit status 2) if there
    is none or it was saved for another model or data."""
    from meshc.runtime.checkpoint.save_load import latest
    from meshc.runtime.checkpoint.format import MANIFEST, read_json

    folder = latest(args.ckpt_dir)
    if folder is None:
        raise MeshcValueError(f"--resume: expected a complete checkpoint in {os.path.abspath(args.ckpt_dir)}, got "
                              "none; run without --resume to start fresh (or pass the --ckpt-dir/--out of the earlier "
                              "run)")
    manifest = read_json(os.path.join(folder, MANIFEST))
    saved = manifest.get("extra", {}).get("config", {})
    diff = [f"--{k} {saved.get(k)} (now {getattr(args, k)})" for k in _SAME if saved.get(k) != getattr(args, k)]
    if diff:
        raise MeshcValueError(f"--resume: {folder} was saved with {', '.join(diff)}; resume with the same options")
    return folder, int(manifest["step"])


def _clear_old_checkpoints(ckpt_dir: str) -> None:
    """A fresh run starts a new series: the step_* checkpoints of an earlier run would be taken by --resume."""
    if not os.path.isdir(ckpt_dir):
        return
    old = [n for n in os.listdir(ckpt_dir) if re.fullmatch(r"step_\d+(\.partial|\.old)?", n)]
    for name in old:
        shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)
    if old:
        print(f"meshc demo: fresh run: removed {len(old)} checkpoint folder(s) of an earlier run from "
              f"{os.path.abspath(ckpt_dir)}", flush=True)


def _loss_log(out: str, start: int):
    """OUT/losses.txt for appending, holding the earlier run's lines up to `start` (none on a fresh run)."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "losses.txt")
    kept = []
    if start and os.path.isfile(path):
        with open(path) as f:
            kept = [line for line in f if line.strip() and int(line.split("\t")[0]) <= start]
    f = open(path, "w")
    f.writelines(kept)
    return f


def _batches(data: torch.Tensor, batch: int, seq: int, seed: int, skip: int = 0):
    """Random windows of the text, the same global batch on every rank (each then takes its dp slice);
    `skip` batches are drawn and dropped first (the data position of a resumed run)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(skip):
        torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
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

    def __init__(self, total: int, enabled: bool, start: int = 0):
        self.total, self.enabled, self.start = total, enabled, start
        self.tty = sys.stdout.isatty()
        self.every = max(1, total // 20)
        self.rates: list[float] = []
        self.open = False  # a line in place on the terminal

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
            self.open = True
        elif step % self.every == 0 or step in (1, self.start + 1, self.total):
            print(line, flush=True)

    def pause(self) -> None:
        """End the line in place (before a message, or a save's warnings)."""
        if self.enabled and self.open:
            print(flush=True)
            self.open = False

    def note(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def close(self) -> None:
        self.pause()


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
        if key in ("command", "nproc") or value is None or value is False:  # torchrun would take --nproc
            continue
        flag = "--" + key.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out
