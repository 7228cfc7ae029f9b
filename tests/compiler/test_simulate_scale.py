"""Simulation at scale: one rank of a Llama-3-70B shape on 1,024 ranks (dp=32 × tp=8 × pp=4), compiled under
fake tensors and torch's fake process group, in a fresh process so that its time and peak memory are its own.

The test compiles 16 of the model's 80 layers (its full widths: hidden 8192, 64 heads, 8 kv heads, ffn
28672, vocab 128256) to keep the suite short: compile time is linear in layers and flat in ranks
(benchmarks/simulate_scale.py measures both, and the full 80 layers: ~55 s and ~0.6 GiB on this machine
unloaded). The bounds (60 s, 4 GiB) guard against unbounded growth, not a speed target."""
from __future__ import annotations

import json
import os
import subprocess
import sys

LAYERS = 16
RANK = 600  # pp rank 600 // 256 = 2, dp rank (600 % 256) // 8 = 11, tp rank 0: a middle stage, with layers

SCRIPT = r"""
import json, sys
import meshc
from meshc.explain_cli import simulate
plan = meshc.Plan(trace="non-strict")  # the default passes, fuse_comm included, as `meshc explain` runs them
sim = simulate("llama-70b", {"dp": 32, "tp": 8, "pp": 4}, rank=int(sys.argv[1]), seq=4096, hardware="h100", plan=plan,
               layers=int(sys.argv[2]))
r, c = sim.report, sim.compiled
print(json.dumps({"seconds": sim.seconds, "peak_rss": sim.peak_rss, "text": str(r), "bytes": r.bytes_per_step(),
                  "memory": c.memory, "time": c.time, "params": r.memory["params"]}))
"""


def test_llama3_70b_on_1024_ranks_compiles_fast_and_small():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(RANK), str(LAYERS)], capture_output=True, text=True,
                          timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["seconds"] < 60, out["seconds"]
    assert out["peak_rss"] < 4 * 2**30, out["peak_rss"]
    text = out["text"]
    assert f"rank {RANK} of 1024" in text and "dp=32 × tp=8 × pp=4" in text
    assert "stage 2 (pp rank 2)" in text
    assert {"dp", "tp", "pp"} <= set(out["bytes"])  # its layers' tp all-reduces, gradient sync, stage messages
    # a Llama-3-70B layer has 855.6M parameters, 107M per tp rank: this stage's ~4 of the 16 layers hold
    # ~0.43B on one rank, where unsharded they would hold ~3.4B (4 bytes each in fp32)
    assert 0.2e9 < out["params"] / 4 < 1.0e9, out["params"]
    assert sum(out["time"].values()) > 0 and out["memory"]["activations"] > 0
