"""Context parallelism on a Llama-shaped model: the longest sequence that fits a per-rank activation budget, the
activation memory and the step time at one common length, for cp = 1, 2, 4 and each meshc cp_attention method,
side by side in the same run with torch's own torch.distributed.tensor.experimental.context_parallel.

    python benchmarks/cp_bench.py [--quick] [--cps 1,2,4] [--only meshc,torch] [--out cp_bench.md]

Model: transformers' LlamaForCausalLM from a LlamaConfig (hidden 256, intermediate 512, 4 layers, 8 heads, 4 kv
heads, vocabulary 1024, max_position_embeddings 2^17, attn_implementation "sdpa", no dropout), seed 0 on every
rank; one sequence of S tokens (seed 1) per step, world = cp gloo ranks (one thread each), so there is one
batch: meshc.mesh(dp=1, cp=cp), mesh.shard_batch (zigzag: rank c holds chunks c and 2cp-1-c of 2cp).

Activation bytes (per rank, the largest over the ranks): as in remat_memory.py, the forward runs under a dispatch
mode that keeps a weak reference to every storage an op creates (one none of its inputs has: views and in-place
results make none, so parameters, buffers and inputs are never counted); the storages still alive when forward
returns (the output included) are what backward will read. "mask": the part of them in bool tensors, or float
ones made by where, with two dims >= s (the local length): causal masks (transformers builds one when traced;
meshc's all_gather its (s, S) rows), their rows and the float copy SDPA keeps of each for backward.
Longest sequence in budget: measured at the common length, then at twice or half that, doubling while it fits
(or halving until it fits), then at up to --refine lengths (multiples of 128) between the last fit and the first
miss: first where the chord between them meets the budget, then by bisection. Each length is compiled anew
(meshc; check_trace off, it is on for the common length's job) and measured. The answer is the longest length
measured to fit: every length in the table was measured, none extrapolated (the note lists them, S:MiB).
Step: median seconds of --steps training steps (meshc: job.step, AdamW step, zero_grad; torch: forward,
backward, under CP the gradients' all-reduce, AdamW) after one warm-up, at --seq tokens, ranks aligned by a
barrier. loss 1 / loss 2: the first two steps' losses (averaged over the ranks); meshc's must equal the cp=1
loss to ~1e-5 (step 1: the forward; step 2: also the first AdamW update, so the gradients).

Peers: "torch eager" is the plain model on one rank (cp=1). "torch CP" runs the model under
context_parallel(DeviceMesh("cpu", (cp,)), buffers=[tokens, targets, position_ids]) (its head-tail load
balancer is the same zigzag layout), parameters replicated, gradients averaged by hand with all_reduce. Its
rotate method (allgather by default, alltoall) is set only through set_rotate_method, which lives in the private
module torch.distributed.tensor.experimental._attention: the project imports no private torch module outside
compiler/ir/torch_compat.py, so the alltoall row says so instead of running. Where a peer fails (torch CP has no
CPU attention kernel with a sharding rule), the row holds the failing rank's own first error line.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import arg_parser, last_error, launch, median_step, report, run_worker, table  # noqa: E402

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB, MAX_POS = 256, 512, 4, 8, 4, 1024, 1 << 17
UNIT, START, CAP = 128, 128, 1 << 16  # search grid (divisible by 2·cp·16 for cp <= 4), first length / cp, ceiling
MIB = 2**20
METHODS = ("ring", "all_gather", "all_to_all")
PRIVATE = "not configurable through public API (set_rotate_method is in torch...experimental._attention)"


# ---------------------------------------------------------------------------------------------- model, data
def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=INTER,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                      max_position_embeddings=MAX_POS, attention_dropout=0.0, use_cache=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def _tokens(seq: int):
    """(inputs, next-token targets), each (1, seq), the same on every rank."""
    import torch

    tokens = torch.randint(0, VOCAB, (1, seq + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _loss(out, y):
    """Mean token cross-entropy (tests/zoo.py lm_loss)."""
    import torch.nn.functional as F

    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


# ---------------------------------------------------------------------------------------------- measuring
def _held_after_forward(forward, rows: int) -> tuple[int, int]:
    """(bytes, mask bytes) of the storages created during `forward()` and still alive when it returns; mask:
    bool tensors, and float ones made by where (SDPA's copy of a bool mask), whose last two dims are at least
    `rows` (the local sequence length): causal masks, their rows and SDPA's float copies of them."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.multiprocessing.reductions import StorageWeakRef

    from meshc.compiler.ir import torch_compat as compat

    refs: dict[int, tuple] = {}

    def tensors(tree):
        for t in compat.tree_flatten(tree)[0]:
            t = t.to_local() if isinstance(t, DTensor) else t
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                yield t, StorageWeakRef(t.untyped_storage())

    class Meter(compat.dispatch_mode_base()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {ref.cdata for _, ref in tensors((args, kwargs))}  # views, in-place: no new storage
            for t, ref in tensors(out):
                if ref.cdata not in inputs:
                    mask = t.dim() >= 2 and min(t.shape[-2:]) >= rows and (
                        t.dtype == torch.bool or getattr(func, "__name__", "").startswith("where"))
                    refs.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes(), mask))
            return out

    with Meter():
        out = forward()
    alive = [(nbytes, is_bool) for ref, nbytes, is_bool in refs.values() if not ref.expired()]
    del out
    return sum(b for b, _ in alive), sum(b for b, m in alive if m)


def _rank_max(*values: float) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _longest(measure, budget: float, refine: int, seq: int, known: tuple, cp: int) -> tuple[int | None, dict]:
    """The longest measured length whose activations fit `budget` bytes: from `seq` (measured: `known`),
    doubling while it fits (or halving until it fits, down to START·cp), then up to `refine` lengths between
    the last fit and the first miss. `measure(seq)` -> (bytes, mask bytes). Also {length: measured}."""
    seen: dict[int, tuple] = {seq: known}

    def fits(seq: int) -> bool:
        if seq not in seen:
            seen[seq] = measure(seq)
            print(f"  S={seq}: {seen[seq][0] / MIB:.1f} MiB (mask {seen[seq][1] / MIB:.1f})", flush=True)
        return seen[seq][0] <= budget

    lo = hi = None
    while True:
        if fits(seq):
            lo = seq
            if hi is not None or seq * 2 > CAP:
                break
            seq *= 2
        else:
            hi = seq
            if lo is not None or seq // 2 < START * cp:
                break
            seq //= 2
    for i in range(refine if lo and hi else 0):
        if hi - lo <= UNIT:
            break
        if i == 0:  # where the chord meets the budget; memory is convex in S, so the chord errs short
            guess = lo + (budget - seen[lo][0]) / (seen[hi][0] - seen[lo][0]) * (hi - lo)
        else:
            guess = (lo + hi) / 2
        guess = min(max(int(guess) // UNIT * UNIT, lo + UNIT), hi - UNIT)
        lo, hi = (guess, hi) if fits(guess) else (lo, guess)
    return lo, seen


def _timed_steps(one_step, cfg: dict) -> dict:
    """Losses of the first two steps and the median seconds of cfg["steps"] steps after one warm-up."""
    import torch.distributed as dist

    losses = []
    step = lambda: losses.append(one_step())  # noqa: E731
    barrier = dist.barrier if dist.is_initialized() else None
    seconds = median_step(step, warmup=1, steps=cfg["steps"], barrier=barrier)
    return {"step": _rank_max(seconds)[0], "loss1": losses[0], "loss2": losses[1]}  # losses of steps 1 and 2


def _finish(cfg: dict, common: list, one_step, measure) -> dict:
    """A system's result: activations at the common length, the timed steps, the longest length in budget."""
    out = {"common": common, **_timed_steps(one_step, cfg)}
    out["longest"], out["probes"] = _longest(measure, cfg["budget"] * MIB, cfg["refine"], cfg["seq"], common, cfg["cp"])
    return out


# ---------------------------------------------------------------------------------------------- systems
def _meshc(cfg: dict) -> dict:
    import torch

    import meshc

    cp = cfg["cp"]
    mesh = meshc.mesh(dp=1, cp=cp, timeout_s=600)
    model = _model()
    plan = meshc.Plan(cp_attention=cfg["method"])

    def compiled(seq: int, check: bool = False):  # check_trace (eager vs traced, one step) where steps run
        x, y = (mesh.shard_batch(t) for t in _tokens(seq))
        return meshc.compile(model, mesh, example_inputs=(x,), plan=replace(plan, check_trace=check)), x, y

    def measure(seq: int, job=None, x=None):
        if job is None:
            job, x, _ = compiled(seq)
        job(x)  # warm: the first call's one-time work is not an activation
        return _rank_max(*_held_after_forward(lambda: job(x), seq // cp))

    job, x, y = compiled(cfg["seq"], check=True)
    common = measure(cfg["seq"], job, x)
    opt = job.optimizer(torch.optim.AdamW, lr=1e-4)

    def one_step():
        loss = job.step(x, y, _loss)
        opt.step()
        opt.zero_grad()
        return loss.item()

    return _finish(cfg, common, one_step, measure)


def _torch_eager(cfg: dict) -> dict:
    import torch

    model = _model()

    def measure(seq: int):
        x, _ = _tokens(seq)
        return _rank_max(*_held_after_forward(lambda: model(input_ids=x), seq))

    x, y = _tokens(cfg["seq"])
    common = measure(cfg["seq"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def one_step():
        loss = _loss(model(input_ids=x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return _finish(cfg, common, one_step, measure)


def _torch_cp(cfg: dict) -> dict:
    """torch's context_parallel around forward (and backward, as its docs do), gradients averaged by hand."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cp = cfg["cp"]
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    model = _model()

    def backends():  # the default choice (on CPU: flash attention for CPU), or the math backend
        return sdpa_kernel([SDPBackend.MATH]) if cfg["method"].endswith("math)") else contextlib.nullcontext()

    def sharded(seq: int):
        x, y = _tokens(seq)
        pos = torch.arange(seq)[None]
        return x, y, pos, context_parallel(mesh, buffers=[x, y, pos], buffer_seq_dims=[1, 1, 1],
                                           no_restore_buffers={x, y, pos})

    def measure(seq: int):
        x, _, pos, ctx = sharded(seq)
        with backends(), ctx:
            return _rank_max(*_held_after_forward(lambda: model(input_ids=x, position_ids=pos), seq // cp))

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def one_step():
        x, y, pos, ctx = sharded(cfg["seq"])
        with backends(), ctx:
            loss = _loss(model(input_ids=x, position_ids=pos), y)
            loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= cp
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        return loss.item() / cp

    return _finish(cfg, measure(cfg["seq"]), one_step, measure)


def worker(cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if cfg["system"] == "torch CP":
        dist.init_process_group("gloo")
    run = {"meshc": _meshc, "torch eager": _torch_eager, "torch CP": _torch_cp}[cfg["system"]]
    try:
        out = run(cfg)
    except Exception as e:  # each rank's first error line, for the driver to pick the cause from
        with open(os.path.join(cfg["errors"], os.environ.get("RANK", "0")), "w") as f:
            f.write(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"[:240])
        raise
    report(out)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- driver
def _configs(args) -> list[dict]:
    base = {"seq": args.seq, "budget": args.budget, "refine": args.refine, "steps": args.steps}
    out = []
    for cp in args.cps:
        if "meshc" in args.only:
            for method in (METHODS if cp > 1 else ("-",)):
                out.append({**base, "system": "meshc", "cp": cp, "method": "ring" if method == "-" else method,
                            "label": method})
        if "torch" in args.only and cp == 1:
            out.append({**base, "system": "torch eager", "cp": 1, "method": "-", "label": "-"})
        if "torch" in args.only and cp > 1:
            for label in ("allgather", "allgather (sdpa math)", "alltoall"):
                out.append({**base, "system": "torch CP", "cp": cp, "method": label, "label": label})
    return out


def _row(cfg: dict, out: dict, ref: dict | None) -> dict:
    row = {"system": cfg["system"], "cp": cfg["cp"], "method": cfg["label"]}
    if "error" in out:
        return {**row, "note": "failed: " + out["error"]}
    longest, probes = out["longest"], {int(k): v for k, v in out["probes"].items()}  # JSON keys are strings
    mask = probes[longest][1] / MIB if longest else float("nan")
    row.update({"longest S in budget": longest or f"< {START * cfg['cp']}",
                f"act MiB/rank @{cfg['seq']}": out["common"][0] / MIB,
                f"mask MiB @{cfg['seq']}": out["common"][1] / MIB,
                "mask MiB @longest": mask, "step s": out["step"],
                "loss 1": f"{out['loss1']:.6f}", "loss 2": f"{out['loss2']:.6f}"})
    if ref is not None:
        d1, d2 = abs(out["loss1"] - ref["loss1"]), abs(out["loss2"] - ref["loss2"])
        row["|Δloss| vs cp=1 (1, 2)"] = f"{d1:.1e}, {d2:.1e}" + ("" if max(d1, d2) <= 1e-5 else "  > 1e-5!")
    row["note"] = "probes " + " ".join(f"{s}:{b / MIB:.0f}" for s, (b, _) in sorted(probes.items()))
    return row


def _run(cfg: dict) -> dict:
    if cfg["system"] == "torch CP" and cfg["method"] == "alltoall":
        return {"error": PRIVATE}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as errors:
        try:
            out = launch(os.path.abspath(__file__), cfg["cp"], {**cfg, "errors": errors}, timeout=1800)
        except RuntimeError as e:
            print(str(e)[-3000:], file=sys.stderr, flush=True)
            out = {"error": _first_error(errors) or last_error(str(e))}
    print(f"{cfg['system']} cp={cfg['cp']} {cfg['label']}: {time.perf_counter() - t0:.0f} s "
          f"{out.get('error', '')}", flush=True)
    return out


def _first_error(folder: str) -> str | None:
    """The failing ranks' own error, not the peers' "connection closed" that follows it: "rank r: line"."""
    lines = {name: Path(folder, name).read_text() for name in sorted(os.listdir(folder), key=int)}
    causes = [r for r, line in lines.items() if "Connection closed by peer" not in line] or list(lines)
    return f"rank {causes[0]}: {lines[causes[0]]}" if causes else None


def main() -> None:
    p = arg_parser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="cp 1, 2; 32 MiB; 1024 tokens; no refinement; 2 steps")
    p.add_argument("--cps", default=None, help="cp sizes (default 1,2,4; quick 1,2)")
    p.add_argument("--only", default="meshc,torch")
    p.add_argument("--budget", type=float, default=None, help="activation MiB per rank (default 64; quick 32)")
    p.add_argument("--seq", type=int, default=None, help="common length in tokens (default 2048; quick 1024)")
    p.add_argument("--refine", type=int, default=None, help="lengths measured after doubling (default 2; quick 0)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 4; quick 2)")
    p.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    args = p.parse_args()
    if run_worker(args, worker):
        return
    defaults = {"budget": (64.0, 32.0), "seq": (2048, 1024), "refine": (2, 0), "steps": (4, 2), "cps": ("1,2,4", "1,2")}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.cps = [int(c) for c in args.cps.split(",")]
    t0, rows, ref = time.perf_counter(), [], None
    for cfg in _configs(args):
        out = _run(cfg)
        mine = cfg["system"] == "meshc" and cfg["cp"] == 1
        ref = out if mine and "error" not in out else ref
        rows.append(_row(cfg, out, None if mine else ref))
        print(rows[-1], flush=True)
    columns = list(dict.fromkeys(k for r in rows if "step s" in r for k in r)) or ["system", "cp", "method", "note"]
    columns = [c for c in columns if c != "note"] + ["note"]
    text = (f"Llama ({LAYERS} layers, hidden {HIDDEN}, {HEADS} heads / {KV_HEADS} kv, vocab {VOCAB}), one "
            f"sequence, world = cp gloo ranks, activation budget {args.budget:g} MiB/rank, common length "
            f"{args.seq}, median of {args.steps} steps ({time.perf_counter() - t0:.0f} s in all"
            f"{', --quick' if args.quick else ''}); probes S:MiB\n\n" + table(rows, columns))
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
