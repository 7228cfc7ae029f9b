"""`meshc checkpoint export PATH --to hf|torch [--out FILE]`: one ordinary full state dict from a checkpoint.

Reads the sharded checkpoint a job saved (under any plan) in this one process, without torch.distributed,
and writes the whole tensors under the model's own state_dict keys (tied ones included): a safetensors file
for `--to hf`, a torch.save file for `--to torch`. The original model loads either with load_state_dict.
"""
from __future__ import annotations

import argparse

from meshc.runtime.checkpoint import save_load as checkpoint


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    export = sub.add_parser("export", help="write one full state dict (safetensors or torch.save)")
    export.add_argument("path", help="a checkpoint folder written by job.save")
    export.add_argument("--to", choices=("hf", "torch"), default="hf",
                        help="hf: safetensors (default); torch: torch.save")
    export.add_argument("--out", default=None, help="file to write (default: PATH.safetensors or PATH.pt)")


def run(args: argparse.Namespace) -> int:
    out = checkpoint.export(args.path, to=args.to, out=args.out)
    print(out)
    return 0
