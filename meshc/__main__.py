"""The meshc command line.

    meshc demo [--nproc 2] [--steps 300] [--mesh dp=2]      train a small GPT over local processes
    meshc explain --model gpt2-small --mesh dp=2            the plan for one rank, without launching processes
    meshc checkpoint export PATH --to hf|torch              one full state dict from a sharded checkpoint
    meshc plan --model llama-70b --gpus 1024 --memory 80GB  the best plans by predicted step time
    meshc calibrate                                         measure this CPU over gloo for the cost model
"""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshc", description="meshc: a compiler for distributed training")
    sub = parser.add_subparsers(dest="command", required=True)
    from meshc import checkpoint_cli, demo, explain_cli, plan_cli

    demo.add_arguments(sub.add_parser("demo", help="train a small GPT over local CPU processes"))
    explain_cli.add_arguments(sub.add_parser("explain", help="explain the plan of a built-in model on a mesh"))
    checkpoint_cli.add_arguments(sub.add_parser("checkpoint", help="work with checkpoints saved by job.save"))
    plan_cli.add_plan_arguments(sub.add_parser("plan", help="choose the plan with the least predicted step time"))
    plan_cli.add_calibrate_arguments(sub.add_parser("calibrate", help="measure this machine for the cost model"))
    args = parser.parse_args(argv)
    try:
        return {"demo": demo.run, "explain": explain_cli.run, "checkpoint": checkpoint_cli.run,
                "plan": plan_cli.run_plan, "calibrate": plan_cli.run_calibrate}[args.command](args)
    except (ValueError, TypeError) as e:
        print(f"meshc {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
