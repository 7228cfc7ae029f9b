"""benchmarks/gpu_suite.py --dry-run: every row of the GPU suite runs on CPU at tiny sizes and trains correctly.

The suite's numbers need a GPU; what the dry run can check is that each row is built and stepped by the same
code the GPU run uses, that the table names every row with numbers or a stated reason, and that the meshc
rows train the model the fp32 eager reference trains (same weights, batch, AdamW and steps).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINING_ROWS = ("eager", "torch.compile", "meshc ZeRO-1", "meshc ZeRO-1 Inductor", "meshc ZeRO-3 Inductor",
                 "meshc ZeRO-3", "meshc offload=cpu")
MESHC_ROWS = ("meshc ZeRO-1", "meshc ZeRO-1 Inductor", "meshc ZeRO-3 Inductor", "meshc ZeRO-3")
KERNEL_GROUPS = ("norm", "rmsnorm", "gelu", "swiglu", "pack_cast, unpack, grad_prologue")


def _table(text: str, first_column: str) -> dict[str, list[str]]:
    """The markdown table whose header starts with `first_column`: {first cell: all cells} per row."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {first_column} |"))
    rows = {}
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        rows[cells[0]] = cells
    return rows


def _number(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("%"))


def test_gpu_suite_dry_run(tmp_path):
    out, raw = tmp_path / "gpu_suite.md", tmp_path / "gpu_suite.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # On CPU even where a GPU is visible (the dry run follows meshc.mesh()'s device); Triton in its interpreter.
    env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--dry-run", "--out", str(out),
                           "--json", str(raw)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# meshc GPU suite, ") and "torch " in text and "triton " in text

    table = _table(text, "row")
    assert set(table) == set(TRAINING_ROWS), table.keys()
    for name, cells in table.items():
        step_s, tokens_s, mfu, notes = cells[3], cells[4], cells[5], cells[-1]
        if step_s == "-":  # no numbers: the row must say why
            assert "skipped" in notes or "not available" in notes, cells
        else:
            assert "ERROR" not in notes and "aborted" not in notes, cells
            assert _number(step_s) > 0 and _number(tokens_s) > 0 and mfu.endswith("%"), cells
    for name in ("eager", "torch.compile", *MESHC_ROWS):  # these run on CPU, so the dry run must measure them
        assert table[name][3] != "-", table[name]
    for name in ("meshc ZeRO-1 Inductor", "meshc ZeRO-3 Inductor"):  # really compiled, forward and backward
        assert "Inductor: 1 fw + 1 bw graphs" in table[name][-1], table[name]
    assert "Inductor" not in table["meshc ZeRO-1"][-1]

    kernels = _table(text, "kernel")
    assert set(kernels) == set(KERNEL_GROUPS)
    assert all("skipped on CPU" in " ".join(cells) for cells in kernels.values())

    data = json.loads(raw.read_text())
    ref = data["reference_losses"]  # fp32 eager copy, fp32 AdamW, the same 3 steps on the same batch
    rows = {r["name"]: r for r in data["rows"]}
    assert len(ref) == 3 and all(math.isfinite(v) for v in ref)
    for name in ("eager", "torch.compile", *MESHC_ROWS):
        losses = rows[name]["losses"]
        assert len(losses) == len(ref) and all(math.isfinite(v) for v in losses), (name, losses)
        assert losses[0] > losses[1] > losses[2], (name, losses)  # the same batch every step: it must fall
        # Step 1 is the initial weights' loss in each row's precision: bf16 rounding of 64-wide activations
        # moves this ln(256)-sized loss by ~1e-4 (measured); 2e-3 is 10x that and ~35x below one step's drop.
        assert abs(losses[0] - ref[0]) < 2e-3, (name, losses, ref)
    for name in MESHC_ROWS:
        # meshc keeps fp32 masters and fp32 AdamW states: only its bf16 forward/backward differs from the fp32
        # reference, ~2e-4 after two updates (measured); 2e-3 still fails a lost, doubled or mis-scaled update,
        # each of which moves the loss by a good part of the ~0.07 one step takes off.
        assert all(abs(a - b) < 2e-3 for a, b in zip(rows[name]["losses"], ref)), (name, rows[name]["losses"], ref)
    # ZeRO-3 over one rank reads its shards in place: the same math as ZeRO-1's
    assert all(abs(a - b) < 1e-4 for a, b in zip(rows["meshc ZeRO-3"]["losses"], rows["meshc ZeRO-1"]["losses"]))
    # torch.compile runs the eager row's bf16 program: the same losses up to op-order rounding.
    assert all(abs(a - b) < 2e-3 for a, b in zip(rows["torch.compile"]["losses"], rows["eager"]["losses"]))
