"""`meshc demo --resume`: a run stopped after a checkpoint and resumed in new processes has the same loss curve,
bitwise, as the run that went straight through (same plan, same 2 processes, same thread count)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import meshc.__main__ as cli

# tiny on purpose: most of the time is starting torchrun and two Python processes per run
SIZE = ["--nproc", "2", "--batch", "8", "--seq", "32", "--layers", "1", "--dim", "64", "--timeout", "60"]


def _demo(out, *extra):
    proc = subprocess.run([sys.executable, "-m", "meshc", "demo", *SIZE, "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _losses(out):
    lines = (out / "losses.txt").read_text().splitlines()
    return [(int(s), float(v)) for s, v in (line.split("\t") for line in lines)]


def test_resume_continues_the_loss_curve_bitwise(tmp_path):
    out = tmp_path / "demo"
    ckpt = out / "ckpt"
    # straight through: 6 steps, checkpoints after steps 3 and 6
    text = _demo(out, "--steps", "6", "--save-every", "3")
    assert f"saved checkpoint {ckpt / 'step_000003'} (step 3" in text
    assert f"saved checkpoint {ckpt / 'step_000006'} (step 6" in text
    straight = _losses(out)
    assert [s for s, _ in straight] == [1, 2, 3, 4, 5, 6]

    # as if that run had been killed after its save at step 3: only that checkpoint is left
    shutil.rmtree(ckpt / "step_000006")
    text = _demo(out, "--steps", "6", "--resume")
    assert f"resumed from step 3 (checkpoint {ckpt / 'step_000003'})" in text
    assert "step 4/6" in text and "step 1/6" not in text
    resumed = _losses(out)  # steps 1-3 kept from the first run, 4-6 written by the resumed one
    # bitwise: the same plan on the same 2 ranks and threads runs the same kernels in the same order, and the
    # checkpoint restores parameters, AdamW's states and step, the RNG and the data position exactly
    assert resumed == straight, (resumed, straight)
    assert (ckpt / "step_000006").is_dir()  # saved again at the end


def test_resume_without_a_checkpoint_is_refused(tmp_path, capsys):
    # refused before any process is launched
    assert cli.main(["demo", "--resume", "--out", str(tmp_path / "none"), "--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert "--resume: expected a complete checkpoint in" in err and str(tmp_path / "none" / "ckpt") in err
