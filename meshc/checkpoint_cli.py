"""`meshc checkpoint export PATH --to hf|torch [--out FILE] [--max-shard-size 5GB]`: ordinary files from a checkpoint.

Reads the sharded checkpoint a job saved (under any plan) in this one process, without torch.distributed,
and writes the whole tensors under the model's own state_dict keys (tied ones included): safetensors for
`--to hf`, streamed shard by shard (one file, or Hugging Face's `model-0000k-of-0000N.safetensors` with
`model.safetensors.index.json` when the model exceeds --max-shard-size; runtime/checkpoint/export.py), a
torch.save file for `--to torch`. The original model loads either with load_state_dict.
"""
from __future__ import annotations

import argparse

from meshc.runtime.checkpoint.export import DEFAULT_SHARD, export


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    parser = sub.add_parser("export", help="write one full state dict (safetensors or torch.save)")
    parser.add_argument("path", help="a checkpoint folder written by job.save")
    parser.add_argument("--to", choices=("hf", "torch"), default="hf",
                        help="hf: safetensors (default); torch: torch.save")
    parser.add_argument("--out", default=None, help="file to write (default: PATH.safetensors or PATH.pt); several "
                        "hf shards are named after it, beside OUT.index.json")
    parser.add_argument("--max-shard-size", default=DEFAULT_SHARD,
                        help=f"hf: the most tensor bytes per file, e.g. 500MB, 2GiB (default {DEFAULT_SHARD}); "
                        "export holds about one shard in memory")


def run(args: argparse.Namespace) -> int:
    size = int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size
    out = export(args.path, to=args.to, out=args.out, max_shard_size=size)
    print(out)
    return 0
