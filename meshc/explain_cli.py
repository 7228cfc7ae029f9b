"""`meshc explain`: compile one rank of a built-in model (or of your own, `--model path.to.module:factory`) on a
mesh, in this process, and print the plan with its predicted memory and step time.

No processes are launched, no process group is created and no memory is spent on weights: the mesh is a
MeshSpec (sizes and group names only) and the model is built from fake tensors, so a plan for thousands of
ranks can be read on a laptop:

    meshc explain --model llama-70b --mesh dp=64,tp=8,pp=4 --microbatches 16 --hardware h100

From Python, `simulate(...)` does the same and returns the report and the estimates.
"""
from __future__ import annotations

import argparse
import resource
import time
from dataclasses import dataclass

import torch

import meshc
from meshc import factory, models
from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.cost.formulas import Estimate, formula_estimate
from meshc.compiler.compile import CompiledRank, compile_rank
from meshc.compiler.cost.compiled import estimate_compiled
from meshc.compiler.report.explain import explain
from meshc.compiler.cost.hardware import load as load_hardware
from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.report.html import write_report
from meshc.compiler.ir.show import format_graph
from meshc.compiler.ir.mesh_spec import MeshSpec, parse_sizes, spec_sizes

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class Simulation:
    """What a simulated compile of one rank produced: its programs (and pipeline), its report, the estimates
    from the compiled graph and from the formulas, and what the compile cost this process."""

    rank_program: CompiledRank
    report: object
    compiled: Estimate
    formula: Estimate | None
    seconds: float
    peak_rss: int  # bytes, this process's peak resident memory so far


def simulate(model: str, mesh: dict[str, int], *, rank: int = 0, plan: meshc.Plan | None = None,
             batch: int | None = None, seq: int | None = None, hardware="h100", **overrides) -> Simulation:
    """Compile `rank` of a built-in model (or a transformers config .json, or a factory `module:callable`,
    meshc/factory.py) on a simulated mesh.

    `batch` is the global batch in sequences (default 8, or one sequence per micro-batch per dp rank where 8
    does not divide);
    `overrides` change the model's config (e.g. layers=8).
    """
    plan = plan or meshc.Plan(trace="non-strict")
    # the mesh as a user writes it (world = dp × cp × tp × pp); `sizes` as MeshSpec and the formulas count: dp × cp
    sizes = spec_sizes(**{axis: int(mesh.get(axis, 1)) for axis in ("dp", "ep", "cp", "tp", "pp")})
    world = sizes["dp"] * sizes["tp"] * sizes["pp"]
    if not 0 <= rank < world:
        raise MeshcValueError(f"explain: expected a rank in [0, {world}), got {rank}")
    dp, mb = sizes["dp"] // sizes["cp"], plan.microbatches  # cp ranks share a batch slice (and split its sequences)
    user = factory.is_factory(model)
    hw = load_hardware(hardware)
    t0 = time.perf_counter()
    spec = MeshSpec(sizes)  # ep folds into dp: not a factor of the world
    with compat.fake_tensor_mode():
        built = factory.build(model, **overrides) if user else None
        if built is not None and built.inputs is not None:  # the factory's own global batch
            if batch is not None and batch != built.inputs[0].shape[0]:
                raise MeshcValueError(f"explain: --batch {batch} but the factory's example inputs hold a batch of "
                                      f"{built.inputs[0].shape[0]}; drop --batch or change the factory's inputs")
            batch = int(built.inputs[0].shape[0])
        batch = batch or (8 if 8 % (dp * mb) == 0 else dp * mb)
        if batch % (dp * mb):
            raise MeshcValueError(f"explain: expected the batch divisible by dp × microbatches = {dp * mb}, got "
                                  f"{batch}")
        if built is not None and built.inputs is not None:
            net, inputs = built.module, factory.local_inputs(built.inputs, dp, sizes["cp"])
        else:
            seq = seq or (factory.SEQ if user else models.seq_len(model))
            net = built.module if user else models.build(model, seq_len=seq, **overrides)
            inputs = (torch.zeros(batch // dp, seq // sizes["cp"], dtype=torch.long),)  # this rank's part
        result, _ = compile_rank(net, inputs, {}, mesh=spec, plan=plan, rank=rank, hardware=hw)
    report = explain(result.program, (), result.pipeline)
    compiled = estimate_compiled(result, hw)
    seconds = time.perf_counter() - t0
    try:
        if user:
            raise ValueError("a factory's model has no formula shape")
        shape = models.shape(model, seq=seq)
        if overrides.get("layers"):
            import dataclasses

            shape = dataclasses.replace(shape, layers=overrides["layers"])
        formula = formula_estimate(shape, sizes, plan, batch, hw)
    except (ValueError, TypeError):
        formula = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return Simulation(rank_program=result, report=report, compiled=compiled, formula=formula, seconds=seconds, peak_rss=peak)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt2-small",
                   help=f"built-in model ({', '.join(models.NAMES)}), a transformers config .json, or "
                        "path.to.module:factory (a function returning your nn.Module, or (module, example inputs))")
    p.add_argument("--config", default=None, help="a transformers config.json to build instead of --model")
    p.add_argument("--mesh", default="dp=2", help="mesh sizes such as dp=2,tp=2 (default dp=2)")
    p.add_argument("--rank", type=int, default=0, help="which rank's program to show (default 0)")
    p.add_argument("--batch", type=int, default=None, help="global batch in sequences (default 8, or dp × microbatches)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    p.add_argument("--hardware", default="h100", help="profile for the predictions: h100, h200, a100, cpu, or a .json")
    add_plan_arguments(p)
    p.add_argument("--graph", action="store_true", help="also print the rank's transformed graph")
    p.add_argument("--html", default=None, metavar="PATH",
                   help="also write the plan as one self-contained HTML page (open it in any browser)")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3")
    p.add_argument("--microbatches", type=int, default=1, help="micro-batches per step")
    p.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved, zb-h1, zbv or dualpipev")
    p.add_argument("--virtual", type=int, default=1, help="stages per pp rank (interleaved)")
    p.add_argument("--remat", default="none", help="none, selective or full")
    p.add_argument("--sp", action="store_true", help="sequence parallelism")
    p.add_argument("--vocab-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="shard the embedding and LM head over tp (default: the cost model's choice)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="compute dtype (bf16 needs --zero >= 1)")
    p.add_argument("--no-fusion", action="store_true", help="switch the fuse_comm pass off")


def plan_from_args(args: argparse.Namespace) -> meshc.Plan:
    return meshc.Plan(trace="non-strict", zero=args.zero, microbatches=args.microbatches, schedule=args.schedule,
                      virtual=args.virtual, remat=args.remat, sequence_parallel=args.sp,
                      vocab_parallel=args.vocab_parallel, param_dtype=DTYPES[args.dtype],
                      fusion=False if args.no_fusion else None)


def run(args: argparse.Namespace) -> int:
    model = args.config or args.model
    overrides = {"layers": args.layers} if args.layers else {}
    sim = simulate(model, parse_sizes(args.mesh), rank=args.rank, plan=plan_from_args(args), batch=args.batch,
                   seq=args.seq, hardware=args.hardware, **overrides)
    print(sim.report)
    print(f"\npredicted on {load_hardware(args.hardware).name} (this rank's compiled graphs):")
    print("\n".join(f"  {line}" for line in sim.compiled.lines()))
    if sim.formula is not None:
        print("predicted by the formulas (model sizes only):")
        print("\n".join(f"  {line}" for line in sim.formula.lines()))
    print(f"\nsimulated compile: {sim.seconds:.1f} s, peak memory of this process {sim.peak_rss / 2**30:.2f} GiB")
    if args.graph:
        print("\n" + format_graph(sim.rank_program.program.gm, sim.rank_program.program))
    if args.html:
        path = write_report(args.html, sim.rank_program, sim.report, hardware=args.hardware)
        print(f"\nreport: {path.resolve()} (open it in a browser)")
    return 0
