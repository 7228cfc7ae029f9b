"""Functional all-gathers in flight together on gloo, as a compiled ZeRO-3 backward issues them (each bucket's gather
recomputed at the top of the graph, waited where it is read).

torch 2.13's own kernel for `_c10d_functional.all_gather_into_tensor` on gloo corrupts the heap when several are in
flight: two ranks running the rounds below abort with "malloc(): unaligned tcache chunk detected" within about 200
rounds (3 of 3 runs, 2026-12-06), and the compiled gpt2 dp2×tp2 ZeRO-3 parity case lost a rank to it in about one
cold run in six. A mesh on gloo routes the op through c10d's all_gather_single (compat.safe_cpu_all_gather).
"""
from __future__ import annotations

import random
import time

import torch

import meshc
from meshc.compiler.ir import torch_compat as compat
from tests.harness import run_ranks

SIZES = [32, 1048, 48, 2080, 32, 1048, 48, 2080, 32]  # one gpt2 ZeRO-3 backward's bucket shards (floats)
ROUNDS = 400  # twice the rounds that lost a rank without the fix


def _rounds(rounds: int) -> dict:
    mesh = meshc.mesh(dp=2, timeout_s=60)
    group = mesh.group("dp").group_name
    rank = mesh.rank
    rng = random.Random(rank)
    wrong = 0
    for it in range(rounds):
        if rng.random() < 0.3:  # the ranks drift apart, as when one compiles longer
            time.sleep(rng.random() * 0.01)
        outs = [compat.c10d_functional.all_gather_into_tensor(torch.full((n,), float(100 * rank + it % 7)), 2, group)
                for n in SIZES]  # all in flight before the first wait
        for out, n in zip(outs, SIZES):
            got = compat.c10d_functional.wait_tensor(out)
            want = torch.cat([torch.full((n,), float(100 * r + it % 7)) for r in range(2)])
            wrong += not torch.equal(got, want)
    return {"wrong": wrong, "rounds": rounds, "fixed": bool(compat._GATHER_LIBS)}


def test_many_functional_gathers_in_flight_on_gloo():
    results = run_ranks(_rounds, 2, ROUNDS, timeout=180)
    for rank, out in enumerate(results):
        assert out == {"wrong": 0, "rounds": ROUNDS, "fixed": True}, (rank, out)
