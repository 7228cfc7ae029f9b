"""A world-1 training step on this machine: meshc's per-rank program as FX code and compiled by Inductor, against
the user's own eager loop and torch.compile, in one run.

    python benchmarks/compiled_step.py [--rounds 4] [--per-round 3] [--threads 1] [--out docs/compiled_step.md]

Model: a transformers Qwen2ForCausalLM with random weights (4 layers, hidden 256, 8 heads, 2 kv heads, MLP 512,
vocab 1024), batch 8 x 128 tokens, mean cross-entropy, AdamW (lr 1e-3, torch's default implementation), fp32,
`--threads` intra-op threads, one process (meshc.mesh() without torchrun: a world of one). Rows:
  eager            the model called in a plain loop: forward, loss, backward, opt.step(), opt.zero_grad()
  torch.compile    the same loop around torch.compile(model) (Inductor); the optimizer stays eager
  meshc FX         meshc.compile(model, mesh, plan=Plan(inductor=False)), job.step + the same optimizer
  meshc Inductor   the same with Plan(inductor=True): the per-rank program lowered by Inductor, forward and backward
  ... ZeRO-1       the two meshc rows again with Plan(zero=1) (fp32 masters sharded over dp = 1)
  ... ZeRO-3       and with Plan(zero=3) (parameters as flat shards over dp = 1, gathered per bucket: as FX code through
                   the runtime's saved-tensor hooks, compiled as graph nodes recomputed in backward)
Every row starts from the same weights and trains on the same batch. Times: the first step (tracing and
compiling included), then the median step of `--rounds` interleaved rounds, each running every row once
untimed then `--per-round` timed steps (a shared machine's load drifts: rows measured close together see the
same). Ratios: meshc FX / eager and meshc Inductor / torch.compile (goal <= 1.0 each).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import interleaved_times, table  # noqa: E402


def build_model():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128, use_cache=False,
                         attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return Qwen2ForCausalLM(config).eval().train()


def loss_fn(out, y):
    import torch.nn.functional as F

    logits = out.logits if hasattr(out, "logits") else out[0]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def eager_step(model, x, y, compiled: bool):
    import torch

    forward = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        loss = loss_fn(forward(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step, None


def meshc_step(model, x, y, mesh, **plan):
    import torch

    import meshc

    job = meshc.compile(model, mesh, example_inputs=(x,), plan=meshc.Plan(trace="non-strict", **plan))
    opt = job.optimizer(torch.optim.AdamW, lr=1e-3)

    def step():
        loss = job.step(x, y, loss_fn)
        opt.step()
        opt.zero_grad()
        return loss
    return step, job


ROWS = [("eager", {"eager": False}), ("torch.compile", {"eager": True}),
        ("meshc FX", {"inductor": False}), ("meshc Inductor", {"inductor": True}),
        ("meshc ZeRO-1 FX", {"inductor": False, "zero": 1}), ("meshc ZeRO-1 Inductor", {"inductor": True, "zero": 1}),
        ("meshc ZeRO-3 FX", {"inductor": False, "zero": 3}), ("meshc ZeRO-3 Inductor", {"inductor": True, "zero": 3})]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--per-round", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = p.parse_args(argv)

    import statistics

    import torch

    import meshc

    torch.set_num_threads(args.threads)
    mesh = meshc.mesh()
    base = build_model()
    x = torch.randint(0, 1024, (8, 128), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 1024, (8, 128), generator=torch.Generator().manual_seed(2))
    steps, first, losses, notes = [], {}, {}, {}
    for name, kind in ROWS:
        model = copy.deepcopy(base)
        t0 = time.perf_counter()
        if "eager" in kind:
            step, job = eager_step(model, x, y, kind["eager"])
        else:
            step, job = meshc_step(model, x, y, mesh, **kind)
        losses[name] = [step().item()]
        first[name] = time.perf_counter() - t0
        if job is not None:
            decision = job.program.decisions["inductor"]
            notes[name] = job.inductor.stats.line() if decision.value else f"inductor off ({decision.why[:40]})"
        steps.append(step)
        print(f"{name}: first step {first[name]:.1f} s, loss {losses[name][0]:.4f}", flush=True)
    times = interleaved_times(steps, args.rounds, args.per_round)
    med = {name: statistics.median(t) for (name, _), t in zip(ROWS, times)}
    ratios = {"meshc FX": med["meshc FX"] / med["eager"], "meshc Inductor": med["meshc Inductor"] / med["torch.compile"],
              "meshc ZeRO-1 FX": med["meshc ZeRO-1 FX"] / med["eager"],
              "meshc ZeRO-1 Inductor": med["meshc ZeRO-1 Inductor"] / med["torch.compile"],
              "meshc ZeRO-3 FX": med["meshc ZeRO-3 FX"] / med["eager"],
              "meshc ZeRO-3 Inductor": med["meshc ZeRO-3 Inductor"] / med["torch.compile"]}
    rows = [{"row": name, "first step s": f"{first[name]:.1f}", "median step ms": f"{med[name] * 1e3:.1f}",
             "vs eager": f"{med[name] / med['eager']:.2f}", "vs torch.compile": f"{med[name] / med['torch.compile']:.2f}",
             "first loss": f"{losses[name][0]:.4f}", "note": notes.get(name, "")} for name, _ in ROWS]
    text = (f"compiled_step, {datetime.date.today()}, torch {torch.__version__}, {args.threads} thread(s), "
            f"{args.rounds} rounds x {args.per_round} steps\n\n"
            + table(rows, ["row", "first step s", "median step ms", "vs eager", "vs torch.compile", "first loss", "note"])
            + "\n\nratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()) + "\n")
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
