"""Shared pieces of the benchmarks: launching workers under torchrun, timing steps, writing results, and the
model, batch and loss several of them measure.

A benchmark script runs in two roles. Launched plainly it is the driver: for each configuration it
starts `torchrun --standalone --nproc-per-node N <script> --worker <config>` (gloo on loopback, one
thread per rank) and collects the JSON that rank 0 writes. Under torchrun it is a worker:

    p = arg_parser()                  # has --worker
    ...
    args = p.parse_args()
    if run_worker(args, worker):      # under torchrun: worker(config) ran
        return

torch is imported inside the functions that need it, so a driver imports this file without torch.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable


def launch(script: str, nproc: int, config: dict, timeout: float = 900.0, python: str | None = None,
           exit_code_ok: bool = False, env: dict[str, str] | None = None) -> dict:
    """Run `script --worker` on `nproc` local ranks under torchrun (of `python`, default this interpreter);
    return rank 0's JSON result. `exit_code_ok`: a run that wrote its result and then failed (a rank lost at
    exit) returns the result with its "exit_code" instead of raising. `env`: variables the ranks get beyond
    this process's."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
               "MESHC_BENCH_OUT": out, "PYTHONUNBUFFERED": "1"}
        cmd = [python or sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               script, "--worker", json.dumps(config)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 and not (exit_code_ok and os.path.exists(out)):
            raise RuntimeError(f"{config} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return {**json.load(f), "exit_code": proc.returncode}


def rss_mib(field: str = "VmRSS") -> float:
    """This process's resident set (or, with "VmHWM", its peak since start or the last reset) in MiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def last_error(log: str) -> str:
    """The last error line of a failed launch's log (torchrun's own wrapper lines left out), for a table row."""
    lines = [line.split("]:", 1)[-1].strip() for line in log.splitlines() if "Error" in line and ":" in line]
    lines = [line for line in lines if not line.startswith(("torch.distributed.elastic", "raise", "RuntimeError: {"))]
    return lines[-1][:200] if lines else "see its log"


def report(result: dict) -> None:
    """Rank 0 of a worker: hand the result back to the driver."""
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.environ["MESHC_BENCH_OUT"], "w") as f:
            json.dump(result, f)


def interleaved_medians(steps: list[Callable[[], Any]], rounds: int, per_round: int,
                        barrier: Callable | None = None) -> list[float]:
    """Median seconds of each of `steps`, timed in `rounds` interleaved rounds (each step once untimed, then
    `per_round` times, `barrier` aligning ranks before each): a shared machine's load drifts, and moves plans
    measured close together alike."""
    return [statistics.median(t) for t in interleaved_times(steps, rounds, per_round, barrier)]


def interleaved_times(steps: list[Callable[[], Any]], rounds: int, per_round: int,
                      barrier: Callable | None = None) -> list[list[float]]:
    """interleaved_medians' timings, every one of them (this rank's), per step."""
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(rounds):
        for i, step in enumerate(steps):
            step()
            for _ in range(per_round):
                if barrier:
                    barrier()
                t0 = time.perf_counter()
                step()
                times[i].append(time.perf_counter() - t0)
    return times


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


def arg_parser(**kwargs: Any) -> argparse.ArgumentParser:
    """An ArgumentParser with `--worker` (the config JSON `launch` passes to a worker)."""
    p = argparse.ArgumentParser(**kwargs)
    p.add_argument("--worker", default=None)
    return p


def run_worker(args: argparse.Namespace, worker: Callable[[dict], Any]) -> bool:
    """In a worker (`--worker <config>`), run `worker(config)` and return True; in the driver return False."""
    if not args.worker:
        return False
    worker(json.loads(args.worker))
    return True


def reference_transformer(layers: int, dim: int, heads: int, vocab: int, seq: int, *, tied: bool = True,
                          seed: int = 0):
    """torch's reference Transformer (torch.testing's ModelArgs), dropout off, weights from `seed`."""
    import torch
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    torch.manual_seed(seed)
    return Transformer(ModelArgs(n_layers=layers, vocab_size=vocab, max_seq_len=seq, dim=dim, n_heads=heads,
                                 dropout_p=0.0, weight_tying=tied))


def token_batch(batch: int, seq: int, vocab: int, seed: int = 1):
    """(inputs, next-token targets), each (batch, seq), from one random token stream of `seed`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lm_loss(out, y):
    """Mean next-token cross-entropy of logits (B, T, V) against targets (B, T)."""
    import torch.nn.functional as F

    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
