"""The multi-process harness reports each failed rank by number and never hangs."""
from __future__ import annotations

import os
import time

import pytest

import meshc
from tests.harness import RankFailure, run_ranks


def _rank_value() -> int:
    return int(os.environ["RANK"]) * 10


def _rank_one_raises() -> None:
    mesh = meshc.mesh(timeout_s=20)
    if mesh.rank == 1:
        raise RuntimeError("boom on purpose")
    import torch
    import torch.distributed as dist
    dist.all_reduce(torch.ones(1))  # rank 0 waits for a peer that has gone


def _rank_large_result():
    import torch

    return torch.full((5 << 20,), float(os.environ["RANK"]))  # 20 MiB: past what the queue itself carries


def _rank_one_stalls() -> None:
    if os.environ["RANK"] == "1":
        time.sleep(600)


def test_results_come_back_in_rank_order():
    assert run_ranks(_rank_value, 2, timeout=60) == [0, 10]


def test_failure_names_the_rank():
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank_one_raises, 2, timeout=60, grace=15)
    text = str(info.value)
    assert "--- rank 1 ---" in text and "boom on purpose" in text


def test_stalled_rank_is_killed_at_the_deadline():
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 ---\nno result within 8 s"):
        run_ranks(_rank_one_stalls, 2, timeout=8)
    assert time.monotonic() - t0 < 30


def test_a_large_result_comes_back_through_a_file_that_is_then_removed(tmp_path, monkeypatch):
    """A result is pickled into the queue's pipe by a feeder thread, where a failure (out of memory under a cap)
    would never reach the parent: a large one is written to a file instead, and the file removed once read."""
    from tests import harness

    seen = []
    read = harness._result
    monkeypatch.setattr(harness, "_result", lambda payload: seen.append(payload) or read(payload))
    out = run_ranks(_rank_large_result, 2, timeout=60, env={"TMPDIR": str(tmp_path)})
    assert [t.numel() for t in out] == [5 << 20] * 2 and [t[0].item() for t in out] == [0.0, 1.0]
    assert all(isinstance(p, str) and p.startswith(str(tmp_path)) for p in seen), seen  # through files
    assert not list(tmp_path.iterdir())  # removed
