"""`meshc plan` and `meshc calibrate`: choose a plan for a model on N devices; measure this machine.

    meshc plan --model llama-70b --gpus 1024 --memory 80GB [--batch 1024] [--seq 8192] [--hardware h100]
    meshc plan --model llama-8b --gpus 8 --batch 1 --seq 131072       (one long sequence: context parallelism)
    meshc plan --model gpt-tiny --gpus 2 --hardware cpu --compiled     (score the real graphs, small models)
    meshc plan --model llama-8b --gpus 64 --html plans.html           (every plan scored, as one page)
    meshc calibrate [--out ~/.cache/meshc/cpu-gloo.json] [--nproc 2] [--quick]

`meshc plan` enumerates every dp × tp × pp factorization of the device count, with expert parallelism (ep of
dp) for a model with experts or context parallelism (cp of dp: each sequence split over cp ranks, which lets
a batch smaller than dp × micro-batches be trained) for one without, and every ZeRO stage, micro-batch count,
schedule, remat policy, sequence and vocabulary parallelism and cp attention; keeps the plans that fit in the
memory given, and prints the best as a table with the reason for each one's rank.
"""
from __future__ import annotations

import argparse
import re
import time

import torch

from meshc import factory, models
from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.cost.formulas import formula_estimate
from meshc.compiler.cost.hardware import default_cpu_path, load
from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.planner.search import Search, plan_model
from meshc.compiler.planner.compiled import plan_compiled
from meshc.compiler.report.plans import write_plans

UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
         "tib": 2**40, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_bytes(text: str) -> float:
    """"80GB" -> 80e9, "80GiB" -> 80 * 2**30, "512MB" -> 512e6."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in UNITS:
        raise MeshcValueError(f"--memory: expected a size such as 80GB or 80GiB, got {text!r}")
    return float(match.group(1)) * UNITS[match.group(2).lower()]


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt2-small",
                   help=f"built-in model ({', '.join(models.NAMES)}), a transformers config .json, or "
                        "path.to.module:factory (your nn.Module; scored on its compiled graphs)")
    p.add_argument("--gpus", type=int, required=True, help="number of devices (ranks)")
    p.add_argument("--memory", default=None, help="memory per device, e.g. 80GB (default: 90%% of the profile's)")
    p.add_argument("--batch", type=int, default=None, help="global batch in sequences (default: one per device)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--hardware", default="h100", help="h100, h200, a100, cpu (calibrated), or a profile .json")
    p.add_argument("--dtype", default=None, choices=("fp32", "bf16"),
                   help="compute dtype (default: bf16 with fp32 masters on GPUs, fp32 on cpu)")
    p.add_argument("--top", type=int, default=10, help="rows to print")
    p.add_argument("--compiled", action="store_true",
                   help="score each plan on the real graph of a simulated rank (slow; for small models)")
    p.add_argument("--html", default=None, metavar="PATH",
                   help="also write every scored plan (and why each was rejected or ranked) as one HTML page")


def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help=f"profile file to write (default {default_cpu_path()})")
    p.add_argument("--nproc", type=int, default=2, help="local processes to measure (default 2)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions and sizes (a few seconds)")
    p.add_argument("--disk-dir", default=None, help="folder on the disk Plan.offload='nvme' would use (default: "
                                                    "the system's temporary folder)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def run_plan(args: argparse.Namespace) -> int:
    hw = load(args.hardware)
    gpu = hw.name != "cpu-gloo" and not hw.name.startswith("cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": None}[args.dtype or ("bf16" if gpu else "fp32")]
    memory = parse_bytes(args.memory) if args.memory else None
    batch = args.batch or args.gpus
    search = Search(param_dtype=dtype)
    t0 = time.perf_counter()
    user = factory.is_factory(args.model)
    if args.compiled or user:  # a factory's model has no formula shape: its graphs are scored
        with compat.fake_tensor_mode():  # no memory for weights, whatever the model's size
            result, batch = _plan_compiled(args, batch, hw, memory, search)
    else:
        shape = models.shape(args.model, seq=args.seq)
        result = plan_model(shape, args.gpus, batch, hw, memory, search)
    compiled = args.compiled or user
    shape = None if compiled else shape
    print(f"meshc plan: {args.model} on {args.gpus} x {hw.name}, global batch {batch} sequences "
          f"({'compiled graphs' if compiled else 'formulas'}, {time.perf_counter() - t0:.1f} s)")
    print(result.table(args.top))
    if args.html:
        title = f"meshc plan: {args.model} on {args.gpus} x {hw.name}, global batch {batch}"
        print(f"plans: {write_plans(args.html, result, title=title).resolve()} (open it in a browser)")
    best = result.best
    p = best.candidate.plan
    offload = ""
    if p.offload:
        offload = f", offload={p.offload!r}" + (f", offload_dir={p.offload_dir!r}" if p.offload_dir else "") + \
            (", offload_params=True" if p.offload_params else "")
    c = best.candidate
    ep = f", ep={c.ep}" if c.ep > 1 else ""
    ep += f", cp={c.cp}" if c.cp > 1 else ""
    cp = f", cp_attention={p.cp_attention!r}" if c.cp > 1 else ""
    replicas = f", replicas={p.replicas}" if p.replicas > 1 else ""
    print(f"\nbest: meshc.mesh(dp={c.axes['dp']}{ep}, tp={c.tp}, pp={c.pp}) with "
          f"meshc.Plan(zero={p.zero}{replicas}, microbatches={p.microbatches}, schedule={p.schedule!r}, virtual={p.virtual}, "
          f"remat={p.remat!r}, sequence_parallel={p.sequence_parallel}, vocab_parallel={p.vocab_parallel}{cp}"
          + (f", param_dtype=torch.{str(dtype).split('.')[-1]}" if dtype is not None else "") + offload + ")")
    if p.offload and not compiled:
        print(_offload_trade(best, shape, args.gpus, batch, hw, memory, search))
    if p.replicas > 1 and not compiled:
        print(_hybrid_trade(best, shape, batch, hw))
    return 0


def _hybrid_trade(best, shape, batch: int, hw) -> str:
    """Why the best plan shards ZeRO within nodes: its data-parallel time and memory against the same plan sharded
    over all of dp (replicas=1)."""
    import dataclasses

    c, p = best.candidate, best.candidate.plan
    flat = formula_estimate(shape, c.sizes, dataclasses.replace(p, replicas=1), batch, hw)
    mine = best.estimate
    dps = c.dp // p.replicas
    ms = lambda e: (e.time["dp"] + e.time["step"]) * 1e3
    return (f"why replicas={p.replicas}: ZeRO shards within each node (dp × cp split into {p.replicas} groups of "
            f"{dps}, tp={c.tp}: {dps * c.tp} ranks on the node's fast link), gradient shards all-reduced across the "
            f"groups; against sharding over all {c.dp}: step {mine.step_time:.3g} s vs {flat.step_time:.3g} s "
            f"(data-parallel time not hidden behind compute {ms(mine):.1f} ms vs {ms(flat):.1f} ms), per-rank "
            f"memory {mine.total_memory / 2**30:.1f} GiB vs {flat.total_memory / 2**30:.1f} GiB")


def _plan_compiled(args: argparse.Namespace, batch: int, hw, memory, search):
    """Every mesh scored on the real graph of its rank 0 (on fake tensors); a factory's example inputs, when it
    returns them, set the global batch."""
    if factory.is_factory(args.model):
        built, seq = factory.build(args.model), args.seq or factory.SEQ
        build, given = (lambda: built.module), built.inputs
    else:
        seq = args.seq or models.seq_len(args.model)
        build, given = (lambda: models.build(args.model, seq_len=seq)), None
    if given is not None:
        batch = int(given[0].shape[0])

    def inputs(dp: int) -> tuple:
        if given is not None:
            return factory.local_inputs(given, dp, 1)
        return (torch.zeros(batch // dp, seq, dtype=torch.long),)
    return plan_compiled(build, inputs, args.gpus, hw, memory, search), batch


def _offload_trade(best, shape, gpus: int, batch: int, hw, memory, search) -> str:
    """The trade of the offloaded best plan: the fewest devices (doubling) on which a plan fits without offload."""
    import dataclasses

    from meshc.compiler.ir.show import human_bytes

    plain = dataclasses.replace(search, offload=False)
    step = best.estimate.step_time
    fit = f"fits on {gpus} x {hw.name} with offload={best.candidate.plan.offload}, step {step:.3g} s"
    for world in (gpus * 2**k for k in range(1, 11)):
        found = plan_model(shape, world, max(batch, world), hw, memory, plain)
        if found.ranked:
            other = found.ranked[0].estimate.step_time
            return (f"trade: {fit} ({step / other:.2g}x the step of the best plan without offload, which needs "
                    f"{world} devices: {other:.3g} s at a global batch of {max(batch, world)})")
    return f"trade: {fit}; without offload no plan fits even on {gpus * 2**10} devices of {human_bytes(memory or 0)}"


def run_calibrate(args: argparse.Namespace) -> int:
    from meshc import calibrate

    if args.worker:
        return calibrate.worker(args.quick)
    out = args.out or default_cpu_path()
    t0 = time.perf_counter()
    hw = calibrate.calibrate(out, nproc=args.nproc, quick=args.quick, disk_dir=args.disk_dir)
    print(f"meshc calibrate: {args.nproc} processes, {time.perf_counter() - t0:.1f} s; wrote {out}")
    print(f"  linear layers (forward + backward) {hw.flops / 1e9:.1f} GFLOP/s per process, memory {hw.mem_bandwidth / 1e9:.2f} GB/s, "
          f"{hw.op_overhead * 1e6:.1f} us per graph op (forward + backward); a training step's compute "
          f"runs {hw.compute_scale:.2f}x its roofline")
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "send"):
        lat, bw = hw.intra.alpha_beta(kind)
        print(f"  {kind:<15} latency {lat * 1e6:8.1f} us, bandwidth {bw / 1e9:6.2f} GB/s")
    print(f"  disk (offload)  read {hw.disk_read / 1e9:.2f} GB/s, write {hw.disk_write / 1e9:.2f} GB/s per process")
    return 0
