"""The command line: `meshc demo` trains end to end over 2 processes; `meshc explain` needs no processes."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import meshc.__main__ as cli


def test_demo_trains_over_two_processes(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "meshc", "demo", "--steps", "20", "--nproc", "2", "--batch", "16", "--seq", "32",
         "--out", str(out), "--timeout", "60"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "dp=2 × tp=1 × pp=1 (2 ranks, gloo on cpu)" in text
    assert "all_reduce" in text  # the plan is printed before training
    steps = [(int(s), float(loss)) for s, loss in re.findall(r"step\s+(\d+)/20 \[[#-]+\] loss (\d+\.\d+)", text)]
    assert steps[0][0] == 1 and steps[-1][0] == 20
    first, last = re.search(r"first 2 steps (\d+\.\d+) -> of the last 2 steps (\d+\.\d+)", text).groups()
    assert float(last) < float(first) - 0.5, text[-2000:]  # from ~4 (uniform over the characters)
    assert re.search(r"\d[\d,]* tok/s", text)
    for rank in (0, 1):
        graph = (out / "graphs" / f"rank{rank}_stage0.txt").read_text()
        assert "grad_sync" in graph and "all_reduce dp" in graph
        assert (out / "graphs" / f"rank{rank}_stage0.py").read_text().startswith("\n\n\ndef forward")


def test_explain_without_launching(capsys):
    assert cli.main(["explain", "--model", "gpt-tiny", "--mesh", "dp=4", "--rank", "2", "--batch", "8"]) == 0
    text = capsys.readouterr().out
    assert "rank 2 of 4" in text and "dp=4" in text
    assert re.search(r"all_reduce\s+dp\s+[\d.]+ [KM]iB\s+1\s+backward", text)  # buckets sized for the h100 profile
    assert "tok.weight" in text


def test_explain_reports_bad_mesh(capsys):
    assert cli.main(["explain", "--mesh", "dp=2,xp=2"]) == 2
    assert "unknown axis 'xp'" in capsys.readouterr().err


def test_explain_a_pipeline_rank(capsys):
    assert cli.main(["explain", "--model", "gpt-tiny", "--mesh", "pp=2,dp=2", "--rank", "2"]) == 0
    text = capsys.readouterr().out
    assert "stage 1 (pp rank 1): blocks.1, ln_f, head" in text
    assert re.search(r"send\s+pp\s+128.0 KiB\s+1\s+backward\s+stage 1's input gradients", text)
    assert "gradients of parameters held on several pp ranks: tok.weight" in text
    assert "blocks.0.attn.qkv.weight" not in text.split("parameters (")[1]  # stage 0's, held on pp rank 0
