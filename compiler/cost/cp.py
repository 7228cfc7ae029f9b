"""Context parallelism's part of the cost model's formulas (compiler/cost/formulas.py): the attention's traffic on cp.

Kept apart from formulas.py to keep that file small; formulas.py imports these symbols and terms into its formulas.
The compiled path prices the same traffic from the CommRecords passes/context.py puts on each context
attention (compiler/cost/compiled.py).

Terms (symbols, beside formulas.py's): c the cp size (c consecutive dp ranks share one batch slice and split each
of its sequences; N counts them, so b = B/(N·m), fractional where c > 1, is already one rank's share and s·b
its tokens per micro-batch: activations and FLOPs need no other change); u_c = [c > 1]; x_c = [the cp group,
c ranks t apart, spans nodes]; r_c, g_c = [Plan.cp_attention is "ring", "all_gather"] (all_to_all where
both are 0); y_c = [all_to_all repeats the kv heads for every query head: the rank's kv heads not divisible by c].

Formulas, per attention layer and micro-batch on one rank, in bytes (cb per element), with T = s·b the rank's
tokens, kv = 2·T·(k·h/a)/c_kv·cb its K and V, q = T·h/t·cb its queries, A = 4·s·T·h/t its attention FLOPs:
  ring        forward: c−1 point-to-point sends of kv (α-β `send` on the cp group's link, one step per hop);
              backward: c−1 of kv·(1 + 4/cb) (K, V again and the dK, dV travelling home, kept in fp32: 2·kv
              in fp32). Each hop overlaps one block of attention, A/c FLOPs forward and 2A/c backward, as far
              as the profile's `overlap` ω allows:
                  exposed (c−1)·max(0, send(kv) − ω·κ·A/(c·F)) + (c−1)·max(0, send(kv') − ω·κ·2A/(c·F))
              (causal skipping is not discounted, as the FLOPs count of formulas.py and compiled.py does not).
  all_gather  forward an all-gather of kv, backward a reduce-scatter of c·kv; no overlap. Without remat the
              gathered K and V stay saved for backward: + (c−1)·kv activations per layer.
  all_to_all  (DeepSpeed-Ulysses) forward one all-to-all of 2q + kv' (q in and the output back; K, V in),
              backward the same; kv' = kv, or 2·T·h/t·cb where the kv heads are repeated (y_c).
  per step    m·L/p·(forward·(1 + rf) + backward): full recompute runs the forward's traffic again;
              bytes (comm_bytes "cp") the payloads the same way.
"""
from __future__ import annotations

import functools

import sympy
from sympy import Max

from meshc.compiler.cost.hardware import Hardware
from meshc.compiler.ir.errors import MeshcValueError

CP_SYMBOLS = sympy.symbols("c u_c x_c r_c g_c y_c", positive=True)
c, u_c, x_c, r_c, g_c, y_c = CP_SYMBOLS
CP_TERMS = sympy.symbols("T_cp Y_cp A_cp", nonnegative=True)  # cp_layer_terms as numbers (cost.compiled_cp)
METHODS = ("ring", "all_gather", "all_to_all")


def _coll(hw: Hardware, kind: str, n, payload, crossing):
    return (1 - crossing) * hw.intra.time(kind, n, payload) + crossing * hw.inter.time(kind, n, payload)


def cp_layer_terms(hw: Hardware, tokens, s, h, kvd, t, c_kv, cb, rf, rs):
    """(seconds, payload bytes, extra saved activation bytes) of one attention layer's cp traffic per
    micro-batch on one rank; `tokens` = s·b, `kvd` = k·h/a, rf/rs the recompute indicators."""
    kv, q = 2 * tokens * kvd / c_kv * cb, tokens * h / t * cb
    block = 4 * s * tokens * h / t / c / hw.flops * hw.compute_scale * hw.overlap  # one hop's hidden seconds
    ring_f = (c - 1) * Max(0, _coll(hw, "send", 2, kv, x_c) - block, evaluate=False)
    ring_b = (c - 1) * Max(0, _coll(hw, "send", 2, kv * (1 + 4 / cb), x_c) - 2 * block, evaluate=False)
    gather_f, gather_b = _coll(hw, "all_gather", c, kv, x_c), _coll(hw, "reduce_scatter", c, c * kv, x_c)
    a2a = 2 * q + (1 - y_c) * kv + y_c * 2 * tokens * h / t * cb
    a2a_t = _coll(hw, "all_to_all", c, a2a, x_c)
    a_c = 1 - r_c - g_c
    fwd = r_c * ring_f + g_c * gather_f + a_c * a2a_t
    bwd = r_c * ring_b + g_c * gather_b + a_c * a2a_t
    fwd_bytes = r_c * (c - 1) * kv + g_c * kv + a_c * a2a
    bwd_bytes = r_c * (c - 1) * kv * (1 + 4 / cb) + g_c * c * kv + a_c * a2a
    saved = g_c * (1 - rs - rf) * (c - 1) * kv
    return (u_c * (fwd * (1 + rf) + bwd), u_c * (fwd_bytes * (1 + rf) + bwd_bytes), u_c * saved)


_INPUTS = sympy.symbols("T s h kvd t c_kv cb rf rs", positive=True)


@functools.lru_cache(maxsize=None)
def _compiled(hw: Hardware):
    return sympy.lambdify(_INPUTS + CP_SYMBOLS, cp_layer_terms(hw, *_INPUTS), modules="math")  # small: no cse


def cp_numbers(hw: Hardware, shape, cp: int, method: str, tokens: float, tp: int, kv_split: int, cb: float,
               remat: str) -> tuple:
    """CP_TERMS' numbers (a layer's cp seconds, bytes and saved bytes per micro-batch; zeros without cp) for a
    ModelShape on a mesh with this cp and tp (`tokens` s·b, `kv_split` c_kv's value), after checking what the
    runtime would refuse."""
    if cp == 1:
        return (0, 0, 0)
    values = cp_values(cp, method, tp, shape.heads, shape.kv_heads, shape.seq, kv_split, hw.spans_nodes(tp, cp))
    return tuple(_compiled(hw)(tokens, shape.seq, shape.hidden, shape.kv_heads * shape.hidden / shape.heads, tp,
                               kv_split, cb, int(remat == "full"), int(remat == "selective"), *values))


def cp_values(cp: int, method: str, tp: int, heads: int, kv_heads: int, seq: int, kv_split: int,
              spans_nodes: bool) -> tuple:
    """The numbers for CP_SYMBOLS, after checking what the runtime would refuse; `kv_split` is c_kv's value."""
    if method not in METHODS:
        raise MeshcValueError(f"cost: expected cp_attention among {', '.join(METHODS)}, got {method!r}")
    if cp > 1 and seq % (2 * cp):
        raise MeshcValueError(f"cost: expected the sequence divisible by 2·cp = {2 * cp} (zigzag chunks), got {seq}")
    if cp > 1 and method == "all_to_all" and (heads // tp) % cp:
        raise MeshcValueError(f"cost: all_to_all attention needs the heads of a tp rank ({heads // tp}) divisible by "
                              f"cp = {cp}; choose cp_attention='ring'")
    return (cp, int(cp > 1), int(spans_nodes), int(method == "ring"), int(method == "all_gather"),
            int((kv_heads // kv_split) % cp != 0))
