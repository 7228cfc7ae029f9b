"""Stress: repeat the runs that once crashed a rank, and count crashes and non-zero exits (goal: 0).

    python benchmarks/stress.py [--parity 50] [--demo 20] [--demo-steps 30] [--exit 20] [--timeout 600]

Three kinds of run, each in a fresh process:
  parity  the 4-rank ZeRO-3 + tp=2 + sequence-parallel Llama parity test
          (tests/models/test_zero_parity.py, llama-dp2xtp2-zero3-sequence_parallelTrue), where a rank once
          died with "malloc(): unaligned tcache chunk detected" in backward;
  demo    `meshc demo --nproc 4 --mesh dp=2,tp=2`, which once ended with a rank killed by SIGABRT at exit
          ("terminate called without an active exception");
  exit    4 ranks under torchrun train 3 ZeRO-3 steps, gather the job's state dict and end without
          mesh.close(), as a user's script does: the shape that lost a rank at exit (runtime/monitor/failures.py, Exit).
Each run's exit status is recorded; a run whose output holds "malloc", "terminate called", "Aborted",
"Segmentation" or "SIGABRT" counts as a crash even if it exited 0. Prints one line per run and a summary
table; the failing runs' output tails are kept in --log-dir. Not part of `make test` (minutes per run).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIGNS = ("malloc", "terminate called", "Aborted", "Segmentation", "SIGABRT", "core dumped", "double free")
EXIT_SCRIPT = """
import torch, torch.nn.functional as F, meshc
from meshc import models
mesh = meshc.mesh()
torch.manual_seed(0)
x, y = torch.randint(0, 128, (2, 64)), torch.randint(0, 128, (2, 64))
job = meshc.compile(models.build("gpt-tiny"), mesh, example_inputs=(x,), plan=meshc.Plan(zero=3))
opt = job.optimizer(torch.optim.AdamW, lr=1e-3)
for _ in range(3):
    job.step(x, y, lambda o, t: F.cross_entropy(o.reshape(-1, o.shape[-1]), t.reshape(-1)))
    opt.step()
    opt.zero_grad()
state = job.state_dict()
"""
PARITY = "tests/models/test_zero_parity.py::test_zero_matches_single_process[llama-dp2xtp2-zero3-sequence_parallelTrue]"


def _run(cmd: list[str], timeout: float, env: dict) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
        return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return -999, out + f"\n[stress] timed out after {timeout} s", time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parity", type=int, default=50, help="runs of the 4-rank ZeRO-3+TP+SP parity test")
    p.add_argument("--demo", type=int, default=20, help="runs of meshc demo --nproc 4 --mesh dp=2,tp=2")
    p.add_argument("--demo-steps", type=int, default=30, help="training steps per demo run")
    p.add_argument("--exit", type=int, default=20, help="runs of 4 ranks that end right after a collective")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a run counts as hung")
    p.add_argument("--log-dir", default=os.path.join(tempfile.gettempdir(), "meshc-stress"))
    args = p.parse_args()
    os.makedirs(args.log_dir, exist_ok=True)
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **os.environ,
           "MALLOC_CHECK_": "3"}  # glibc checks the heap on every free: corruption aborts at once
    meshc_cli = os.path.join(os.path.dirname(sys.executable), "meshc")
    kinds = [("parity", [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", PARITY],
              args.parity)]
    kinds.append(("demo", [meshc_cli, "demo", "--nproc", "4", "--mesh", "dp=2,tp=2", "--steps", str(args.demo_steps),
                           "--save-every", "10"], args.demo))
    script = os.path.join(args.log_dir, "exit_worker.py")
    with open(script, "w") as f:
        f.write(EXIT_SCRIPT)
    kinds.append(("exit", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", script],
                  args.exit))
    summary = []
    for name, cmd, runs in kinds:
        crashes = nonzero = 0
        seconds = []
        for i in range(runs):
            run_cmd = cmd
            if name == "demo":
                out_dir = os.path.join(args.log_dir, f"demo_{i}")
                run_cmd = cmd + ["--out", out_dir]
            code, output, took = _run(run_cmd, args.timeout, env)
            seconds.append(took)
            crashed = any(s in output for s in SIGNS) or code < 0
            crashes += crashed
            nonzero += code != 0
            verdict = "crash" if crashed else ("exit %d" % code if code else "ok")
            print(f"{name} {i + 1}/{runs}: {verdict} ({took:.0f} s)", flush=True)
            if crashed or code:
                with open(os.path.join(args.log_dir, f"{name}_{i}.log"), "w") as f:
                    f.write(output[-20000:])
        summary.append((name, runs, crashes, nonzero, sum(seconds) / max(len(seconds), 1)))
    print("\n| run | runs | crashes | non-zero exits | mean s |\n|---|---|---|---|---|")
    for name, runs, crashes, nonzero, mean in summary:
        print(f"| {name} | {runs} | {crashes} | {nonzero} | {mean:.0f} |")
    print(f"logs of failing runs in {args.log_dir}")
    return 1 if any(c or n for _, _, c, n, _ in summary) else 0


if __name__ == "__main__":
    sys.exit(main())
