"""`meshc explain`: compile one rank of a built-in model on a mesh, in this process, and print the plan.

No processes are launched and no memory is spent on weights: the mesh runs on torch's fake process
group and the model is built from fake tensors, so a plan for many ranks can be read on a laptop.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import meshc
from meshc import models
from meshc.compiler import _torch_compat as compat
from meshc.compiler.show import format_graph
from meshc.runtime.mesh import parse_sizes, simulated_mesh


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt2-small", help=f"built-in model: {', '.join(models.CONFIGS)}")
    p.add_argument("--mesh", default="dp=2", help="mesh sizes such as dp=2,tp=2 (default dp=2)")
    p.add_argument("--rank", type=int, default=0, help="which rank's program to show (default 0)")
    p.add_argument("--batch", type=int, default=8, help="global batch, in sequences")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--graph", action="store_true", help="also print the rank's transformed graph")


def run(args: argparse.Namespace) -> int:
    sizes = parse_sizes(args.mesh)
    world = sizes.get("dp", 1) * sizes.get("tp", 1) * sizes.get("pp", 1)
    if not 0 <= args.rank < world:
        raise ValueError(f"explain: expected --rank in [0, {world}), got {args.rank}")
    dp = sizes.get("dp", 1)
    if args.batch % dp:
        raise ValueError(f"explain: expected --batch divisible by dp={dp}, got {args.batch}")
    mesh = simulated_mesh(rank=args.rank, **sizes)
    try:
        with compat.fake_tensor_mode():
            seq = args.seq or models.CONFIGS[args.model].seq_len if args.model in models.CONFIGS else args.seq
            model = models.build(args.model, **({"seq_len": seq} if seq else {}))
            tokens = torch.zeros(args.batch // dp, model.cfg.seq_len, dtype=torch.long)
            job = meshc.compile(model, mesh, example_inputs=(tokens,))
        print(job.explain())
        if args.graph:
            print("\n" + format_graph(job.graph(), job.program))
    finally:
        dist.destroy_process_group()
    return 0
