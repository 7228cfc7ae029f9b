"""One GPU, one script: a ~1B-parameter Llama training step under eager torch, torch.compile and
meshc.compile, and meshc's fused kernels against torch, for the README's GPU table.

    python benchmarks/gpu_suite.py [--out gpu_suite.md] [--json rows.json] [--peak-tflops 989]
                                   [--batch 8] [--warmup 3] [--steps 5] [--budget-s 400] [--no-kernels]
    python benchmarks/gpu_suite.py --dry-run     # the same code paths at tiny sizes, in seconds: on CPU without
                                                 # CUDA (tests/test_gpu_suite.py), a smoke run on a GPU

Training rows: a transformers LlamaForCausalLM with random weights (TinyLlama's shape: hidden 2048,
22 layers, 32 heads, 4 kv heads, MLP 5632, vocab 32000: 1.1B parameters), seq 2048, mean cross-entropy
of the logits (in fp32) against random targets, AdamW, the same batch every step. Every row starts
from the same weights (one fp32 model built once) and batch:
  eager          a bf16 copy of the model (bf16 parameters and AdamW states: no fp32 master)
  torch.compile  the same bf16 copy under torch.compile (default Inductor); the optimizer stays eager
  meshc ...      meshc.compile of the fp32 model, world of one process, Plan(param_dtype=bf16): bf16
                 compute, fp32 master weights and AdamW states (ZeRO-1 or -3 on dp=1: one rank on the axis,
                 so nothing is gathered, packed or reduce-scattered, and no fused copy kernel is eligible; the
                 kernels are timed on their own below), fusion left to the cost model; the program run as FX
                 code (Plan(inductor=False)) or, in the Inductor rows, lowered by Inductor forward and backward
                 (Plan(inductor=True))
  offload=cpu    meshc with Plan(offload="cpu"), where this build's Plan has that field
Per row: the first step (including building the row: copy, compile or trace), the median of --steps
timed steps after --warmup (torch.cuda.synchronize around each), tokens/s, MFU = 6 x matmul parameters
(all but the token embedding) x tokens per step / step time / --peak-tflops (H200 dense bf16: 989 by the
datasheet; attention's score and value products are not counted), the peak memory of its steps
(torch.cuda.max_memory_allocated, reset once the row is built, less what was allocated before the row:
the fp32 source model and the batch), and the loss at the first and last step. The fp32 eager loss of the
initial weights on the batch is printed as the reference every row's first loss should match.

Kernel rows: benchmarks/kernels_gpu.py's cases at one shape (8192 tokens x hidden 4096 by default),
measured and printed by its own report().

The whole run stops starting rows after --budget-s (400 s from setup) and aborts a row that runs past
it (SIGALRM; the steps it finished still count), so with the imports it ends within the 8 minutes it is
given on one H200 even if a row is slow. The training rows run first, torch.compile last of them (its
compile is the longest), then the kernels.
Progress lines are printed as it goes; the tables at the end, with the date and the versions.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import gc
import importlib
import io
import json
import os
import re
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py: Triton kernels in the interpreter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernels_gpu  # noqa: E402  (benchmarks/kernels_gpu.py: the kernel cases and their report)

import meshc  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    seq: int


GPU_SIZES = Sizes(hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632, vocab=32000, seq=2048)
TINY_SIZES = Sizes(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=176, vocab=256, seq=32)

COLUMNS = ("row", "precision", "first step s", "step s", "tokens/s", "MFU", "peak GiB", "loss first -> last",
           "notes")
KERNEL_COLUMNS = ("kernel", "shape", "pass", "MB", "torch eager", "torch.compile", "meshc op", "meshc kernels",
                  "vs eager", "vs compile", "check")  # kernels_gpu.report()'s columns


class OverBudget(Exception):
    pass


@dataclass
class Row:
    name: str
    precision: str
    first_s: float | None = None
    step_s: float | None = None
    peak_bytes: int | None = None
    losses: list[float] = field(default_factory=list)
    note: str = ""
    skipped: str | None = None  # the reason no numbers were measured


@dataclass
class Bench:
    """What every row shares: the fp32 source model, the batch, the clock."""

    args: argparse.Namespace
    sizes: Sizes
    device: torch.device
    model: torch.nn.Module
    mesh: meshc.Mesh
    x: torch.Tensor
    y: torch.Tensor
    matmul_params: int
    t0: float

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def remaining(self) -> float:
        return self.args.budget_s - self.elapsed()

    def log(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {text}", flush=True)


# ------------------------------------------------------------------------------ the model and the batch
def build_model(sizes: Sizes, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=sizes.hidden, num_hidden_layers=sizes.layers, num_attention_heads=sizes.heads,
                      num_key_value_heads=sizes.kv_heads, intermediate_size=sizes.intermediate,
                      vocab_size=sizes.vocab, max_position_embeddings=sizes.seq, use_cache=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(cfg)
    return model.float().train()


def make_batch(sizes: Sizes, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and random targets, the same on every run."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, sizes.vocab, (batch, sizes.seq), generator=g)
    y = torch.randint(0, sizes.vocab, (batch, sizes.seq), generator=g)
    return x.to(device), y.to(device)


def loss_fn(outputs, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token, in fp32; takes logits or a transformers ModelOutput."""
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameters, those that take part in matmuls: all but an untied token embedding)."""
    total = sum(p.numel() for p in model.parameters())
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return total, total - (0 if emb is head else emb.numel())


# ------------------------------------------------------------------------------ rows
StepFn = Callable[[], torch.Tensor]  # one training step; returns the (detached) loss


def eager_row(bench: Bench, compile_backend: str | None,
              dtype: torch.dtype = torch.bfloat16) -> tuple[StepFn, Callable[[], str]]:
    model = copy.deepcopy(bench.model).to(dtype)
    forward = torch.compile(model, backend=compile_backend) if compile_backend else model
    opt = torch.optim.AdamW(model.parameters(), lr=bench.args.lr)
    x, y = bench.x, bench.y

    def step() -> torch.Tensor:
        loss = loss_fn(forward(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step, lambda: ""


def meshc_row(bench: Bench, **plan_fields) -> tuple[StepFn, Callable[[], str]]:
    plan = meshc.Plan(trace="non-strict", param_dtype=torch.bfloat16, **plan_fields)
    job = meshc.compile(bench.model, bench.mesh, example_inputs=(bench.x,), plan=plan)
    opt = job.optimizer(torch.optim.AdamW, lr=bench.args.lr)
    x, y = bench.x, bench.y

    def step() -> torch.Tensor:
        loss = job.step(x, y, loss_fn)
        opt.step()
        opt.zero_grad()
        return loss

    def note() -> str:
        text = fusion_note(str(job.explain()), plan.fusion)
        stats = job.inductor.stats
        return text + (f"; Inductor: {stats.forward} fw + {stats.backward} bw graphs, {stats.seconds:.0f} s"
                       if stats.programs else "")
    return step, note


def fusion_note(report: str, fusion: bool | None) -> str:
    """What job.explain() says fuse_comm did: "zero_copy fused 44/44", or why nothing was."""
    found = re.findall(r"^\s*(\w+): fused (\d+) of (\d+) eligible", report, flags=re.M)
    if fusion is False:
        return "Plan(fusion=False)"
    if not found:
        return ("fusion on" if fusion else "fusion left to the cost model") + "; no chain fused"
    return ", ".join(f"{k} fused {a}/{b}" for k, a, b in dict.fromkeys(found))


def plan_has(name: str) -> bool:
    return name in {f.name for f in dataclasses.fields(meshc.Plan)}


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise OverBudget in this (main) thread after `seconds`."""
    def expire(signum, frame):
        raise OverBudget(f"aborted: past the time budget ({seconds:.0f} s left when it started)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(bench: Bench, name: str, precision: str, build: Callable[[], tuple[StepFn, Callable[[], str]]]) -> Row:
    """Build one row, run --warmup + --steps steps, time them; never raises (the reason goes in the row)."""
    row, args, device = Row(name, precision), bench.args, bench.device
    if bench.remaining() < 5:
        row.skipped = f"skipped: time budget (--budget-s {args.budget_s:.0f}) spent"
        bench.log(f"{name}: {row.skipped}")
        return row
    free(device)
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    bench.log(f"{name}: building ({precision})")
    times: list[float] = []
    try:
        with time_limit(bench.remaining()):
            start = time.perf_counter()
            step, describe = build()
            if device.type == "cuda":  # the steps' peak: not the build's transients (e.g. the fp32 copy)
                torch.cuda.reset_peak_memory_stats()
            for i in range(args.warmup + args.steps):
                sync(device)
                t = time.perf_counter()
                loss = step()
                sync(device)
                now = time.perf_counter()
                row.losses.append(loss.item())
                if i == 0:
                    row.first_s = now - start
                if i >= args.warmup:
                    times.append(now - t)
                bench.log(f"{name}: step {i + 1}/{args.warmup + args.steps} {now - t:.3f} s, "
                          f"loss {row.losses[-1]:.4f}")
            row.note = describe()
            del step, describe
    except Exception as e:  # noqa: BLE001 - one broken row must not hide the others' numbers
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        row.skipped = str(e) if isinstance(e, OverBudget) else f"ERROR {type(e).__name__}: {first}"
        bench.log(f"{name}: {row.skipped}")
    if times:
        row.step_s = statistics.median(times)
    if device.type == "cuda":
        row.peak_bytes = torch.cuda.max_memory_allocated() - base
    free(device)
    if device.type == "cuda" and torch.cuda.memory_allocated() - base > 2**27:
        row.note += f" (left {(torch.cuda.memory_allocated() - base) / 2**30:.1f} GiB allocated after it)"
    return row


def training_rows(bench: Bench) -> list[Row]:
    args = bench.args
    rows = [measure(bench, "eager", "bf16 params + AdamW", lambda: eager_row(bench, None))]
    meshc_precision = "bf16 compute, fp32 master + AdamW"
    rows.append(measure(bench, "meshc ZeRO-1", meshc_precision, lambda: meshc_row(bench, zero=1, inductor=False)))
    rows.append(measure(bench, "meshc ZeRO-1 Inductor", meshc_precision + ", Inductor",
                        lambda: meshc_row(bench, zero=1, inductor=True)))
    rows.append(measure(bench, "meshc ZeRO-3 Inductor", meshc_precision + ", Inductor",
                        lambda: meshc_row(bench, zero=3, inductor=True)))
    rows.append(measure(bench, "meshc ZeRO-3", meshc_precision, lambda: meshc_row(bench, zero=3, inductor=False)))
    if plan_has("offload"):
        rows.append(measure(bench, "meshc offload=cpu", meshc_precision + ", offload=cpu",
                            lambda: meshc_row(bench, zero=1, offload="cpu")))
    else:
        rows.append(Row("meshc offload=cpu", meshc_precision, skipped="offload=cpu: not available in this build"))
        bench.log("meshc offload=cpu: not available in this build (meshc.Plan has no offload field)")
    # torch.compile last of the training rows: its compile takes longest, and the budget guards the rest
    if args.dry_run:  # Inductor's CPU compile of even the tiny model takes ~30 s on 2 cores
        rows.append(measure(bench, "torch.compile", "bf16 params + AdamW; dry run: backend='eager' (no Inductor)",
                            lambda: eager_row(bench, "eager")))
    else:
        rows.append(measure(bench, "torch.compile", "bf16 params + AdamW, Inductor",
                            lambda: eager_row(bench, "inductor")))
    return rows


# ------------------------------------------------------------------------------ kernels
class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


def kernel_rows(bench: Bench) -> list[str]:
    """kernels_gpu.py's cases at one shape, measured by its report(); the markdown rows it printed."""
    args = bench.args
    tokens, hidden, dp = args.kernel_tokens, args.kernel_hidden, args.kernel_dp
    groups = [("norm", lambda: [kernels_gpu.norm_case(tokens, hidden, False)]),
              ("rmsnorm", lambda: [kernels_gpu.norm_case(tokens, hidden, True)]),
              ("gelu", lambda: [kernels_gpu.gelu_case(tokens, hidden)]),
              ("swiglu", lambda: [kernels_gpu.swiglu_case(tokens, hidden)]),
              ("pack_cast, unpack, grad_prologue", lambda: kernels_gpu.zero_cases(hidden, dp))]
    rest = " |" * (len(KERNEL_COLUMNS) - 4)  # the cells after a reason

    if bench.device.type != "cuda":
        reason = ("skipped on CPU: kernels_gpu.py builds its cases on CUDA and times them with "
                  "triton.testing.do_bench")
        bench.log(f"kernels: {reason}")
        return [f"| {name} | {tokens}x{hidden} | - | {reason} |{rest}" for name, _ in groups]
    importlib.import_module("meshc.kernels")  # registers the ops, as kernels_gpu.main does

    report_args = argparse.Namespace(no_compile=args.kernel_no_compile, peak_tbps=args.peak_tbps)
    lines: list[str] = []
    for name, build in groups:
        if bench.remaining() < 10:
            lines.append(f"| {name} | {tokens}x{hidden} | - | skipped: time budget spent |{rest}")
            continue
        bench.log(f"kernels: {name}")
        buf = io.StringIO()
        try:
            with time_limit(bench.remaining()), contextlib.redirect_stdout(_Tee(sys.stdout, buf)):
                for case in build():
                    kernels_gpu.report(case, report_args)
        except Exception as e:  # noqa: BLE001 - as kernels_gpu.main: one broken case must not hide the others
            msg = str(e) if isinstance(e, OverBudget) else f"ERROR {type(e).__name__}: {str(e)[:120]}"
            buf.write(f"| {name} | {tokens}x{hidden} | - | {msg} |{rest}\n")
        lines += [ln for ln in buf.getvalue().splitlines() if ln.startswith("|")]
        free(bench.device)
    return lines


# ------------------------------------------------------------------------------ the tables
def fmt_row(row: Row, bench: Bench) -> list[str]:
    tokens = bench.x.numel()
    losses = f"{row.losses[0]:.4f} -> {row.losses[-1]:.4f}" if row.losses else "-"
    if row.step_s is None:
        cells = ["-", "-", "-", "-"]
    else:
        flops = 6 * bench.matmul_params * tokens
        mfu = flops / row.step_s / (bench.args.peak_tflops * 1e12)
        cells = [f"{row.step_s:.3f}", f"{tokens / row.step_s:,.0f}", f"{100 * mfu:.1f}%",
                 "n/a (CPU)" if row.peak_bytes is None else f"{row.peak_bytes / 2**30:.1f}"]
    first = "-" if row.first_s is None else f"{row.first_s:.1f}" if row.first_s >= 10 else f"{row.first_s:.2f}"
    note = "; ".join(n for n in (row.skipped, row.note.strip()) if n)
    return [row.name, row.precision, first, *cells, losses, note]


def markdown(columns, rows) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def header(bench: Bench) -> str:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    where = torch.cuda.get_device_name() if bench.device.type == "cuda" else "CPU"
    where += " (dry run: tiny sizes)" if bench.args.dry_run else ""
    return (f"# meshc GPU suite, {datetime.date.today().isoformat()}: {where}; torch {torch.__version__}, "
            f"triton {triton_version}, transformers {transformers.__version__}, meshc {meshc.__version__}")


def setup(args) -> Bench:
    t0 = time.perf_counter()
    mesh = meshc.mesh()  # a world of one: NCCL on the GPU, else gloo on CPU
    device = mesh.device
    sizes = TINY_SIZES if args.dry_run else GPU_SIZES
    if not args.dry_run and args.seq:
        sizes = dataclasses.replace(sizes, seq=args.seq)
    model = build_model(sizes, device)
    x, y = make_batch(sizes, args.batch, device)
    total, matmul = count_params(model)
    bench = Bench(args, sizes, device, model, mesh, x, y, matmul, t0)
    bench.log(f"model: Llama {sizes}, {total:,} parameters ({billions(total)}; {matmul:,} in matmuls), "
              f"batch {args.batch} x seq {sizes.seq} = {x.numel():,} tokens per step, on {device}")
    return bench


def reference_text(ref: list[float]) -> str:
    if len(ref) == 1:
        return f"Reference: the fp32 eager loss of the initial weights is {ref[0]:.4f}."
    return (f"Reference: an fp32 eager copy (fp32 AdamW) trained on the same steps: {ref[0]:.4f} -> "
            f"{ref[-1]:.4f}.")


def billions(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def reference_losses(bench: Bench) -> list[float]:
    """fp32 eager losses: of the initial weights, then (--fp32-reference) after each of the rows' steps."""
    if not bench.args.fp32_reference:
        with torch.no_grad():
            return [loss_fn(bench.model(bench.x), bench.y).item()]
    step, _ = eager_row(bench, None, dtype=torch.float32)
    return [step().item() for _ in range(bench.args.warmup + bench.args.steps)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--dry-run", action="store_true",
                   help="run the same code paths at tiny sizes (hidden 64, 2 layers, seq 32) in seconds, for the "
                        "tests: on CPU without CUDA (CUDA_VISIBLE_DEVICES= forces it), else a quick GPU smoke run")
    p.add_argument("--out", help="also write the tables (markdown) to this file")
    p.add_argument("--json", help="also write every row's raw numbers and per-step losses (JSON) to this file")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="dense bf16 peak of the GPU in TFLOP/s, for MFU (H200/H100 SXM: 989)")
    p.add_argument("--peak-tbps", type=float, default=4.8,
                   help="memory bandwidth peak in TB/s, for the kernels' %% of peak (H200: 4.8)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 8; dry run 2)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; ignored in dry run)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per row (default 3; dry run 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per row, median reported (default 5; "
                                                          "dry run 2)")
    p.add_argument("--fp32-reference", action=argparse.BooleanOptionalAction, default=None,
                   help="train an fp32 eager copy for the same steps first, as the losses' reference (default: "
                        "in the dry run only; without it the reference is the initial weights' fp32 loss)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    p.add_argument("--budget-s", type=float, default=400.0,
                   help="stop starting rows, and abort the running one, this many seconds after setup began "
                        "(default 400: with imports and an editable install, under 8 minutes)")
    p.add_argument("--no-kernels", action="store_true", help="skip the fused-kernel section")
    p.add_argument("--kernel-tokens", type=int, default=8192, help="tokens of the kernel cases (default 8192)")
    p.add_argument("--kernel-hidden", type=int, default=4096, help="hidden size of the kernel cases (default 4096)")
    p.add_argument("--kernel-dp", type=int, default=8, help="dp degree of the ZeRO copy kernel cases (default 8)")
    p.add_argument("--kernel-no-compile", action="store_true", help="skip the kernels' torch.compile column")
    args = p.parse_args(argv)
    defaults = (dict(batch=2, warmup=1, steps=2, fp32_reference=True) if args.dry_run else
                dict(batch=8, warmup=3, steps=5, fp32_reference=False))
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.dry_run:
        args.kernel_tokens, args.kernel_hidden = 64, 32
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_suite: no CUDA GPU here; run with --dry-run to exercise it on CPU. Nothing run.", file=sys.stderr)
        return 2
    owns_world = not dist.is_initialized()
    try:
        bench = setup(args)
        ref = reference_losses(bench)
        free(bench.device)
        bench.log(f"reference: fp32 eager losses {', '.join(f'{v:.4f}' for v in ref)}")
        rows = training_rows(bench)
        del bench.model  # the kernels need no model
        free(bench.device)
        kernels = [] if args.no_kernels else kernel_rows(bench)
    finally:
        if owns_world and dist.is_initialized():
            dist.destroy_process_group()
    text = [header(bench), "",
            f"Llama {bench.sizes.hidden}h x {bench.sizes.layers} layers, vocab {bench.sizes.vocab}, "
            f"{billions(bench.matmul_params)} matmul parameters; batch {args.batch} x seq {bench.sizes.seq}; "
            f"AdamW lr {args.lr}; median of {args.steps} steps after {args.warmup}; MFU against "
            f"{args.peak_tflops:g} TFLOP/s (6 x matmul params x tokens). {reference_text(ref)} "
            "First step includes building the row (copy / torch.compile / meshc trace and "
            "passes). Peak GiB: the most the row held during its steps beyond the fp32 source model and the batch "
            "(torch.cuda.max_memory_allocated).", "",
            markdown(COLUMNS, [fmt_row(r, bench) for r in rows])]
    if not args.no_kernels:
        text += ["", f"Fused kernels (benchmarks/kernels_gpu.py, bf16, {args.kernel_tokens} tokens x hidden "
                     f"{args.kernel_hidden}, ZeRO copies over dp {args.kernel_dp}; bandwidth peak "
                     f"{args.peak_tbps} TB/s):", "", markdown(KERNEL_COLUMNS, []), *kernels]
    text += ["", f"{bench.elapsed():.0f} s in all."]
    out = "\n".join(text)
    print("\n" + out, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(out + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"reference_losses": ref, "tokens_per_step": bench.x.numel(),
                       "matmul_params": bench.matmul_params,
                       "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
