"""The cost model under context parallelism: the formulas' cp traffic against the element counts of
runtime/ops/context.py's docstring, ring attention hidden behind its blocks, and the compiled path (the
CommRecords passes/context.py puts on each context attention) agreeing with the formulas exactly."""
from __future__ import annotations

import dataclasses

import pytest
import sympy
import torch

import meshc
from meshc.compiler.cost import formulas as cost
from meshc.compiler.cost import cp as cost_cp
from meshc.compiler.cost import hardware
from meshc.compiler.compile import compile_program
from meshc.compiler.cost.formulas import FP32, ModelShape, formula_estimate
from meshc.compiler.cost.compiled import compiled_estimate
from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.mesh_spec import MeshSpec
from tests import zoo

H100 = hardware.load("h100")
# zoo.llama's sizes: hidden 32, 4 heads, 2 kv heads (kv width 16), SwiGLU 64, 2 layers; sequence 64
SHAPE = ModelShape(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=zoo.VOCAB, seq=64, gated=True, norm="rms")


def _cp_bytes(cp: int, method: str, batch: int = 1, **plan) -> float:
    est = formula_estimate(SHAPE, {"dp": cp, "cp": cp}, meshc.Plan(cp_attention=method, **plan), batch, H100, FP32)
    return est.comm_bytes.get("cp", 0.0)


@pytest.mark.parametrize("cp", [2, 4])
def test_formula_cp_bytes_are_the_attention_exchanges(cp):
    """One sequence split over cp ranks (b_c = 1 per cp group), fp32, per rank per step, L layers:
    ring (c−1)/c·b_c·s·kh·2 elements forward, twice that backward; all-gather the local K,V, reduce-scatter c of
    them; all-to-all q, k, v in and the output back, forward and backward (the 2 kv heads repeated for every
    query head where cp does not divide them, as runtime/ops/context.py does)."""
    c, s, layers, h, kh, cb = cp, SHAPE.seq, SHAPE.layers, SHAPE.hidden, 16, 4
    local = s // c  # b_c·s/c tokens on each rank
    ring = layers * 3 * (c - 1) / c * s * kh * 2 * cb
    gather = layers * (1 + c) * local * kh * 2 * cb
    a2a = layers * 2 * (2 * local * h + local * 2 * (kh if 2 % c == 0 else h)) * cb
    assert _cp_bytes(cp, "ring") == pytest.approx(ring, rel=1e-12)
    assert _cp_bytes(cp, "all_gather") == pytest.approx(gather, rel=1e-12)
    assert _cp_bytes(cp, "all_to_all") == pytest.approx(a2a, rel=1e-12)
    assert _cp_bytes(cp, "ring", remat="full") == pytest.approx(ring * 4 / 3, rel=1e-12)  # the forward's again
    one = formula_estimate(SHAPE, {"dp": 1}, meshc.Plan(), 1, H100, FP32)  # the sequence on one rank
    assert "cp" not in one.comm_bytes and one.time["cp"] == 0.0
    est = formula_estimate(SHAPE, {"dp": cp, "cp": cp}, meshc.Plan(), 1, H100, FP32)
    for got, whole in ((est.flops, one.flops), (est.memory["activations"], one.memory["activations"])):
        assert got * cp == pytest.approx(whole, rel=1e-12)  # each rank 1/cp of the tokens, queries against all keys


def test_symbolic_ring_bytes():
    """The inline formula (cost.formulas) is the one the planner evaluates apart (cost_cp.cp_numbers)."""
    exprs = cost.formulas(H100, SHAPE.flags())
    c, r_c, g_c, u_c = cost_cp.c, cost_cp.r_c, cost_cp.g_c, cost_cp.u_c
    kv = 2 * cost.s * cost.B / (cost.N * cost.m) * cost.k * cost.h / cost.a / cost.c_kv * cost.cb
    # backward: K, V again and their gradients, kept in fp32 (4 bytes) whatever cb is
    want = cost.m * cost.L / cost.p * ((1 + cost.rf) * (c - 1) * kv + (c - 1) * kv * (1 + 4 / cost.cb))
    got = exprs["cp_bytes"].subs({r_c: 1, g_c: 0, u_c: 1})
    assert sympy.simplify(got - want) == 0


def test_ring_hides_behind_the_attention_blocks():
    """At a long sequence each ring hop overlaps a block of attention on GPUs (overlap 1): nothing of it shows,
    while the all-gather's does; with overlap 0 every hop shows, (c−1)·(send(kv) + send(2kv)) per layer."""
    shape = dataclasses.replace(SHAPE, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=32768)
    plan = {m: meshc.Plan(cp_attention=m) for m in ("ring", "all_gather")}
    est = {m: formula_estimate(shape, {"dp": 8, "cp": 8}, p, 1, H100, FP32) for m, p in plan.items()}
    assert est["ring"].time["cp"] == 0.0 < est["all_gather"].time["cp"]
    blocking = dataclasses.replace(H100, overlap=0.0)
    kv = 2 * (shape.seq // 8) * 1024 * 4  # this rank's K and V, fp32
    hop = blocking.intra.time("send", 2, kv) + blocking.intra.time("send", 2, 2 * kv)
    got = formula_estimate(shape, {"dp": 8, "cp": 8}, plan["ring"], 1, blocking, FP32).time["cp"]
    assert got == pytest.approx(shape.layers * 7 * hop, rel=1e-9)


def test_refusals():
    with pytest.raises(MeshcValueError, match="2·cp = 8"):
        formula_estimate(dataclasses.replace(SHAPE, seq=36), {"dp": 4, "cp": 4}, meshc.Plan(), 1, H100)
    with pytest.raises(MeshcValueError, match="all_to_all attention needs the heads"):
        formula_estimate(SHAPE, {"dp": 8, "cp": 8}, meshc.Plan(cp_attention="all_to_all"), 1, H100)
    with pytest.raises(MeshcValueError, match="dp/cp × microbatches = 4"):
        formula_estimate(SHAPE, {"dp": 8, "cp": 2}, meshc.Plan(), 2, H100)


def test_compiled_and_formula_agree_on_ring_attention():
    """zoo.llama (one layer, to stay cheap) at sequence 64 on dp=2 (cp=2): one batch slice of 2 sequences, each
    rank 32 positions. The compiled rank's cp traffic (the context attention's records), its exposed time and its
    FLOPs (local queries against every key) are the formulas', exactly: both price the same records on the same
    link (and the hop's hidden part from the same FLOPs)."""
    spec = MeshSpec({"dp": 2, "cp": 2})
    plan = meshc.Plan(trace="non-strict", cp_attention="ring")
    x = torch.randint(0, zoo.VOCAB, (2, SHAPE.seq // 2))  # this rank's rows: all 2 sequences, its 32 positions
    program = compile_program(zoo.llama(layers=1), (x,), {}, mesh=spec, plan=plan, rank=0)[1]
    compiled = compiled_estimate(program, H100)
    formula = formula_estimate(dataclasses.replace(SHAPE, layers=1), spec.sizes, plan, 2, H100, FP32)
    assert compiled.comm_bytes["cp"] == formula.comm_bytes["cp"] == 3 * (2 * 32 * 16 * 2 * 4)  # 3 × local K,V
    assert compiled.time["cp"] == pytest.approx(formula.time["cp"], rel=1e-12) and formula.time["cp"] > 0
    assert compiled.flops == formula.flops
