"""The cost model: per-rank memory and step time of a plan, as sympy expressions, then evaluated.

Two paths give the same `Estimate`:
  formula   from a ModelShape (layers, hidden, heads, kv heads, ffn, vocab, seq) with the standard
            formulas below, as sympy expressions in the model sizes, batch, mesh sizes and plan
            choices; lambdified once per hardware profile, so the planner scores thousands of plans a second.
  compiled  from a compiled Program (compiler/cost/compiled.py): every parameter's local bytes, every
            collective the passes recorded (kind, axis, bytes, count), FLOPs and bytes of every node of
            the rank's graph, the schedule simulated with the stages' own costs.

Terms (symbols): L layers, h hidden, a heads, k kv heads, f ffn width, V vocab, s sequence, E experts
(K active per token), B global batch in sequences, N dp (every rank of the gradient reduction: ep's and cp's
too), t tp, p pp, m micro-batches, v virtual stages, c cp, b = B/(N·m) micro-batch size per rank (fractional
under cp, where c ranks share each sequence: s·b is still the rank's tokens). Plan choices enter as 0/1 indicators: z1 z2 z3 (ZeRO stage), rs rf
(selective / full recompute), sp (sequence parallel), vp (vocabulary parallel). Bytes per parameter:
pb (compute copy), gb (gradient), ko (optimizer: master copy and Adam's two moments); cb bytes per
activation element. I_f, I_l: micro-batches of activations the first and last pp ranks hold at peak;
β: the bubble, idle over busy time (closed forms below, checked against the schedule simulator).
Mesh facts, also 0/1: o (one pp stage holds the whole model), w (the V placement of zbv and dualpipev: the first
pp rank holds the last stage too), u_t u_n u_p (the tp, dp, pp axis has more
than one rank), q (the pipeline executor runs: pp > 1 or m > 1), x_t x_n x_p (the tp, dp, pp groups span
nodes); c_kv: how many ways the k/v projections are split (t, or 1 where there are fewer kv heads than t);
u_c, x_c, r_c, g_c, y_c: context parallelism's (compiler/cost/cp.py).
Indicators rather than sympy.Piecewise keep every expression a polynomial-like form that lambdify turns
into straight-line code.

Formulas:
  model states (ZeRO §5, per rank, Ψ_r this rank's tp-local parameters):
      pb·Ψ_r·(1 − z3 + z3/N) + gb·Ψ_r·(1 − z2 − z3 + (z2+z3)/N) + ko·Ψ_r·(1 − z + z/N),  z = z1+z2+z3
      (mixed precision pb=2, gb=2, ko=12: DP 16Ψ, ZeRO-1 4Ψ+12Ψ/N, ZeRO-2 2Ψ+14Ψ/N, ZeRO-3 16Ψ/N)
  activations per layer per micro-batch (Korthikanti et al. 2022 generalized to GQA, gated MLPs and
      flash attention, without dropout masks), in elements of s·b: no recompute, tensor parallel
      4h + (2h + 2k·h/a + (2 + 2·gated)·K·f)/t, with sequence parallelism all of it over t; selective
      (meshc: matmul and tp-collective outputs kept) (h + 2kh/a + (1+gated)Kf)/t + 2h + (2h + h)/t_sp;
      full recompute the block input h/t_sp.
  mixture of experts: each expert's matrices are split over tp like an MLP's (the grouped matmul's rule), so
      an MoE layer's expert weights, FLOPs and activations are divided by t. Expert parallelism (e
      ranks of dp, passes/experts.py) divides the expert weights X = E·(2|3)·h·f per layer by e too; with e > 1
      (u_e) ZeRO shards them over the N/e ranks holding the same experts (the rest of Ψ over N), and their
      gradients are reduced over those N/e ranks,
      and each layer's rows s·b·K·h cross e ranks by all-to-all 4 times per micro-batch (dispatch and
      combine, forward and backward), balanced routing.
  context parallelism (c ranks of dp per batch slice, passes/context.py; not with ep): activations, FLOPs
      and model states as above with b = B/(N·m) (each rank's s·b tokens, every parameter replicated over cp,
      gradients reduced over all of N); T_cp, each attention layer's cp traffic (compiler/cost/cp.py):
      ring (c−1) sends of the rank's K,V forward, twice that backward, each hidden behind one block of the
      attention as far as `overlap` goes; all_gather an all-gather of K,V and a reduce-scatter of c·K,V (and
      c·K,V saved without remat); all_to_all 2 exchanges of (2q + K,V); m·L/p·(forward·(1 + rf) + backward).
  bubble: GPipe and 1F1B (p−1)/m, interleaved (p−1)/(v·m), ZB-H1 (p−1)/(3m) for m ≥ p and (2p−1−m)/(3m)
      below, ZBV max(p−1, 2(2p−1−m))/(6m) (half ZB-H1's once m ≥ 2p − 1); all equal to the simulator's.
  in flight: GPipe m; 1F1B min(m, p) on the first rank, 1 on the last; ZB-H1 min(m, p) on both; ZBV
      min(m+1, 2p) first and min(2m, 2p) last (stage-sets of L/(2p) layers; rank 0 holds the head's logits, w);
      DualPipeV (m ≥ 2p) ZBV's bubble and 2p + 1 stage-sets;
      interleaved min(v·m, v·p + p − 1) first and min(v·m, (v−1)·p + 1) last (stage-sets of L/(p·v) layers).
  step time: m·t_mb·(1 + β) + T_tp + T_ep + T_cp + T_pp + max(0, T_dp − overlap·m·t_mb) + T_step + T_opt, with
      t_mb = (3·(FLOPs/F + bytes/BW) + ops·τ)·κ, κ the profile's calibrated compute_scale (+ a forward again under full recompute, + its
      memory-bound part under selective), FLOPs per layer 2·s·b·(matmul weights) + 4·s²·b·h/t;
      T_tp: 4 collectives of s·b·h per layer and micro-batch (6 with full recompute: Megatron's f/g);
      T_dp: meshc reduces per micro-batch (DP all-reduce, ZeRO-2 reduce-scatter, ZeRO-3 2 all-gathers +
      a reduce-scatter) and at the step (ZeRO-1/2 all-gather, ZeRO-1 reduce-scatter); under hybrid sharding
      (Plan.replicas = R) those run over S = N/R ranks (the shard group, x_s where it spans nodes), ZeRO's states
      are divided by S, and each reduced gradient shard is all-reduced over the R replica groups (x_r);
      T_pp: (2(p−1) + 2(m−1)(1 − overlap)) sends of the boundary activation, twice that under a V (w: 2p − 2
      rank boundaries each way, 2m messages per rank and direction).
  collectives: hardware.Link's α-β model; a group uses the inter-node link once it spans nodes (tp
      groups are consecutive ranks, dp groups stride t, pp groups stride N·t), which is what puts
      tensor parallelism inside a node and pipeline parallelism across nodes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import sympy
from sympy import Max, Min

from meshc.compiler.cost.cp import CP_TERMS, cp_layer_terms, cp_numbers
from meshc.compiler.cost.hardware import Hardware
from meshc.compiler.cost.vocab import decide_from_shape
from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.schedule import V_SHAPED

OPS_PER_LAYER = 30  # compute ops per transformer block in a traced graph (views excluded): τ's multiplier

SYMBOLS = sympy.symbols("L h a k f V s E K P_pos B N t p m v I_f I_l beta z1 z2 z3 rs rf sp vp pb gb ko cb "
                        "o u_t u_n u_p q c_kv x_t x_n x_p e x_e u_e R x_s x_r u_r w", positive=True)
(L, h, a, k, f, V, s, E, K, P_pos, B, N, t, p, m, v, I_f, I_l, beta,
 z1, z2, z3, rs, rf, sp, vp, pb, gb, ko, cb, o, u_t, u_n, u_p, q, c_kv, x_t, x_n, x_p, e, x_e, u_e,
 R, x_s, x_r, u_r, w) = SYMBOLS
MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "buffers")
TIME_KEYS = ("compute", "recompute", "bubble", "tp", "ep", "cp", "pp", "dp", "step", "optimizer", "overhead")


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes of a decoder-only transformer that the formulas need.

    gated: SwiGLU MLP (3 matrices; Llama, Mixtral) rather than a GELU MLP (2); experts/top_k: a mixture
    of experts (each token through top_k of them); tied: LM head shares the embedding; positions: rows of
    a learned position table (GPT-2) or 0; bias: linear layers have biases; norm: "layer" or "rms".
    """

    name: str = "model"
    layers: int
    hidden: int
    heads: int
    kv_heads: int | None = None
    ffn: int | None = None
    vocab: int
    seq: int
    gated: bool = False
    experts: int = 1
    top_k: int = 1
    tied: bool = False
    positions: int = 0
    bias: bool = False
    norm: str = "layer"

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab", "seq", "experts", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MeshcValueError(f"ModelShape.{name}: expected a positive int, got {value!r}")
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.ffn is None:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise MeshcValueError(f"ModelShape: expected hidden divisible by heads and heads by kv_heads, got hidden="
                                  f"{self.hidden}, heads={self.heads}, kv_heads={self.kv_heads}")
        if self.norm not in ("layer", "rms"):
            raise MeshcValueError(f"ModelShape.norm: expected 'layer' or 'rms', got {self.norm!r}")

    def values(self) -> dict:
        """Numbers for the model's symbols."""
        return {L: self.layers, h: self.hidden, a: self.heads, k: self.kv_heads, f: self.ffn, V: self.vocab,
                s: self.seq, E: self.experts, K: self.top_k, P_pos: self.positions}

    def flags(self) -> tuple:
        """The structural choices that select formulas (a cache key)."""
        return (self.gated, self.tied, self.bias, self.norm, self.experts > 1)

    def params(self) -> int:
        """Parameters of the whole model (Ψ)."""
        expr = total_params(self.flags()).subs(self.values())
        return int(expr)

    @staticmethod
    def from_hf_config(cfg, seq: int | None = None, name: str = "model") -> "ModelShape":
        """From a transformers config (Llama, Mistral, Mixtral, Qwen, GPT-2, ... field names)."""
        get = lambda *names, default=None: next((getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None),
                                                default)
        hidden = get("hidden_size", "n_embd", "d_model")
        heads = get("num_attention_heads", "n_head")
        gpt2 = getattr(cfg, "model_type", "") == "gpt2"
        experts = get("num_local_experts", "num_experts", default=1)
        return ModelShape(
            name=name, layers=get("num_hidden_layers", "n_layer"), hidden=hidden, heads=heads,
            kv_heads=get("num_key_value_heads", default=heads),
            ffn=get("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden), vocab=get("vocab_size"),
            seq=seq or get("max_position_embeddings", "n_positions", default=2048), gated=not gpt2,
            experts=experts, top_k=get("num_experts_per_tok", default=1) if experts > 1 else 1,
            tied=bool(get("tie_word_embeddings", default=gpt2)),
            positions=get("n_positions", default=0) if gpt2 else 0, bias=gpt2, norm="layer" if gpt2 else "rms")


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Bytes per element: compute parameter, gradient, optimizer (master copy + Adam moments), activation."""

    param: float = 4
    grad: float = 4
    optimizer: float = 8
    activation: float = 4

    def __post_init__(self) -> None:
        for name in ("param", "grad", "optimizer", "activation"):
            if not getattr(self, name) > 0:
                raise MeshcValueError(f"Precision.{name}: expected bytes > 0, got {getattr(self, name)!r}")


FP32 = Precision()  # meshc without param_dtype: fp32 parameters are their own masters
MIXED = Precision(param=2, grad=2, optimizer=12, activation=2)  # the ZeRO paper's 2 + 2 + 12


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """Predicted per-rank memory (bytes, the fullest rank) and step time (seconds), by part.

    memory: params, grads, optimizer, activations, buffers (communication buckets, pipeline messages).
    time: compute (forward + backward), recompute, bubble, tp, ep, cp (context attention's traffic, exposed),
    pp, dp (exposed), step (optimizer-step
    collectives, loss average), optimizer (the update itself), overhead (the runtime's, per step and per
    pipeline action).
    """

    source: str
    memory: dict[str, float]
    time: dict[str, float]
    flops: float = 0.0  # per rank per step
    comm_bytes: dict[str, float] = field(default_factory=dict)  # payload per step by axis
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.source not in ("formula", "compiled"):
            raise MeshcValueError(f"Estimate.source: expected 'formula' or 'compiled', got {self.source!r}")
        if any(value < -1e-9 for value in list(self.memory.values()) + list(self.time.values())):
            raise MeshcValueError(f"Estimate: expected non-negative parts, got memory {self.memory}, time {self.time}")

    @property
    def total_memory(self) -> float:
        return float(sum(self.memory.values()))

    @property
    def step_time(self) -> float:
        return float(sum(self.time.values()))

    @property
    def model_state(self) -> float:
        return float(self.memory["params"] + self.memory["grads"] + self.memory["optimizer"])

    def lines(self) -> list[str]:
        from meshc.compiler.ir.show import human_bytes

        mem = ", ".join(f"{key} {human_bytes(value)}" for key, value in self.memory.items() if value)
        tim = ", ".join(f"{key} {_seconds(value)}" for key, value in self.time.items() if value > 0)
        return [f"memory per rank {human_bytes(self.total_memory)} ({mem})",
                f"step time {_seconds(self.step_time)} ({tim})"] + list(self.notes)


def _seconds(x: float) -> str:
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


# ---------------------------------------------------------------------------------------------- formulas
def _layer_params(flags, tp=t, kv=None, ep=e):
    gated, _tied, bias, norm, moe = flags
    kvd = k * h / a
    kv_div = c_kv if kv is None else kv
    mats, mlp_div = 3 if gated else 2, ep * tp if moe else tp  # experts over ep, each expert's matrices over tp
    attn = 2 * h * h / tp + 2 * h * kvd / kv_div
    mlp = E * mats * h * f / mlp_div
    if bias:
        attn, mlp = attn + h / tp + 2 * kvd / kv_div + h, mlp + f / mlp_div + h
    if moe:
        mlp += h * E  # the router, replicated
    return attn + mlp + 2 * (2 if norm == "layer" else 1) * h


@functools.lru_cache(maxsize=None)
def total_params(flags) -> sympy.Expr:
    """Ψ: parameters of the whole model."""
    _gated, tied, _bias, norm, _moe = flags
    nw = 2 if norm == "layer" else 1
    return L * _layer_params(flags, tp=1, kv=1, ep=1) + V * h + P_pos * h + (0 if tied else V * h) + nw * h


def model_state_bytes(psi, n, zero: int, precision: Precision = MIXED) -> dict[str, float]:
    """ZeRO §5: bytes of parameters, gradients and optimizer states one of n dp ranks holds."""
    zs = {1: (1, 0, 0), 2: (0, 1, 0), 3: (0, 0, 1)}.get(zero, (0, 0, 0))
    expr = _states(psi, *zs, n, precision.param, precision.grad, precision.optimizer)
    return {key: float(value) for key, value in expr.items()}


def _states(psi, zz1, zz2, zz3, n, pbb, gbb, kob) -> dict:
    z = zz1 + zz2 + zz3
    return {"params": pbb * psi * (1 - zz3 + zz3 / n),
            "grads": gbb * psi * (1 - zz2 - zz3 + (zz2 + zz3) / n),
            "optimizer": kob * psi * (1 - z + z / n)}


def _expert_params(flags):
    """X/e: one layer's expert weights a rank of an ep group holds (0 without experts)."""
    gated, *_rest, moe = flags
    return E * (3 if gated else 2) * h * f / (e * t) if moe else 0


def _activations_per_layer(flags):
    """Bytes of one layer's saved activations for one micro-batch on one rank: (under the remat policy, none)."""
    gated, *_rest, moe = flags
    kvd, b = k * h / a, B / (N * m)
    t_sp, mlp_div = 1 + sp * (t - 1), t
    attn = 2 * h + 2 * kvd  # q, k, v, attention out
    mlp = (4 if gated else 2) * K * f  # MLP internals
    none = sp * (4 * h + attn) / t + (1 - sp) * (4 * h + attn / t) + mlp / mlp_div
    selective = (h + 2 * kvd) / t + (2 if gated else 1) * K * f / mlp_div + 2 * h + (2 * h * u_t + h) / t_sp
    full = h / t_sp
    return cb * s * b * ((1 - rs - rf) * none + rs * selective + rf * full), cb * s * b * none


def _stage_params(flags):
    """(Ψ first pp rank, Ψ last pp rank, Ψ of one layer), tp-local. Under zbv (w) the first rank holds the last
    stage's final norm and head as well (a tied head is the embedding itself there), the last rank only layers."""
    _gated, tied, _bias, norm, _moe = flags
    layer = _layer_params(flags)
    v_div = 1 + vp * (t - 1)
    emb, head, fin = V * h / v_div + P_pos * h, V * h / v_div, (2 if norm == "layer" else 1) * h
    first = L / p * layer + emb + (o + w) * ((0 if tied else head) + fin)
    last = o * first + (1 - o) * (L / p * layer + (1 - w) * (fin + head))  # a tied head is a copy on the last stage
    return first, last, layer


def _coll(hw: Hardware, kind: str, n, payload, crossing):
    """Collective time over n ranks: the intra-node link, or the inter-node one where `crossing` is 1."""
    return (1 - crossing) * hw.intra.time(kind, n, payload) + crossing * hw.inter.time(kind, n, payload)


@functools.lru_cache(maxsize=None)
def formulas(hw: Hardware, flags, inline: bool = True) -> dict[str, sympy.Expr]:
    """Every part of memory (of the first and of the last pp rank) and of step time as a sympy expression
    (hardware constants as numbers). Not `inline`: a layer's cp terms stand as the symbols CP_TERMS, which
    formula_values evaluates apart (cp.cp_numbers), so that plans without cp pay nothing for them."""
    gated, tied, *_ = flags
    b, t_sp, v_div = B / (N * m), 1 + sp * (t - 1), 1 + vp * (t - 1)
    first, last, layer = _stage_params(flags)
    act_layer, act_none = _activations_per_layer(flags)
    kvd = k * h / a
    cp_layer, cp_bytes, cp_saved = cp_layer_terms(hw, s * b, s, h, kvd, t, c_kv, cb, rf, rs) if inline else CP_TERMS
    zz = z1 + z2 + z3
    logits = s * b * V / v_div * (cb + 4)
    experts = u_e * L / p * _expert_params(flags)  # sharded over ep > 1: ZeRO divides them over N/e only
    S = N / R  # ZeRO's shard group: all of dp, or one of R replica groups under hybrid sharding
    sf, sl = (_plus(_states(x - experts, z1, z2, z3, S, pb, gb, ko), _states(experts, z1, z2, z3, N / e, pb, gb, ko))
              for x in (first, last))
    psi = Max(first, last, evaluate=False) - experts
    boundary = s * b * h * cb / t_sp
    bucket = Min(25 * 2**20, psi * gb, evaluate=False)  # the compiled path sizes buckets per device (cost/buckets.py)
    buffers = (1 - zz) * 2 * bucket * u_n + z2 * bucket + z3 * (2 * layer * pb + V * h / v_div * pb) + u_p * 2 * boundary
    # time of one micro-batch on the busiest stage
    mm = 2 * h * h / t + 2 * h * kvd / c_kv + K * (3 if gated else 2) * h * f / t
    layer_flops = 2 * s * b * mm + 4 * s * s * b * h / t
    layer_bytes = 2 * act_none + layer * pb
    head_flops, head_bytes = 2 * s * b * h * V / v_div, 2 * logits + V * h / v_div * pb
    fwd = L / p * (layer_flops / hw.flops + layer_bytes / hw.mem_bandwidth) + head_flops / hw.flops \
        + head_bytes / hw.mem_bandwidth
    ops = L / p * OPS_PER_LAYER + 10
    t_mb = (3 * fwd + ops * hw.op_overhead) * hw.compute_scale
    recompute = (rf * (fwd + ops * hw.op_overhead / 3) + rs * (L / p * layer_bytes / hw.mem_bandwidth
                                                               + ops * hw.op_overhead / 3)) * hw.compute_scale
    act_payload = s * b * h * cb
    tp_one = ((1 - sp) * _coll(hw, "all_reduce", t, act_payload, x_t)
              + sp * (_coll(hw, "reduce_scatter", t, act_payload, x_t) + _coll(hw, "all_gather", t, act_payload / t, x_t)))
    tp_time = m * (L / p * (4 + 2 * rf) * tp_one + vp * _coll(hw, "all_reduce", t, act_payload, x_t))
    grads, shard = psi * gb, psi * pb / S

    def data_parallel(grads, shard, n, x=x_n):  # the backward's reductions of `grads` over n ranks, and the step's
        bwd = m * ((1 - zz) * _coll(hw, "all_reduce", n, grads, x) + z2 * _coll(hw, "reduce_scatter", n, grads, x)
                   + z3 * (2 * _coll(hw, "all_gather", n, shard, x) + _coll(hw, "reduce_scatter", n, grads, x)))
        step = (z1 + z2) * _coll(hw, "all_gather", n, shard, x) + z1 * _coll(hw, "reduce_scatter", n, grads, x)
        return bwd, step
    dp_bwd, dp_step = data_parallel(grads, shard, S, x_s)
    # hybrid sharding: each reduce-scattered gradient shard all-reduced over the R replica groups (in backward under
    # ZeRO-2/3, once per micro-batch; at the step under ZeRO-1); nothing where R = 1
    replica = _coll(hw, "all_reduce", R, grads / S, x_r)
    dp_bwd, dp_step = dp_bwd + m * (z2 + z3) * replica, dp_step + z1 * replica
    if flags[4]:  # experts sharded over ep: their replicas are the N/e ranks of an edp group
        ex_bwd, ex_step = data_parallel(experts * gb, experts * pb * e / N, N / e)
        dp_bwd, dp_step = dp_bwd + u_e * ex_bwd, dp_step + u_e * ex_step
    a2a_payload = s * b * K * h * cb if flags[4] else 0
    ep_time = m * L / p * (4 + 2 * rf) * _coll(hw, "all_to_all", e, a2a_payload, x_e) if flags[4] else sympy.Integer(0)
    dp_step = dp_step + _coll(hw, "all_reduce", N, 4, x_n)
    send = _coll(hw, "send", 2, boundary, x_p)  # neighbouring stages are N·t ranks apart
    pp_time = u_p * (1 + w) * (2 * (p - 1) + 2 * (m - 1) * (1 - hw.overlap)) * send  # a V crosses each rank twice
    if tied:  # the tied embedding and head on the first and the last pp rank: not under zbv, where both are rank 0's
        pp_time += u_p * (1 - w) * _coll(hw, "all_reduce", 2, V * h / v_div * gb, x_p)
    compute = m * (t_mb + recompute)
    return {
        **{f"{key}_first": value for key, value in sf.items()},
        "activations_first": I_f * L / (p * v) * (act_layer + cp_saved) + w * logits,
        **{f"{key}_last": value for key, value in sl.items()},
        "activations_last": I_l * L / (p * v) * (act_layer + cp_saved) + (1 - w) * logits * I_l / v, "buffers": buffers,
        "compute": m * t_mb, "recompute": m * recompute, "bubble": beta * compute, "tp": tp_time, "ep": ep_time,
        "cp": m * L / p * cp_layer, "cp_bytes": m * L / p * cp_bytes, "pp": pp_time,
        "dp": Max(0, dp_bwd - hw.overlap * compute, evaluate=False), "step": dp_step,
        "optimizer_time": hw.adam_time(psi * (1 - zz + zz / S) + experts * (1 - zz + zz * e / N)),
        "overhead": hw.step_overhead + q * 2 * m * hw.action_overhead,
        "flops": 3 * m * (L / p * layer_flops + head_flops) + rf * m * L / p * layer_flops,
        "dp_bytes": m * ((1 - zz) * grads + z2 * grads + z3 * (2 * shard + grads)) + (z1 + z2) * shard + z1 * grads
        + u_r * (m * (z2 + z3) + z1) * grads / S,
        "tp_bytes": m * L / p * (4 + 2 * rf) * act_payload * u_t,
        "edp_bytes": m * experts * gb, "ep_bytes": u_e * m * L / p * (4 + 2 * rf) * a2a_payload,
    }


def _plus(x: dict, y: dict) -> dict:
    return {key: x[key] + y[key] for key in x}


ARGS = (L, h, a, k, f, V, s, E, K, P_pos, B, N, t, p, m, v, I_f, I_l, beta, z1, z2, z3, rs, rf, sp, vp, pb, gb, ko, cb,
        o, u_t, u_n, u_p, q, c_kv, x_t, x_n, x_p, e, x_e, u_e, R, x_s, x_r, u_r, w) + CP_TERMS
PARTS = ("params", "grads", "optimizer", "activations")
OUT_KEYS = tuple(f"{x}_{r}" for r in ("first", "last") for x in PARTS) + (
    "buffers", "compute", "recompute", "bubble", "tp", "ep", "cp", "pp", "dp", "step", "optimizer_time", "overhead",
    "flops", "dp_bytes", "tp_bytes", "edp_bytes", "ep_bytes", "cp_bytes")


@functools.lru_cache(maxsize=None)
def compiled_formulas(hw: Hardware, flags):
    """The formulas as one fast Python function of ARGS (sympy.lambdify)."""
    exprs = formulas(hw, flags, inline=False)
    return sympy.lambdify(ARGS, [exprs[key] for key in OUT_KEYS], modules="math", cse=True)


MEMORY_OUT = OUT_KEYS[:9]  # the memory parts of the first and the last pp rank, then the buffers


@functools.lru_cache(maxsize=None)
def compiled_memory(hw: Hardware, flags):
    """The memory formulas alone (MEMORY_OUT) as one Python function of ARGS: a few times cheaper than
    compiled_formulas, for the planner to set aside plans that cannot fit before timing them."""
    exprs = formulas(hw, flags, inline=False)
    return sympy.lambdify(ARGS, [exprs[key] for key in MEMORY_OUT], modules="math", cse=True)


def schedule_terms(schedule: str, pp: int, m: int, virtual: int = 1) -> tuple[float, float, float]:
    """(I_f, I_l, β) of a schedule: closed forms where they hold exactly, the simulator otherwise."""
    if pp == 1:
        return 1.0, 1.0, 0.0
    if schedule == "gpipe":
        return float(m), float(m), (pp - 1) / m
    if schedule == "1f1b":
        return float(min(m, pp)), 1.0, (pp - 1) / m
    if schedule == "interleaved":
        return (float(min(virtual * m, virtual * pp + pp - 1)), float(min(virtual * m, (virtual - 1) * pp + 1)),
                (pp - 1) / (virtual * m))
    if schedule == "zb-h1":  # below m = p the ramp is not covered: 2(2p-1-m) idle F-units per rank over 6m
        return float(min(m, pp)), float(min(m, pp)), max(2 * (pp - 1), 2 * (2 * pp - 1 - m)) / (6 * m)
    if schedule == "zbv":  # stage-sets of half a rank's layers; the V is full from m = 2p-1
        return float(min(m + 1, 2 * pp)), float(min(2 * m, 2 * pp)), max(pp - 1, 2 * (2 * pp - 1 - m)) / (6 * m)
    if schedule == "dualpipev" and m >= 2 * pp:  # zbv's bubble, one stage-set more held (it needs m >= 2p)
        return float(2 * pp + 1), float(2 * pp + 1), (pp - 1) / (6 * m)
    return _simulated_terms(schedule, pp, m, virtual)


@functools.lru_cache(maxsize=4096)
def _simulated_terms(schedule: str, pp: int, m: int, virtual: int) -> tuple[float, float, float]:
    from meshc.compiler.ir.named_schedule import unchecked
    from meshc.compiler.ir.schedule_sim import simulate

    result = simulate(unchecked(schedule, pp, m, virtual))  # simulate proves the schedule as it runs it
    return float(result.peak_in_flight[0]), float(result.peak_in_flight[-1]), float(result.bubble)


def precision_of(plan) -> Precision:
    """meshc's bytes per element for a Plan: fp32 masters, or mixed precision with fp32 master shards."""
    return precision_for(plan.param_dtype, plan.reduce_dtype)


@functools.lru_cache(maxsize=64)
def precision_for(param_dtype, reduce_dtype=None) -> Precision:
    """precision_of a Plan with these dtypes."""
    if param_dtype is None:
        return FP32
    size = param_dtype.itemsize
    return Precision(param=size, grad=(reduce_dtype or param_dtype).itemsize, optimizer=12, activation=size)


def formula_values(shape: ModelShape, sizes: tuple, choice: tuple, batch: int, hw: Hardware,
                   precision: Precision) -> tuple:
    """The numbers for ARGS. `sizes` (dp, tp, pp), (dp, tp, pp, ep) or (dp, tp, pp, ep, cp); `choice`
    (microbatches, schedule, virtual, zero, remat, sequence_parallel, vocab_parallel[, cp_attention]), a Plan's
    fields the formulas read."""
    n, tp, pp = sizes[0], sizes[1], sizes[2]
    ep, cp = sizes[3] if len(sizes) > 3 else 1, sizes[4] if len(sizes) > 4 else 1
    mb, schedule, virtual, zero, remat, sp_, vp_ = choice[:7]
    replicas = choice[8] if len(choice) > 8 else 1
    if replicas > 1 and (n % replicas or ep > 1 or zero == 0):
        raise MeshcValueError(f"cost: expected replicas dividing dp × cp, with ZeRO and without ep, got dp={n}, "
                              f"replicas={replicas}, ep={ep}, zero={zero}")
    if vp_ is None:  # Plan(vocab_parallel=None): the cost model's choice, as the compiled graph's decision makes it
        vp_ = decide_from_shape(hw, tp, batch * shape.seq // (n * mb), shape.hidden, shape.vocab, shape.tied)
    if cp > 1 and (n % cp or ep > 1):
        raise MeshcValueError(f"cost: expected cp dividing dp and not with ep > 1, got dp={n}, ep={ep}, cp={cp}")
    if batch % (n // cp * mb):
        raise MeshcValueError(f"cost: expected the global batch divisible by dp/cp × microbatches = {n // cp * mb}, "
                              f"got {batch}")
    kv_split = tp if shape.kv_heads >= tp else 1
    cps = (0, 0, 0) if cp == 1 else cp_numbers(hw, shape, cp, choice[7] if len(choice) > 7 else "ring",
                                               shape.seq * batch / (n * mb), tp, kv_split, precision.activation, remat)
    i_f, i_l, bub = schedule_terms(schedule, pp, mb, virtual)
    head, mesh = _fixed_values(shape, batch, n, tp, pp, ep, hw)
    hybrid = (replicas, int(hw.spans_nodes(tp, n // replicas)), int(hw.spans_nodes(tp * n // replicas, replicas)),
              int(replicas > 1))
    return (head + (mb, virtual, i_f, i_l, bub,
            int(zero == 1), int(zero == 2), int(zero == 3), int(remat == "selective"), int(remat == "full"),
            int(sp_), int(vp_), precision.param, precision.grad, precision.optimizer, precision.activation,
            int(pp == 1), int(tp > 1), int(n > 1), int(pp > 1), int(pp > 1 or mb > 1))
            + mesh + hybrid + (int(schedule in V_SHAPED and pp > 1),) + cps)


@functools.lru_cache(maxsize=4096)
def _fixed_values(shape: ModelShape, batch: int, n: int, tp: int, pp: int, ep: int, hw: Hardware) -> tuple:
    """The parts of formula_values that one mesh's plans share (the planner scores thousands per mesh): the
    model's and mesh's numbers up to p, and c_kv .. u_e."""
    head = (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.ffn, shape.vocab, shape.seq,
            shape.experts, shape.top_k, shape.positions, batch, n, tp, pp)
    mesh = (tp if shape.kv_heads >= tp else 1, int(hw.spans_nodes(1, tp)), int(hw.spans_nodes(tp, n)),
            int(hw.spans_nodes(1, n * tp * pp) and pp > 1), ep, int(hw.spans_nodes(tp, ep)), int(ep > 1))
    return head, mesh


def plan_choice(plan) -> tuple:
    """The fields of a Plan that formula_values reads, in its order."""
    return (plan.microbatches, plan.schedule, plan.virtual, plan.zero, plan.remat, plan.sequence_parallel,
            plan.vocab_parallel, plan.cp_attention, plan.replicas)


def _pick_rank(out) -> list[float]:
    """The memory parts (PARTS) of the fuller of the first and the last pp rank."""
    firsts, lasts = [float(x) for x in out[0:4]], [float(x) for x in out[4:8]]
    return firsts if sum(firsts) >= sum(lasts) else lasts


def formula_memory(shape: ModelShape, sizes: tuple, choice: tuple, batch: int, hw: Hardware,
                   precision: Precision) -> float:
    """formula_estimate(...).total_memory from the memory formulas alone (the same sum, in the same order)."""
    values = formula_values(shape, sizes, choice, batch, hw, precision)
    return _memory(compiled_memory(hw, shape.flags())(*values))


def _memory(out) -> float:
    return float(sum(_pick_rank(out) + [float(out[8])]))


def formula_functions(hw: Hardware, flags) -> tuple:
    """(memory, estimate): formula_memory and formula_estimate of formula_values already computed, for one model's
    flags on one profile (the planner scores many plans with them)."""
    memory, full = compiled_memory(hw, flags), compiled_formulas(hw, flags)
    return lambda values: _memory(memory(*values)), lambda values: _estimate(full(*values))


def formula_estimate(shape: ModelShape, sizes: dict[str, int], plan, batch: int, hw: Hardware,
                     precision: Precision | None = None) -> Estimate:
    """Evaluate the formulas for one plan: `sizes` {"dp", "tp", "pp"} (and "ep" or "cp"), `batch` global
    sequences. Memory is that of the fuller of the first and the last pp rank."""
    mesh = tuple(int(sizes.get(x, 1)) for x in ("dp", "tp", "pp", "ep", "cp"))
    values = formula_values(shape, mesh, plan_choice(plan), batch, hw, precision or precision_of(plan))
    return _estimate(compiled_formulas(hw, shape.flags())(*values))


_TIME_AT = tuple(zip(TIME_KEYS, (OUT_KEYS.index("optimizer_time" if x == "optimizer" else x) for x in TIME_KEYS)))
_BYTES_AT = tuple((x, OUT_KEYS.index(f"{x}_bytes")) for x in ("dp", "tp", "ep", "edp", "cp"))


def _estimate(out) -> Estimate:
    memory = dict(zip(PARTS, _pick_rank(out)))
    memory["buffers"] = float(out[8])
    return Estimate(source="formula", memory=memory, time={key: float(out[i]) for key, i in _TIME_AT},
                    flops=float(out[OUT_KEYS.index("flops")]),
                    comm_bytes={key: float(out[i]) for key, i in _BYTES_AT if key in ("dp", "tp") or out[i]})
