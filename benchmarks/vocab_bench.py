"""Vocabulary parallelism on and off at tp=2, side by side, against what the cost model predicted for each
vocabulary (compiler/cost/vocab.py: the time it saves and the time it adds), in one run.

    python benchmarks/vocab_bench.py [--vocabs 1024,4096,16384] [--steps 10]

Model: meshc's built-in GPT (tied head, 2 blocks, width 64, 4 heads), batch 8 x 64 tokens (global), fp32, AdamW,
job.step with the loss in the step (vocabulary-parallel where on); 2 gloo ranks, one thread each. For each
vocabulary: the median step with vocab_parallel=False and True, the measured difference, and the decision the
default (None) takes on this machine's profile with its predicted saving and cost.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import arg_parser, interleaved_medians, launch, lm_loss, report, run_worker, table, token_batch  # noqa: E402

BATCH, SEQ, DIM, LAYERS = 8, 64, 64, 2


def worker(config: dict) -> None:
    import torch
    import torch.distributed as dist

    import meshc
    from meshc import models

    torch.set_num_threads(1)
    mesh = meshc.mesh(tp=2, timeout_s=300)
    vocab = config["vocab"]
    x, y = token_batch(BATCH, SEQ, vocab)
    steps, decision = [], None
    for vp in (False, True, None):
        torch.manual_seed(0)
        model = models.build("gpt-tiny", vocab_size=vocab, seq_len=SEQ, layers=LAYERS, dim=DIM, heads=4)
        job = meshc.compile(model, mesh, example_inputs=(x,), plan=meshc.Plan(trace="non-strict", vocab_parallel=vp))
        if vp is None:
            d = job.program.decisions["vocab_parallel"]
            decision = (bool(d.value), d.why)
            break
        opt = job.optimizer(torch.optim.AdamW, lr=1e-3)

        def step(job=job, opt=opt):
            job.step(x, y, lm_loss)
            opt.step()
            opt.zero_grad()
        steps.append(step)
    off, on = interleaved_medians(steps, rounds=config["rounds"], per_round=config["per_round"], barrier=dist.barrier)
    report({"off": off, "on": on, "decision": decision})


def main() -> None:
    p = arg_parser(description=__doc__.splitlines()[0])
    p.add_argument("--vocabs", default="1024,4096,16384")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--per-round", type=int, default=3)
    args = p.parse_args()
    if run_worker(args, worker):
        return
    rows = []
    for vocab in (int(v) for v in args.vocabs.split(",")):
        out = launch(os.path.abspath(__file__), 2, {"vocab": vocab, "rounds": args.rounds,
                                                     "per_round": args.per_round})
        on, why = out["decision"]
        rows.append({"vocabulary": vocab, "replicated ms": out["off"] * 1e3, "vocab-parallel ms": out["on"] * 1e3,
                     "on / off": out["on"] / out["off"], "default": "on" if on else "off", "predicted": why})
        print(vocab, out, flush=True)
    print()
    print(table(rows, ["vocabulary", "replicated ms", "vocab-parallel ms", "on / off", "default", "predicted"]))


if __name__ == "__main__":
    main()
