"""The command line of the cost model and the planner, in process: `meshc plan`, `meshc explain` with a
transformers config file and predictions, and `meshc calibrate`'s profile as `meshc plan --hardware` reads it."""
from __future__ import annotations

import json
import re

from meshc import __main__ as cli
from meshc.compiler.cost import hardware


def test_plan_prints_the_best_plans_with_reasons(capsys):
    assert cli.main(["plan", "--model", "llama-8b", "--gpus", "16", "--memory", "80GB", "--seq", "4096",
                     "--top", "5"]) == 0
    text = capsys.readouterr().out
    assert "fastest of" in text and "best: meshc.mesh(dp=" in text
    rows = [line for line in text.splitlines() if re.match(r"\s+[2-5]\s+dp=", line)]
    assert len(rows) == 4 and all(re.search(r"\+\d+%: ", row) for row in rows), text  # why each lost
    assert cli.main(["plan", "--model", "llama-70b", "--gpus", "8", "--memory", "10GB"]) == 2
    assert "expected a plan that fits" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "llama-70b", "--gpus", "8", "--memory", "80GB"]) == 0  # with offload only
    text = capsys.readouterr().out
    assert "offload='cpu'" in text and re.search(r"trade: fits on 8 x h100 with offload=cpu, step [\d.]+ s \([\d.]+x the "
                                                  r"step of the best plan without offload, which needs 16 devices", text), text
    assert cli.main(["plan", "--model", "llama-8b", "--gpus", "8", "--memory", "lots"]) == 2
    assert "--memory: expected a size such as 80GB" in capsys.readouterr().err


def test_plan_splits_one_long_sequence_over_cp(capsys):
    assert cli.main(["plan", "--model", "llama-8b", "--gpus", "8", "--batch", "1", "--seq", "131072", "--memory",
                     "80GB", "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"\n\s+1\s+dp=1 cp=8\(ring\) tp=1 pp=1 ", text), text
    assert "best: meshc.mesh(dp=1, cp=8, tp=1, pp=1)" in text and "cp_attention='ring'" in text


def test_plan_reads_a_calibrated_profile(tmp_path, capsys):
    path = tmp_path / "cpu.json"
    hardware.load("cpu-default").save(str(path))
    assert cli.main(["plan", "--model", "gpt-tiny", "--gpus", "2", "--hardware", str(path), "--batch", "8"]) == 0
    text = capsys.readouterr().out
    assert "on 2 x cpu-default" in text and "best: meshc.mesh(" in text


def test_explain_a_transformers_config_with_predictions(tmp_path, capsys):
    config = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 32, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert cli.main(["explain", "--config", str(path), "--mesh", "dp=2,tp=2", "--rank", "3", "--batch", "4",
                     "--hardware", "a100"]) == 0
    text = capsys.readouterr().out
    assert "rank 3 of 4" in text and re.search(r"all_reduce\s+tp", text)
    assert "predicted on a100 (this rank's compiled graphs):" in text
    assert re.search(r"memory per rank [\d.]+ [KM]iB \(params", text) and "step time" in text
    assert "predicted by the formulas" in text


def test_calibrate_measures_the_offload_disk(tmp_path):
    """meshc calibrate's disk figures (Plan.offload="nvme"): a written, fsynced file read back from the disk, nothing
    left behind; a profile written before these fields existed still loads (0: unknown, no nvme offload offered)."""
    from meshc.calibrate import measure_disk

    read, write = measure_disk(str(tmp_path), 16 * 2**20)
    assert read > 0 and write > 0 and list(tmp_path.iterdir()) == []
    old = hardware.load("cpu-default").to_dict()
    for key in ("disk_read", "disk_write", "host_bandwidth"):
        del old[key]
    assert hardware.Hardware.from_dict(old).disk_read == 0.0
