"""job.trace(path) on a real 2-rank pipeline (gloo, pp=2, 2 micro-batches, the tiny GPT with tied
embeddings): the merged file loads with a strict JSON parser; per rank, its compute events are its schedule's
actions in program order, its p2p events its schedule's messages, its collectives' bytes per (kind, axis)
what the compiled program predicts for those steps (compiler/cost/compiled.comm_bytes, read off the graphs at
compile time, not from the dispatch hook the trace itself uses), one step event per step; timestamps are monotone per thread
and every event lies inside a step; each forward action holds the runs of its stage's modules (blocks.0 on
pp rank 0, blocks.1 on rank 1), nested inside it and in one another, in order without overlap;
job.report(..., trace=) draws the last step's measured actions.
(~10 s: two processes.)
"""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

import meshc
from meshc import models
from meshc.compiler.cost.compiled import comm_bytes
from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.mesh_spec import MeshSpec
from meshc.compiler.ir.schedule import P2P, Action
from meshc.runtime.monitor.trace import record
from tests.harness import run_ranks

STEPS = 2


def _traced_rank(path: str) -> dict:
    mesh = meshc.mesh(pp=2, timeout_s=60)
    torch.manual_seed(0)
    x = torch.randint(0, 128, (4, 64))
    job = meshc.compile(models.build("gpt-tiny"), mesh, example_inputs=(x,), plan=meshc.Plan(microbatches=2))
    job.step(x, x, models.lm_loss)  # compiled and warm before the traced steps
    with job.trace(path):
        for _ in range(STEPS):
            job.step(x, x, models.lm_loss)
    if mesh.rank == 0:  # the file is complete once rank 0 left job.trace
        job.report(path.replace(".json", ".html"), trace=path)
    program = job.compiled.pipeline.schedule.program(mesh.coord("pp"))
    out = {"actions": [str(op) for op in program if isinstance(op, Action)],
           "messages": [str(op) for op in program if isinstance(op, P2P)],
           "collectives": {key: nbytes * STEPS for key, nbytes in comm_bytes(job.program, job.compiled.pipeline).items()
                           if key[0] != "send"}}  # the pipeline's messages are p2p events
    mesh.close()
    return out


def test_trace_two_ranks(tmp_path):
    path = tmp_path / "trace.json"
    results = run_ranks(_traced_rank, 2, str(path), timeout=120)
    data = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    events = [ev for ev in data["traceEvents"] if ev["ph"] == "X"]
    # exposed communication per step, measured, beside the cost model's prediction (ms): each rank waits for the
    # other stage's activations or gradients (p2p) and the loss's all-reduce, within its steps
    exposed, predicted = data["otherData"]["exposed_ms"], data["otherData"]["predicted_ms"]
    for rank in ("0", "1"):
        mine = exposed[rank]
        assert mine["steps"] == STEPS and 0 < mine["p2p"] and mine["collective"] > 0, mine
        assert mine["exposed"] == pytest.approx(mine["wait"] + mine["collective"] + mine["p2p"])
        assert mine["exposed"] < mine["step"], mine
        spans = [ev for ev in events if ev["pid"] == int(rank) and ev["cat"] == "p2p"]
        assert mine["p2p"] == pytest.approx(sum(ev["dur"] for ev in spans) / 1e3 / STEPS)
    assert set(predicted) == {"tp", "ep", "cp", "pp", "dp", "bubble"} and predicted["bubble"] > 0, predicted
    names = {ev["pid"]: ev["args"]["name"] for ev in data["traceEvents"] if ev["name"] == "process_name"}
    assert names == {0: "rank 0 (pp=0 dp=0 tp=0)", 1: "rank 1 (pp=1 dp=0 tp=0)"}
    for rank, expected in enumerate(results):
        mine = [ev for ev in events if ev["pid"] == rank]
        by_cat = lambda cat: [ev for ev in mine if ev["cat"] == cat]
        assert [ev["name"] for ev in by_cat("compute")] == expected["actions"] * STEPS
        assert [ev["name"] for ev in by_cat("p2p")] == expected["messages"] * STEPS
        assert all(ev["args"]["bytes"] > 0 for ev in by_cat("p2p"))
        got = {}
        for ev in by_cat("collective"):
            key = (ev["args"]["kind"], ev["args"]["axis"])
            got[key] = got.get(key, 0) + ev["args"]["bytes"]
        # the loss shared over pp and the tied gradients at least: two all-reduces over pp per step
        assert got == expected["collectives"] and len(by_cat("collective")) >= 2 * STEPS, (got, expected)
        steps = by_cat("step")
        assert len(steps) == STEPS
        for tid in {ev["tid"] for ev in mine}:
            ts = [ev["ts"] for ev in mine if ev["tid"] == tid]
            assert ts == sorted(ts)
        for ev in mine:
            assert any(s["ts"] <= ev["ts"] and ev["ts"] + ev["dur"] <= s["ts"] + s["dur"] + 1 for s in steps), ev
            assert math.isfinite(ev["ts"]) and ev["dur"] >= 0
        _check_modules(by_cat("compute"), by_cat("module"), f"blocks.{rank}", f"blocks.{1 - rank}")


    # the report embeds the measured timeline of the last step: each rank's compute actions, in order
    page = (tmp_path / "trace.html").read_text()
    measured = re.findall(r'<div class="tl-bar measured \w+" data-cat="compute"[^>]*>(\w+)</div>', page)
    assert measured == results[0]["actions"] + results[1]["actions"]
    # and, under each rank's actions, the top-level modules its forwards ran in that step
    last = {r: max((ev for ev in events if ev["pid"] == r and ev["cat"] == "step"), key=lambda ev: ev["ts"])
            for r in (0, 1)}
    tops = [ev["name"] for r in (0, 1) for ev in events if ev["pid"] == r and ev["cat"] == "module"
            and ev["args"]["depth"] == 1 and last[r]["ts"] <= ev["ts"] <= last[r]["ts"] + last[r]["dur"]]
    assert re.findall(r'class="tl-bar measured module" data-module="([^"]+)"', page) == tops
    assert tops.count("blocks.0") == tops.count("blocks.1") == 2  # one per micro-batch's forward


def _check_modules(actions: list[dict], modules: list[dict], mine: str, other: str) -> None:
    """Every module event inside one forward action; within an action, in time order, each either inside the
    one before it or after its end (a tree); each forward runs the block of its stage and not the other's."""
    end = lambda ev: ev["ts"] + ev["dur"]
    inside = {i: [] for i, a in enumerate(actions) if "F" in a["name"]}
    for ev in modules:
        holder = [i for i in inside if actions[i]["ts"] <= ev["ts"] and end(ev) <= end(actions[i])]
        assert len(holder) == 1, ev
        inside[holder[0]].append(ev)
    for events in inside.values():
        names = [ev["name"] for ev in events]
        assert mine in names and other not in names and f"{mine}.attn" in names, names
        assert [ev["ts"] for ev in events] == sorted(ev["ts"] for ev in events)
        for i, a in enumerate(events):
            for b in events[i + 1:]:
                assert end(b) <= end(a) or b["ts"] >= end(a), (a, b)  # nested or after, never overlapping
        block = next(ev for ev in events if ev["name"] == mine)
        assert any(ev["name"] == f"{mine}.attn" and block["ts"] <= ev["ts"] and end(ev) <= end(block)
                   for ev in events)


def test_trace_path_must_be_json(tmp_path):
    with pytest.raises(MeshcValueError, match="job.trace: expected a path ending in .json"):
        with record(MeshSpec({"dp": 1}), tmp_path / "trace.txt"):
            pass
