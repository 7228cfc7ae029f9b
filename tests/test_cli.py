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


def test_explain_a_users_factory(capsys):
    """A model the user wrote, named as module:factory, explained on fake tensors; its example batch splits over
    dp; --layers reaches the factory."""
    assert cli.main(["explain", "--model", "tests.plain_models:encoder_lm_with_batch", "--mesh", "dp=2,tp=2",
                     "--layers", "3"]) == 0
    text = capsys.readouterr().out
    assert "rank 0 of 4" in text and "tp coverage: 1.00" in text
    assert "encoder.layers.2.self_attn column-parallel -> encoder.layers.2.self_attn.out_proj row-parallel" in text
    assert re.search(r"all_reduce\s+dp", text)  # the 8 sequences split over dp: gradients reduced
    assert cli.main(["explain", "--model", "tests.zoo:llama", "--mesh", "tp=2", "--seq", "16", "--batch", "4"]) == 0
    assert "tp coverage: 1.00" in capsys.readouterr().out


def test_a_factory_that_cannot_be_used_is_named(capsys):
    for spec, said in [("tests.zoo:nothing", "tests.zoo has no callable 'nothing'"),
                       ("no_such_package.models:build", "cannot import 'no_such_package.models'"),
                       ("tests.zoo:VOCAB", "has no callable 'VOCAB'"),
                       ("tests.test_cli:numpy_factory", "the factory failed under fake tensors"),
                       ("tests.test_cli:not_a_module", "expected the factory to return an nn.Module")]:
        assert cli.main(["explain", "--model", spec]) == 2
        assert said in capsys.readouterr().err
    assert cli.main(["explain", "--model", "tests.plain_models:encoder_lm_with_batch", "--batch", "4"]) == 2
    assert "the factory's example inputs hold a batch of 8" in capsys.readouterr().err
    assert cli.main(["explain", "--model", "tests.zoo:gpt2", "--layers", "1", "--batch", "3", "--mesh", "dp=2"]) == 2
    assert "divisible by dp × microbatches" in capsys.readouterr().err


def test_plan_a_users_factory(capsys):
    """`meshc plan` scores a factory's model on its compiled graphs (it has no formula shape)."""
    assert cli.main(["plan", "--model", "tests.plain_models:encoder_lm_with_batch", "--gpus", "2", "--hardware",
                     "cpu", "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "global batch 8 sequences (compiled graphs" in text
    assert re.search(r"best: meshc\.mesh\(dp=\d, tp=\d, pp=\d\)", text)


def numpy_factory():
    """A factory that reads its weights' values (fails on fake tensors)."""
    import torch

    layer = torch.nn.Linear(4, 4)
    layer.weight.detach().numpy()
    return layer


def not_a_module():
    return "a model"
