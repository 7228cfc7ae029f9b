"""meshc's fused kernels against the unfused torch sequence and torch.compile of it, on one GPU.

    python benchmarks/kernels_gpu.py [--peak-tbps 4.8] [--hidden 4096 8192] [--tokens 8192]
                                     [--dp 8] [--no-compile] [--kernels norm gelu ...]

bf16 activations at transformer sizes (tokens x hidden; MLP width 4h for GeLU, 8h/3 rounded to 256
for SwiGLU), and one Llama-like layer's parameters (4 h^2 attention + 3 h F MLP + 2 norms) sharded
dp ways for the ZeRO copies. Each case runs forward, and forward+backward where the op has one that
training uses (the ZeRO copies are each other's backward: pack_cast's is unpack's forward).

Bandwidth is effective: the bytes a fused kernel must move at least (each input read once, each output
written once; parameters, biases and statistics left out) divided by the time, the same bytes in every
column, so the columns compare as speeds; "% peak" divides by --peak-tbps (H200: 4.8 TB/s by the
datasheet; a device-to-device copy reaches ~4.3). Times are medians of triton.testing.do_bench (L2
flushed between runs). "meshc op" calls the public op with autograd, as eager code does, so the
custom-op dispatch, the autograd machinery and the Triton launches are counted: on an H200 host these
cost ~0.2 ms (forward) to ~0.9 ms (forward+backward) of CPU per call, more than the kernels below
~8192 x 8192. "meshc kernels" calls the Triton launchers directly: the kernels' own speed, what a
CUDA graph or a compiled stage would see. A check column compares meshc with eager torch where both
are deterministic (p = 0). Prints a markdown table; about a minute on one H200, most of it torch.compile.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

KERNELS = ("norm", "rmsnorm", "gelu", "swiglu", "pack_cast", "unpack", "grad_prologue")


@dataclass
class Case:
    """One benchmark: inputs, the three implementations and the bytes each pass must move."""

    name: str
    shape: str
    inputs: dict
    fns: dict[str, Callable]  # "eager" / "meshc": inputs -> output(s); compile is built from eager
    bytes_fwd: int
    bytes_bwd: int = 0  # 0: forward only
    grad_names: tuple = ()
    deterministic: bool = True
    kernels: dict = field(default_factory=dict)  # "fwd" / "fwd+bwd": no-arg direct Triton launches
    extra: dict = field(default_factory=dict)


def _randn(*shape, dtype=torch.bfloat16, grad=False):
    return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_(grad)


def norm_case(tokens, hidden, rms: bool) -> Case:
    from meshc.kernels.bias_dropout_add_norm import bias_dropout_add_norm, new_rng, triton_backward, triton_forward

    p = 0.0 if rms else 0.1  # Llama: RMSNorm, no bias, no dropout; GPT-style: LayerNorm, bias, dropout
    x, residual = _randn(tokens, hidden, grad=True), _randn(tokens, hidden, grad=True)
    weight, nb = _randn(hidden, grad=True), None if rms else _randn(hidden, grad=True)
    bias = None if rms else _randn(hidden, grad=True)

    def eager(x, bias, residual, weight, nb):
        h = x if bias is None else x + bias
        s = residual + (F.dropout(h, p) if p else h)
        y = F.rms_norm(s, (hidden,), weight, 1e-5) if rms else F.layer_norm(s, (hidden,), weight, nb, 1e-5)
        return y, s

    def meshc(x, bias, residual, weight, nb):
        return bias_dropout_add_norm(x, bias, residual, weight, nb, p=p, norm="rmsnorm" if rms else "layernorm")

    unit = tokens * hidden * 2
    names = ("x", "residual", "weight") + (() if rms else ("bias", "nb"))
    plain = [None if t is None else t.detach() for t in (x, bias, residual, weight, nb)]
    rng, norm, (dy, ds) = new_rng(x.device) if p else None, "rmsnorm" if rms else "layernorm", (x.detach(),) * 2

    def kernel_fwd_bwd():
        _, s = triton_forward(*plain, rng, p, norm, 1e-5)
        triton_backward(dy, ds, s, plain[3], rng, p, norm, 1e-5, x.dtype)

    return Case("rmsnorm" if rms else "norm",
                f"{tokens}x{hidden}" + (" rmsnorm p=0" if rms else " layernorm+bias p=0.1"),
                dict(x=x, bias=bias, residual=residual, weight=weight, nb=nb), dict(eager=eager, meshc=meshc),
                bytes_fwd=4 * unit, bytes_bwd=(4 if rms else 5) * unit, grad_names=names, deterministic=rms,
                kernels={"fwd": lambda: triton_forward(*plain, rng, p, norm, 1e-5), "fwd+bwd": kernel_fwd_bwd})


def gelu_case(tokens, hidden) -> Case:
    from meshc.kernels.bias_act import bias_gelu, triton_bias_gelu, triton_bias_gelu_backward

    feats = 4 * hidden
    x, bias = _randn(tokens, feats, grad=True), _randn(feats, grad=True)
    unit = tokens * feats * 2
    xd, bd = x.detach(), bias.detach()

    def kernel_fwd_bwd():
        triton_bias_gelu(xd, bd, "none")
        triton_bias_gelu_backward(xd, xd, bd, "none")

    return Case("gelu", f"{tokens}x{feats} erf+bias", dict(x=x, bias=bias),
                dict(eager=lambda x, bias: F.gelu(x + bias), meshc=lambda x, bias: bias_gelu(x, bias)),
                bytes_fwd=2 * unit, bytes_bwd=3 * unit, grad_names=("x", "bias"),
                kernels={"fwd": lambda: triton_bias_gelu(xd, bd, "none"), "fwd+bwd": kernel_fwd_bwd})


def swiglu_case(tokens, hidden) -> Case:
    from meshc.kernels.bias_act import bias_swiglu, triton_bias_swiglu, triton_bias_swiglu_backward

    feats = -(-8 * hidden // 3 // 256) * 256
    gate, up = _randn(tokens, feats, grad=True), _randn(tokens, feats, grad=True)
    unit = tokens * feats * 2
    a, v, dy = gate.detach(), up.detach(), torch.randn_like(gate.detach())

    def kernel_fwd_bwd():
        triton_bias_swiglu(a, v, None, None)
        triton_bias_swiglu_backward(dy, a, v, None, None)

    return Case("swiglu", f"{tokens}x{feats} no bias", dict(gate=gate, up=up),
                dict(eager=lambda gate, up: F.silu(gate) * up, meshc=lambda gate, up: bias_swiglu(gate, up)),
                bytes_fwd=3 * unit, bytes_bwd=5 * unit, grad_names=("gate", "up"),
                kernels={"fwd": lambda: triton_bias_swiglu(a, v, None, None), "fwd+bwd": kernel_fwd_bwd})


def layer_shapes(hidden):
    feats = -(-8 * hidden // 3 // 256) * 256
    return [(hidden, hidden)] * 4 + [(feats, hidden)] * 2 + [(hidden, feats), (hidden,), (hidden,)]


def zero_cases(hidden, dp) -> list[Case]:
    from meshc.kernels.grad_prologue import grad_prologue, triton_grad_prologue
    from meshc.kernels.zero_copy import pack_cast, triton_from_flat, triton_to_flat, unpack

    shapes = layer_shapes(hidden)
    numels = [s[0] * (s[1] if len(s) > 1 else 1) for s in shapes]
    shard = [-(-m // dp) for m in numels]
    offsets = [sum(shard[:i]) for i in range(len(shard))]
    total, full = sum(shard), sum(numels)
    shards = [_randn(n, dtype=torch.float32) for n in shard]
    gathered = _randn(dp * total)
    grads = [_randn(*s, dtype=torch.float32) for s in shapes]
    desc = f"h={hidden} layer, {full / 1e6:.0f}M params"

    def eager_unpack(gathered):
        rows = gathered.view(dp, total)
        return [rows[:, o:o + n].reshape(-1)[:m].view(s) for o, n, m, s in zip(offsets, shard, numels, shapes)]

    def eager_prologue(grads):
        flat = [(g.reshape(-1).float() * (1 / dp)).to(torch.bfloat16) for g in grads]
        return torch.cat(flat + [flat[0].new_zeros(-full % dp)])

    return [
        Case("pack_cast", f"{desc} / dp{dp}: fp32->bf16", dict(shards=shards),
             dict(eager=lambda shards: torch.cat([s.to(torch.bfloat16) for s in shards]),
                  meshc=lambda shards: pack_cast(shards, torch.bfloat16)), bytes_fwd=6 * total,
             kernels={"fwd": lambda: triton_to_flat(shards, torch.bfloat16, 1, shard)}),
        Case("unpack", f"{desc}: bf16 from dp{dp}", dict(gathered=gathered),
             dict(eager=eager_unpack, meshc=lambda gathered: unpack(gathered, shapes, world_size=dp)),
             bytes_fwd=4 * full,
             kernels={"fwd": lambda: triton_from_flat(gathered, [list(s) for s in shapes], torch.bfloat16, shard)}),
        Case("grad_prologue", f"{desc}: fp32->bf16 x1/{dp}", dict(grads=grads),
             dict(eager=eager_prologue, meshc=lambda grads: grad_prologue(grads, torch.bfloat16, 1 / dp, dp)),
             bytes_fwd=6 * full,
             kernels={"fwd": lambda: triton_grad_prologue(grads, torch.bfloat16, 1 / dp, dp)}),
    ]


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def time_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def measure(case: Case, impl: str, fn: Callable) -> dict:
    """{"fwd": ms, "fwd+bwd": ms} for one implementation."""
    out = {"fwd": time_ms(lambda: fn(**case.inputs))}
    if case.bytes_bwd:
        leaves = [case.inputs[n] for n in case.grad_names]
        outs = _as_tuple(fn(**case.inputs))
        grads_out = case.extra.setdefault("grads_out", [torch.randn_like(o) for o in outs])

        def step():
            torch.autograd.grad(_as_tuple(fn(**case.inputs)), leaves, grads_out)

        out["fwd+bwd"] = time_ms(step)
    return out


def check(case: Case) -> str:
    """Compare meshc with eager (outputs, and grads where there is a backward); deterministic cases only."""
    if not case.deterministic:
        return "n/a (dropout)"
    worst = 0.0
    with torch.no_grad():
        pairs = list(zip(_as_tuple(case.fns["meshc"](**case.inputs)), _as_tuple(case.fns["eager"](**case.inputs))))
    if case.bytes_bwd:
        leaves = [case.inputs[n] for n in case.grad_names]
        got = [torch.autograd.grad(_as_tuple(case.fns[k](**case.inputs)), leaves, case.extra["grads_out"])
               for k in ("meshc", "eager")]
        pairs += list(zip(*got))
    for a, e in pairs:  # normwise: eager rounds its bf16 intermediates, meshc keeps them in fp32
        worst = max(worst, ((a.float() - e.float()).abs().max() / e.float().abs().max().clamp_min(1e-6)).item())
    return f"ok ({worst:.0e})" if worst < 3e-2 else f"FAIL ({worst:.0e})"  # a few bf16 roundings (2**-8 each)


def fmt(ms, nbytes, peak_tbps):
    if ms is None:
        return "-"
    gbps = nbytes / (ms * 1e-3) / 1e9
    return f"{ms * 1e3:.0f} µs, {gbps:.0f} GB/s ({100 * gbps / (peak_tbps * 1e3):.0f}%)"


def report(case: Case, args) -> None:
    """Measure one case with the three implementations and print its table rows."""
    times = {impl: measure(case, impl, case.fns[impl]) for impl in ("eager", "meshc")}
    times["kernels"] = {pass_: time_ms(fn) for pass_, fn in case.kernels.items()}
    if not args.no_compile:
        times["compile"] = measure(case, "compile", torch.compile(case.fns["eager"], dynamic=False))
    verdict = check(case)
    impls = ("eager", "compile", "meshc", "kernels")
    for pass_, nbytes in (("fwd", case.bytes_fwd), ("fwd+bwd", case.bytes_fwd + case.bytes_bwd)):
        if pass_ not in times["eager"]:
            continue
        ms = {impl: times[impl].get(pass_) if impl in times else None for impl in impls}
        ratio = {k: f"{ms[k] / ms['meshc']:.2f}x" if ms[k] else "-" for k in ("eager", "compile")}
        cells = " | ".join(fmt(ms[impl], nbytes, args.peak_tbps) for impl in impls)
        print(f"| {case.name} | {case.shape} | {pass_} | {nbytes / 1e6:.0f} | {cells} | {ratio['eager']} | "
              f"{ratio['compile']} | {verdict} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peak-tbps", type=float, default=4.8, help="memory bandwidth peak, TB/s (H200: 4.8)")
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dp", type=int, default=8, help="data-parallel degree for the ZeRO copies")
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernels_gpu: no CUDA GPU here; this benchmark measures Triton kernels on a GPU. Nothing run.")
    import meshc.kernels  # noqa: F401  (registers the ops)

    print(f"# meshc kernels on {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, "
          f"peak {args.peak_tbps} TB/s\n")
    print("| kernel | shape | pass | MB | torch eager | torch.compile | meshc op | meshc kernels | vs eager | "
          "vs compile | check |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    t0 = time.perf_counter()
    for hidden in args.hidden:
        cases = [norm_case(args.tokens, hidden, False), norm_case(args.tokens, hidden, True),
                 gelu_case(args.tokens, hidden), swiglu_case(args.tokens, hidden), *zero_cases(hidden, args.dp)]
        for case in (c for c in cases if c.name in args.kernels):
            try:
                report(case, args)
            except Exception as e:  # one broken case must not hide the others' numbers
                print(f"| {case.name} | {case.shape} | - | - | ERROR {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:120] if str(e) else ''} | | | | | | |", flush=True)
        del cases
        torch.cuda.empty_cache()
    print(f"\n{time.perf_counter() - t0:.0f} s in all. 'meshc op': through torch.ops.meshc with autograd, as eager "
          "code calls it; 'meshc kernels': the Triton launchers called directly (forward and backward kernels, "
          "no autograd, no custom-op dispatch). 'vs': that column's time / meshc op's (above 1: meshc faster).")


if __name__ == "__main__":
    main()
