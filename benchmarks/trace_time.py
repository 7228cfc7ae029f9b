"""Trace time of GPT-2 small (12 layers, transformers, random weights) through meshc's tracer.

    python benchmarks/trace_time.py [--layers 12]

Prints seconds for strict and non-strict torch.export and the node count; weights are fake tensors,
so nothing but the trace is measured.
"""
from __future__ import annotations

import argparse
import time

import torch

from meshc.compiler.ir import torch_compat as compat


def main() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12)
    args = p.parse_args()
    cfg = GPT2Config(n_layer=args.layers, use_cache=False)
    for strict in (True, False):
        with compat.fake_tensor_mode():
            model = GPT2LMHeadModel(cfg)
            x = torch.zeros(2, 128, dtype=torch.long)
            t0 = time.perf_counter()
            ep = torch.export.export(model, (x,), strict=strict)
            seconds = time.perf_counter() - t0
        print(f"gpt2 {args.layers} layers, {'strict' if strict else 'non-strict'} export: {seconds:.2f} s, "
              f"{len(ep.graph.nodes)} nodes")


if __name__ == "__main__":
    main()
