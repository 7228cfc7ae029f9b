"""The meshc command line.

    meshc demo [--nproc 2] [--steps 300] [--mesh dp=2]      train a small GPT over local processes
    meshc explain --model gpt2-small --mesh dp=2            the plan for one rank, without launching processes
    meshc checkpoint export PATH --to hf|torch              the full state dict (hf: safetensors shards)
    meshc plan --model llama-70b --gpus 1024 --memory 80GB  the best plans by predicted step time
    meshc calibrate                                         measure this CPU over gloo for the cost model
"""
from __future__ import annotations

import argparse
import sys


COMMANDS = {  # name: (help, module, add_arguments, run); a command's module is imported only when it is chosen
    "demo": ("train a small GPT over local CPU processes", "demo", "add_arguments", "run"),
    "explain": ("explain the plan of a built-in model on a mesh", "explain_cli", "add_arguments", "run"),
    "checkpoint": ("work with checkpoints saved by job.save", "checkpoint_cli", "add_arguments", "run"),
    "plan": ("choose the plan with the least predicted step time", "plan_cli", "add_plan_arguments", "run_plan"),
    "calibrate": ("measure this machine for the cost model", "plan_cli", "add_calibrate_arguments", "run_calibrate"),
}


def _module(name: str):
    if name == "demo":
        from meshc import demo as module
    elif name == "explain_cli":
        from meshc import explain_cli as module
    elif name == "checkpoint_cli":
        from meshc import checkpoint_cli as module
    else:
        from meshc import plan_cli as module
    return module


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="meshc", description="meshc: a compiler for distributed training")
    sub = parser.add_subparsers(dest="command", required=True)
    subparsers = {name: sub.add_parser(name, help=info[0]) for name, info in COMMANDS.items()}
    chosen = argv[0] if argv and argv[0] in COMMANDS else None  # the parser has no options before the command
    if chosen is not None:
        _help, module_name, add, _run = COMMANDS[chosen]
        getattr(_module(module_name), add)(subparsers[chosen])
    args = parser.parse_args(argv)
    _help, module_name, _add, run = COMMANDS[args.command]
    try:
        return getattr(_module(module_name), run)(args)
    except (ValueError, TypeError) as e:
        print(f"meshc {args.command}: error: {e}", file=sys.stderr)
        return 2

if __name__ == "__main__":
    sys.exit(main())
