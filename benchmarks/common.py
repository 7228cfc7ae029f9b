"""Shared pieces of the benchmarks: launching workers under torchrun, timing steps, and writing results.

A benchmark script runs in two roles. Launched plainly it is the driver: for each configuration it
starts `torchrun --standalone --nproc-per-node N <script> --worker <config>` (gloo on loopback, one
thread per rank) and collects the JSON that rank 0 writes. Under torchrun it is a worker.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable


def launch(script: str, nproc: int, config: dict, timeout: float = 900.0) -> dict:
    """Run `script --worker` on `nproc` local ranks under torchrun; return rank 0's JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
               "MESHC_BENCH_OUT": out, "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               script, "--worker", json.dumps(config)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{config} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def report(result: dict) -> None:
    """Rank 0 of a worker: hand the result back to the driver."""
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.environ["MESHC_BENCH_OUT"], "w") as f:
            json.dump(result, f)


def median_step(step: Callable[[], Any], warmup: int = 3, steps: int = 10, barrier: Callable | None = None) -> float:
    """Median seconds of `step()` after `warmup` calls; `barrier` aligns ranks before each timed step."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        if barrier:
            barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def table(rows: list[dict], columns: list[str]) -> str:
    """A markdown table of `rows` (dicts) in `columns` order."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def wire_bytes(census: dict, sizes: dict[str, int]) -> float:
    """Bytes each rank sends on a ring for the recorded collectives ({(kind, axis): (calls, payload)}):
    all-reduce 2(n-1)/n of its payload, reduce-scatter (n-1)/n of its input, all-gather (n-1) x its shard."""
    total = 0.0
    for (kind, axis), (_, payload) in census.items():
        n = sizes.get(axis, 1)
        factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": n - 1}.get(kind, 1)
        total += payload * factor
    return total
